"""Multi-head softmax attention with grouped K/V heads (GQA), as Qwen3-MoE, GLM-4.5 and gpt-oss
have it: optional per-head q/k RMSNorm, optional q/k/v (and o) bias, RoPE on the leading part
of each head, optional attention sinks (gpt-oss). ``MHAttention`` attends to the whole prefix
(kind "mha"); ``SlidingAttention`` to the last ``sliding_window`` keys (kind "swa"), and the
engine keeps only those keys per request (``RingKVSpec``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..norm import RMSNorm
from ..ops import Linear
from .base import Mixer
from .rope import apply_rope
from .state import KVSpec, RingKVSpec

if TYPE_CHECKING:  # annotations only: arch.py imports the mixers
    from ..arch import MoEArch


class MHAttention(Mixer):
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    exact_path = True

    def __init__(self, arch: MoEArch, layer: int):
        super().__init__(arch, layer)
        self.nq, self.nkv, self.hd = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        H = arch.hidden_size
        bias = arch.attention_bias
        self.q_proj = Linear(H, self.nq * self.hd, bias=bias)
        self.k_proj = Linear(H, self.nkv * self.hd, bias=bias)
        self.v_proj = Linear(H, self.nkv * self.hd, bias=bias)
        self.o_proj = Linear(self.nq * self.hd, H, bias=bias and arch.family.o_proj_bias)
        if arch.use_qk_norm:
            self.q_norm = RMSNorm(self.hd, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()
        # gpt-oss: one learned logit per query head in every softmax's denominator (HF: self_attn.sinks)
        self.sinks = nn.Parameter(torch.zeros(self.nq)) if arch.family.attention_sinks else None
        self.window = self.attention_window(arch)
        # the exact kernels have neither sinks nor windows: gpt-oss's layers are refused under
        # true_on_policy (its experts' biases and clamped GLU are torch's arithmetic too)
        self.exact_path = self.sinks is None and self.window is None

    @classmethod
    def attention_window(cls, arch: MoEArch) -> int | None:
        """Keys a query attends to, its own included (None: all before it)."""
        return None

    @classmethod
    def hf_specs(cls, arch: MoEArch, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        H, hd = arch.hidden_size, arch.head_dim
        q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
        specs: list[tuple[str, tuple[int, ...]]] = []
        for proj, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            specs.append((proj + ".weight", (out, H)))
            if arch.attention_bias:
                specs.append((proj + ".bias", (out,)))
        specs.append(("o_proj.weight", (H, q)))
        if arch.attention_bias and arch.family.o_proj_bias:
            specs.append(("o_proj.bias", (H,)))
        if arch.use_qk_norm:
            specs += [("q_norm.weight", (hd,)), ("k_norm.weight", (hd,))]
        if arch.family.attention_sinks:
            specs.append(("sinks", (arch.num_attention_heads,)))
        return specs

    @classmethod
    def state_spec(cls, arch: MoEArch, layer: int) -> KVSpec:
        return KVSpec(arch.num_key_value_heads, arch.head_dim, arch.head_dim)

    def forward(self, x, cos, sin, attend):
        N = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(N, self.nq, self.hd)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(N, self.nkv, self.hd)), cos, sin)
        v = self.v_proj(x).view(N, self.nkv, self.hd)
        if self.sinks is None and self.window is None:
            out = attend(self.layer, q, k, v)
        else:
            out = attend(self.layer, q, k, v, sinks=self.sinks, window=self.window)
        return self.o_proj(out.reshape(N, self.nq * self.hd))


class SlidingAttention(MHAttention):
    """``MHAttention`` within HF's sliding window: a query sees the ``sliding_window`` keys
    ending at its own. The engine keeps only that many keys per request (a ring)."""

    exact_path = False

    @classmethod
    def attention_window(cls, arch: MoEArch) -> int | None:
        return arch.sliding_window

    @classmethod
    def state_spec(cls, arch: MoEArch, layer: int) -> RingKVSpec:
        return RingKVSpec(arch.num_key_value_heads, arch.head_dim, arch.head_dim, arch.sliding_window)

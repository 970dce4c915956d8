"""Softmax attention with a per-head output gate (Qwen3-Next's and Qwen3.5's full-attention
layers): ``q_proj`` gives 2 x head_dim rows per query head, [q_h; gate_h]; q/k RMSNorm per head
in Gemma's (1 + w) form; partial NeoX rope; the attention output times sigmoid(gate), then
``o_proj``. The attention arithmetic is the layout's (``attend``), as for ``mha``."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..norm import RMSNorm
from ..ops import Linear
from .base import Mixer
from .rope import apply_rope
from .state import KVSpec

if TYPE_CHECKING:  # annotations only: arch.py imports the mixers
    from ..arch import MoEArch


class GatedAttention(Mixer):
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(self, arch: MoEArch, layer: int):
        super().__init__(arch, layer)
        self.nq, self.nkv, self.hd = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        H = arch.hidden_size
        self.q_proj = Linear(H, 2 * self.nq * self.hd, bias=False)
        self.k_proj = Linear(H, self.nkv * self.hd, bias=False)
        self.v_proj = Linear(H, self.nkv * self.hd, bias=False)
        self.o_proj = Linear(self.nq * self.hd, H, bias=False)
        self.q_norm = RMSNorm(self.hd, arch.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(self.hd, arch.rms_norm_eps, zero_centered=True)

    @classmethod
    def hf_specs(cls, arch: MoEArch, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        H, hd = arch.hidden_size, arch.head_dim
        q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
        return [("q_proj.weight", (2 * q, H)), ("k_proj.weight", (kv, H)), ("v_proj.weight", (kv, H)),
                ("o_proj.weight", (H, q)), ("q_norm.weight", (hd,)), ("k_norm.weight", (hd,))]

    @classmethod
    def state_spec(cls, arch: MoEArch, layer: int) -> KVSpec:
        return KVSpec(arch.num_key_value_heads, arch.head_dim, arch.head_dim)

    def forward(self, x, cos, sin, attend):
        N = x.shape[0]
        q, gate = self.q_proj(x).view(N, self.nq, 2 * self.hd).chunk(2, dim=-1)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(N, self.nkv, self.hd)), cos, sin)
        v = self.v_proj(x).view(N, self.nkv, self.hd)
        o = attend(self.layer, q, k, v).reshape(N, self.nq * self.hd) * torch.sigmoid(gate.reshape(N, -1))
        return self.o_proj(o)

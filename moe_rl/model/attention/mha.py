"""Multi-head softmax attention with grouped K/V heads (GQA), as Qwen3-MoE and GLM-4.5 have it:
optional per-head q/k RMSNorm, optional q/k/v bias, RoPE on the leading part of each head."""
from __future__ import annotations

from torch import nn

from ..norm import RMSNorm
from ..ops import Linear
from .base import Mixer
from .rope import apply_rope
from .state import KVSpec


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
        self.o_proj = Linear(self.nq * self.hd, H, bias=False)
        if arch.use_qk_norm:
            self.q_norm = RMSNorm(self.hd, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

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
        if arch.use_qk_norm:
            specs += [("q_norm.weight", (hd,)), ("k_norm.weight", (hd,))]
        return specs

    @classmethod
    def state_spec(cls, arch: MoEArch, layer: int) -> KVSpec:
        return KVSpec(arch.num_key_value_heads, arch.head_dim, arch.head_dim)

    def forward(self, x, cos, sin, attend):
        N = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(N, self.nq, self.hd)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(N, self.nkv, self.hd)), cos, sin)
        v = self.v_proj(x).view(N, self.nkv, self.hd)
        return self.o_proj(attend(self.layer, q, k, v).reshape(N, self.nq * self.hd))

"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash), as HF's ``DeepseekV3Attention``.

Each token is compressed into one latent: ``kv_a_proj_with_mqa(x)`` = [c (kv_lora_rank),
k_rope (qk_rope_head_dim)]; c is RMS-normalised (``kv_a_layernorm``, eps 1e-6 as HF builds it,
not the model's rms_norm_eps) and k_rope is one RoPE'd key head shared by every query head.
``kv_b_proj`` expands c into each head's k_nope (qk_nope_head_dim) and v (v_head_dim). Queries
come from ``q_proj`` or, with ``q_lora_rank``, ``q_b_proj(RMSNorm(q_a_proj(x)))``; their last
qk_rope_head_dim dims are RoPE'd. The softmax scale is qk_head_dim^-0.5, times YaRN's
mscale(factor, mscale_all_dim)^2 under YaRN.

Training (no decode state) attends with the expanded K/V, HF's order of operations. In the
engine the per-slot state is the latent itself ([c ; k_rope], kv_lora_rank + qk_rope_head_dim
per token and layer, ``KVSpec(1, kv_lora + rope, kv_lora, v_in_k=True)``), and attention is
*absorbed*: each head's q_nope goes through its slice of kv_b_proj (W_kc) into the latent
space, so q = [q_nope W_kc ; q_rope] attends over the latents as one shared key/value head
(values: c), and the result goes back through W_vc (SGLang's MLA decode). That reorders the
sums against the trainer's expanded forward (tests/engine: log-probs within 1e-6 in fp32).

Under ``true_on_policy`` (the model's ops exact) training attends in the absorbed order too,
over the latents of the packed batch, with the per-head products as grouped GEMMs of the heads
(``ops.head_linear``): the engine's order of every sum, so its log-probs equal the trainer's
bit for bit. The function is the same; its cost in training is attention over
kv_lora_rank + qk_rope_head_dim wide keys instead of qk_head_dim wide ones.
"""
from __future__ import annotations

import torch

from ..norm import RMSNorm
from ..ops import Linear
from .base import Mixer, linear_weight
from .rope import apply_rope, yarn_mscale
from .state import KVSpec

# HF builds q_a_layernorm and kv_a_layernorm without an eps argument: its RMSNorm default
LATENT_NORM_EPS = 1e-6


class MLAttention(Mixer):
    lora_targets = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    exact_path = True

    def __init__(self, arch, layer: int):
        super().__init__(arch, layer)
        H, nh = arch.hidden_size, arch.num_attention_heads
        self.nh, self.nope, self.rope_dim, self.vd = nh, arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim
        self.kv_lora = arch.kv_lora_rank
        self.interleaved = bool(arch.rope_interleave)
        bias = arch.attention_bias
        qk = self.nope + self.rope_dim
        if arch.q_lora_rank is None:
            self.q_proj = Linear(H, nh * qk, bias=False)
        else:
            self.q_a_proj = Linear(H, arch.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(arch.q_lora_rank, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(H, self.kv_lora + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora, nh * (self.nope + self.vd), bias=False)
        self.o_proj = Linear(nh * self.vd, H, bias=bias)
        self.scale = softmax_scale(arch)

    @classmethod
    def hf_specs(cls, arch, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        """HF's tensors; q_a_proj and kv_a_proj_with_mqa next to each other (SGLang fuses the two
        and loads them only when both arrive in one load_weights call: moe_rl.sync.plan keeps them
        in one bucket)."""
        H, nh = arch.hidden_size, arch.num_attention_heads
        qk, kv_a = arch.qk_head_dim, arch.kv_lora_rank + arch.qk_rope_head_dim
        bias = arch.attention_bias
        specs: list[tuple[str, tuple[int, ...]]] = []
        if arch.q_lora_rank is None:
            specs.append(("q_proj.weight", (nh * qk, H)))
        else:
            specs.append(("q_a_proj.weight", (arch.q_lora_rank, H)))
        specs.append(("kv_a_proj_with_mqa.weight", (kv_a, H)))
        if bias:
            if arch.q_lora_rank is not None:
                specs.append(("q_a_proj.bias", (arch.q_lora_rank,)))
            specs.append(("kv_a_proj_with_mqa.bias", (kv_a,)))
        if arch.q_lora_rank is not None:
            specs += [("q_a_layernorm.weight", (arch.q_lora_rank,)), ("q_b_proj.weight", (nh * qk, arch.q_lora_rank))]
        specs += [("kv_a_layernorm.weight", (arch.kv_lora_rank,)),
                  ("kv_b_proj.weight", (nh * (arch.qk_nope_head_dim + arch.v_head_dim), arch.kv_lora_rank)),
                  ("o_proj.weight", (H, nh * arch.v_head_dim))]
        if bias:
            specs.append(("o_proj.bias", (H,)))
        return specs

    @classmethod
    def state_spec(cls, arch, layer: int) -> KVSpec:
        """The compressed latent [c ; k_rope] per token: the values are its first kv_lora_rank dims."""
        return KVSpec(1, arch.kv_lora_rank + arch.qk_rope_head_dim, arch.kv_lora_rank, v_in_k=True)

    def forward(self, x, cos, sin, attend):
        N = x.shape[0]
        q = self.q_proj(x) if not hasattr(self, "q_a_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(N, self.nh, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        q_rope = apply_rope(q_rope, cos, sin, self.interleaved)
        k_rope = apply_rope(k_rope.view(N, 1, self.rope_dim), cos, sin, self.interleaved)
        if attend.state(self.layer) is None and not self.ops.exact:
            o = self._expanded(q_nope, q_rope, c, k_rope, attend)
        else:
            o = self._absorbed(q_nope, q_rope, c, k_rope, attend)
        return self.o_proj(o.reshape(N, self.nh * self.vd))

    def _expanded(self, q_nope, q_rope, c, k_rope, attend):
        """HF's order: K/V of every head from the latent, attention per head."""
        N = c.shape[0]
        k_nope, v = self.kv_b_proj(c).view(N, self.nh, self.nope + self.vd).split([self.nope, self.vd], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(N, self.nh, self.rope_dim)), dim=-1)
        return attend(self.layer, q, k, v, scale=self.scale)

    def _absorbed(self, q_nope, q_rope, c, k_rope, attend):
        """Attention over the latents: kv_b_proj's per-head blocks W_kc [nope, kv_lora] and
        W_vc [v, kv_lora] are applied to the query and to the output instead of to every key."""
        w = linear_weight(self.kv_b_proj).view(self.nh, self.nope + self.vd, self.kv_lora)
        w_kc, w_vc = w[:, : self.nope], w[:, self.nope :]
        q = torch.cat((self.ops.head_linear(q_nope, w_kc.transpose(1, 2)), q_rope), dim=-1)  # [N, nh, kv_lora + rope]
        latent = torch.cat((c, k_rope[:, 0]), dim=-1).unsqueeze(1)  # [N, 1, kv_lora + rope]
        o = attend(self.layer, q, latent, latent[..., : self.kv_lora], scale=self.scale)  # [N, nh, kv_lora]
        return self.ops.head_linear(o, w_vc)


def softmax_scale(arch) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN with mscale_all_dim
    (HF's ``yarn_apply_mscale``; megatron-core's MLA the same)."""
    scale = arch.qk_head_dim ** -0.5
    rope = arch.rope()
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return scale

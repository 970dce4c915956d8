"""Architecture hyper-parameters of a MoE decoder, with HuggingFace's field names.

One description covers every supported family; ``model_type`` (HF's name) picks the family,
and :data:`FAMILIES` says what is particular to each: its HF class, its router and which of
the fields below it uses. The model code reads only the fields (router, shared experts,
dense layers, attention options), never the family name itself.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # the config reads this module without torch (moe_rl.model's docstring)
    from .attention.rope import Rope


def all_mha(arch: "MoEArch", layer: int) -> str:
    """Every layer softmax attention with grouped K/V heads (``moe_rl.model.attention.mha``)."""
    return "mha"


def by_layer_types(arch: "MoEArch", layer: int) -> str:
    """HF's ``layer_types``: "sliding_attention" layers attend within ``sliding_window`` keys
    (kind "swa"), "full_attention" layers to all (kind "mha")."""
    return "swa" if arch.layer_types[layer] == "sliding_attention" else "mha"


def all_mla(arch: "MoEArch", layer: int) -> str:
    """Every layer multi-head latent attention (``moe_rl.model.attention.mla``)."""
    return "mla"


# multi-head latent attention's fields (HF's names; None in families without it)
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_NO_MLA = {k: None for k in MLA_FIELDS} | {"rope_interleave": False}
# HF's DeepseekV3Config / Glm4MoeLiteConfig defaults, for keys a config.json leaves out
_HF_MLA_DEFAULTS = {
    "deepseek_v3": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
                    "routed_scaling_factor": 2.5, "n_shared_experts": 1},
    "glm4_moe_lite": {"q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
                      "v_head_dim": 256, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.8,
                      "n_shared_experts": 1},
}
# config.json model types that are another family's (Kimi-K2 is DeepSeek-V3's architecture)
_ALIASES = {"kimi_k2": "deepseek_v3"}


LAYER_TYPES = ("linear_attention", "full_attention")  # HF's layer_types of the hybrid families


def hybrid(linear_kind: str) -> Callable[["MoEArch", int], str]:
    """Qwen3-Next / Qwen3.5: HF's ``layer_types`` name each layer "linear_attention" (Gated
    DeltaNet, ``linear_kind``: the family's projection layout) or "full_attention" (softmax
    attention with an output gate)."""

    def kind(arch: "MoEArch", layer: int) -> str:
        return "gated_attention" if arch.layer_types[layer] == "full_attention" else linear_kind

    kind.linear_kind = linear_kind
    return kind


@dataclass(frozen=True)
class Family:
    """What one HF model family fixes.

    ``router``: "softmax" (softmax over all experts, top-k, optional renormalisation; Qwen3-MoE,
    Mixtral), "sigmoid" (sigmoid scores, a correction bias used only to choose experts,
    group-limited top-k, weights from the unbiased scores times ``routed_scaling_factor``;
    GLM-4.5, DeepSeek-V3) or "topk_softmax" (logits with a bias, top-k, softmax over those k;
    gpt-oss). ``experts_key``: the config.json key of the routed-expert count.
    ``fixed``: fields the family has no knob for, with the only value it supports.
    ``attention``: the attention kind of a layer, a key of ``moe_rl.model.attention.MIXERS``
    (families that mix kinds read them from the arch, e.g. HF's ``layer_types``).

    What the family always has (HF's config has no key for it): ``attention_sinks``, a learned
    sink logit per query head in the softmax (gpt-oss); ``o_proj_bias``, o_proj carries a bias
    when ``attention_bias`` does (gpt-oss; GLM's bias is on q/k/v only); ``norm_scale_fp32``,
    RMSNorm multiplies its weight in fp32 before casting (gpt-oss); ``experts``, the experts'
    layout and activation (a key of ``moe_rl.model.transformer.EXPERTS``); ``expert_width_key``,
    the config.json key of the experts' width; ``own_keys``, config.json keys (``MoEArch``
    fields) only this family reads: other families ignore them in a config.json and refuse them
    set in a config.
    ``zero_centered_norm``: the decoder's RMSNorms scale by (1 + weight) in fp32 (Gemma's form).
    ``gated_shared_expert``: a MoE block may have one shared expert of
    ``shared_expert_intermediate_size`` whose output is scaled by sigmoid(x . w_gate).
    """

    architecture: str
    router: Literal["softmax", "sigmoid", "topk_softmax"]
    experts_key: str
    defaults: dict
    fixed: dict
    attention: Callable[["MoEArch", int], str] = all_mha
    attention_sinks: bool = False
    o_proj_bias: bool = False
    norm_scale_fp32: bool = False
    experts: str = "swiglu"
    expert_width_key: str = "moe_intermediate_size"
    own_keys: tuple[str, ...] = ()
    zero_centered_norm: bool = False
    gated_shared_expert: bool = False

    @property
    def hybrid(self) -> bool:
        """Layers of two kinds by HF's ``layer_types`` (``hybrid``)."""
        return hasattr(self.attention, "linear_kind")


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM", "softmax", "num_experts",
        defaults={"use_qk_norm": True, "partial_rotary_factor": 1.0, "rope_interleave": False},
        fixed={"use_qk_norm": True, "partial_rotary_factor": 1.0, "attention_bias": False, "n_shared_experts": 0,
               "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0, **_NO_MLA},
    ),
    "glm4_moe": Family(
        "Glm4MoeForCausalLM", "sigmoid", "n_routed_experts",
        defaults={"use_qk_norm": False, "partial_rotary_factor": 0.5, "rope_interleave": False},  # HF's defaults
        fixed={"mlp_only_layers": [], "decoder_sparse_step": 1, **_NO_MLA},
    ),
    # multi-head latent attention with GLM-4.5's router and shared experts: DeepSeek-V3 (Kimi-K2,
    # Moonlight) and GLM-4.7-Flash; RoPE on qk_rope_head_dim dims (HF: head_dim = qk_rope_head_dim)
    "deepseek_v3": Family(
        "DeepseekV3ForCausalLM", "sigmoid", "n_routed_experts",
        defaults={"use_qk_norm": False, "partial_rotary_factor": 1.0, "rope_interleave": True},
        fixed={"use_qk_norm": False, "partial_rotary_factor": 1.0, "mlp_only_layers": [], "decoder_sparse_step": 1},
        attention=all_mla,
    ),
    "glm4_moe_lite": Family(
        "Glm4MoeLiteForCausalLM", "sigmoid", "n_routed_experts",
        defaults={"use_qk_norm": False, "partial_rotary_factor": 1.0, "rope_interleave": True},
        fixed={"use_qk_norm": False, "partial_rotary_factor": 1.0, "mlp_only_layers": [], "decoder_sparse_step": 1},
        attention=all_mla,
    ),
    # gpt-oss (transformers' GptOssConfig): every layer MoE, router logits with a bias, softmax
    # over the top-k of them; experts [E, H, 2I] with gate/up interleaved, biases, a clamped
    # SwiGLU; sliding-window layers by layer_types; attention sinks; yarn rope
    "gpt_oss": Family(
        "GptOssForCausalLM", "topk_softmax", "num_local_experts",
        defaults={"use_qk_norm": False, "partial_rotary_factor": 1.0, "rope_interleave": False, "swiglu_alpha": 1.702,
                  "swiglu_limit": 7.0},
        fixed={"use_qk_norm": False, "partial_rotary_factor": 1.0, "n_shared_experts": 0, "n_group": 1,
               "topk_group": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0, "mlp_only_layers": [],
               "decoder_sparse_step": 1, "norm_topk_prob": True, **_NO_MLA},
        attention=by_layer_types, attention_sinks=True, o_proj_bias=True, norm_scale_fp32=True,
        experts="clamped_swiglu", expert_width_key="intermediate_size",
        own_keys=("sliding_window", "layer_types", "swiglu_alpha", "swiglu_limit"),
    ),
}
# hybrid Gated DeltaNet families: every layer MoE (SGLang's models have no dense layers), one
# gated shared expert, Gemma norms; Qwen3.5 (qwen3_5_moe_text, the text model of the multimodal
# qwen3_5_moe) always renormalises the top-k and has no knob for it
_HYBRID_FIXED = {"use_qk_norm": True, "attention_bias": False, "n_shared_experts": 0, "n_group": 1,
                 "topk_group": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0, "mlp_only_layers": [],
                 "decoder_sparse_step": 1, **_NO_MLA}
FAMILIES["qwen3_next"] = Family(
    "Qwen3NextForCausalLM", "softmax", "num_experts",
    defaults={"use_qk_norm": True, "partial_rotary_factor": 0.25, "rope_interleave": False}, fixed=_HYBRID_FIXED,
    attention=hybrid("deltanet_qkvz"), zero_centered_norm=True, gated_shared_expert=True,
)
FAMILIES["qwen3_5_moe_text"] = Family(
    "Qwen3_5MoeForCausalLM", "softmax", "num_experts",
    defaults={"use_qk_norm": True, "partial_rotary_factor": 0.25, "rope_interleave": False}, fixed={**_HYBRID_FIXED, "norm_topk_prob": True},
    attention=hybrid("deltanet"), zero_centered_norm=True, gated_shared_expert=True,
)
MULTIMODAL = {"qwen3_5_moe": "qwen3_5_moe_text"}  # a VLM's model_type -> its text model's (text_config)
HYBRID_KEYS = ("layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
               "linear_num_key_heads", "linear_num_value_heads", "shared_expert_intermediate_size")
_BY_ARCHITECTURE = {f.architecture: t for t, f in FAMILIES.items()}


def _other_families_keys(fam: Family) -> set[str]:
    """``MoEArch`` fields that only other families read (``Family.own_keys``); a hybrid family
    reads ``layer_types`` too (its own kinds)."""
    keys = {k for f in FAMILIES.values() for k in f.own_keys} - set(fam.own_keys)
    return keys - {"layer_types"} if fam.hybrid else keys


class MoEArch(BaseModel):
    """The fields of HF's ``Qwen3MoeConfig`` / ``Glm4MoeConfig`` / ``GptOssConfig`` that define
    the computation.

    Names are HF's, so ``config.json`` round-trips (GLM's ``n_routed_experts`` is
    ``num_experts`` here, HF's ``num_local_experts`` for all; gpt-oss's ``intermediate_size``, its
    experts' width, is ``moe_intermediate_size``). Defaults give the tiny CPU model.
    """

    model_config = ConfigDict(extra="forbid")

    model_type: Literal["qwen3_moe", "glm4_moe", "deepseek_v3", "glm4_moe_lite", "gpt_oss", "qwen3_next",
                        "qwen3_5_moe_text"] = Field("qwen3_moe", description=(
        "the model family, as HF's config.json names it: qwen3_moe (Qwen3-MoE), glm4_moe (GLM-4.5, GLM-4.5-Air, "
        "GLM-4.6), deepseek_v3 (DeepSeek-V3, Kimi-K2, Moonlight), glm4_moe_lite (GLM-4.7-Flash), gpt_oss "
        "(gpt-oss-20b/120b), qwen3_next (Qwen3-Next), qwen3_5_moe_text (Qwen3.5-MoE's text model); it fixes the "
        "router and which fields below apply (docs/models.md). With model.path set, its config.json decides"))
    vocab_size: int = Field(64, description="vocabulary size: rows of the embedding and of the LM head")
    hidden_size: int = Field(64, description="width of the residual stream")
    intermediate_size: int = Field(128, description="hidden width of the MLP of a dense layer (a layer without "
                                   "experts: mlp_only_layers, first_k_dense_replace)")
    moe_intermediate_size: int = Field(32, description="hidden width of each routed expert's MLP (and of each "
                                       "shared expert)")
    num_hidden_layers: int = Field(2, description="decoder layers")
    num_attention_heads: int = Field(4, description="query heads per layer")
    num_key_value_heads: int = Field(2, description="key/value heads per layer (grouped-query attention); must "
                                     "divide num_attention_heads. Latent-attention models: set to num_attention_heads")
    head_dim: int = Field(16, description="width of each attention head; latent-attention models: set to "
                          "qk_rope_head_dim")
    num_experts: int = Field(8, description="routed experts per MoE layer (HF: num_experts in Qwen3-MoE, "
                             "n_routed_experts in GLM and DeepSeek); a multiple of train.ep_size")
    num_experts_per_tok: int = Field(2, description="experts each token is routed to (top-k), in [1, num_experts]")
    norm_topk_prob: bool = Field(True, description="renormalise the chosen experts' weights to sum to 1")
    mlp_only_layers: list[int] = Field([], description="Qwen3-MoE: indices of the layers with a dense MLP instead "
                                       "of experts")
    decoder_sparse_step: int = Field(1, description="Qwen3-MoE: every n-th layer has experts, the others a dense "
                                     "MLP; 1 = every layer")
    first_k_dense_replace: int = Field(0, description="GLM, DeepSeek: the first k layers have a dense MLP instead "
                                       "of experts")
    n_shared_experts: int = Field(0, description="GLM, DeepSeek: shared experts every token goes through beside "
                                  "the routed ones (one MLP of n x moe_intermediate_size); 0 in Qwen3-MoE")
    n_group: int = Field(1, description="sigmoid routers (GLM, DeepSeek): expert groups of the group-limited top-k; "
                         "num_experts must be a multiple of it")
    topk_group: int = Field(1, description="sigmoid routers: groups a token may route to (the best topk_group of "
                            "n_group, each scored by the sum of its two best experts)")
    routed_scaling_factor: float = Field(1.0, description="sigmoid routers: the routed experts' weights are "
                                         "multiplied by this")
    partial_rotary_factor: float | None = Field(None, description="share of head_dim that RoPE rotates, in (0, 1]; "
                                                "null = the family's (1.0; 0.5 in GLM-4.5)")
    use_qk_norm: bool | None = Field(None, description="RMSNorm of queries and keys per head; null = the "
                                     "family's (on in Qwen3-MoE, off in GLM-4.5 unless its config.json sets it)")
    attention_bias: bool = Field(False, description="bias on the q/k/v projections (GLM-4.5 has it)")
    rms_norm_eps: float = Field(1e-6, description="epsilon of every RMSNorm")
    rope_theta: float = Field(1_000_000.0, description="RoPE base frequency")
    rope_scaling: dict | None = Field(None, description=(
        "HF's rope_scaling / rope_parameters beyond the base: rope_type (default, yarn) and, for yarn, factor, "
        "original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim; null: default RoPE"))
    # multi-head latent attention (model_type deepseek_v3, glm4_moe_lite; null in the other families)
    q_lora_rank: int | None = Field(None, description=(
        "MLA: width of the compressed query (q_a_proj -> q_a_layernorm -> q_b_proj); null: a plain q_proj"))
    kv_lora_rank: int | None = Field(None, description="MLA: width of the key/value latent the engine caches")
    qk_nope_head_dim: int | None = Field(None, description="MLA: query/key dims per head without RoPE")
    qk_rope_head_dim: int | None = Field(None, description=(
        "MLA: query/key dims per head with RoPE (one key head shared by all heads; HF's head_dim)"))
    v_head_dim: int | None = Field(None, description="MLA: value dims per head")
    rope_interleave: bool | None = Field(None, description=(
        "RoPE on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's) instead of halves; null: the family's"))
    max_position_embeddings: int = Field(512, description="the model's context length: an embedded engine serves "
                                         "at most min(engine.max_context, this) tokens per sequence")
    tie_word_embeddings: bool = Field(False, description="the LM head shares the embedding's weight")
    # gpt-oss (HF's names; other families refuse them)
    sliding_window: int | None = Field(
        None, description="gpt_oss: keys a sliding_attention layer attends to, the query's own included (HF's "
                          "count: key j is seen from query i when i - sliding_window < j <= i)")
    swiglu_alpha: float | None = Field(
        None, description="gpt_oss experts: out = (clamp(up, -limit, limit) + 1) * g * sigmoid(swiglu_alpha * g) with "
                          "g = min(gate, limit) (null: 1.702)")
    swiglu_limit: float | None = Field(None, description="gpt_oss experts: the clamp 'limit' above (null: 7.0)")
    # --- Qwen3-Next / Qwen3.5-MoE (hybrid Gated DeltaNet), HF's names ---------------------------
    layer_types: list[Literal["sliding_attention", "linear_attention", "full_attention"]] | None = Field(
        None, description="each layer's token mixer, one entry per layer. gpt_oss: 'sliding_attention' or "
                          "'full_attention' (null: HF's default, even layers sliding); qwen3_next / qwen3_5_moe_text: "
                          "'linear_attention' (Gated DeltaNet) or 'full_attention' (null: every 4th layer full, HF's "
                          "full_attention_interval 4); other families have none")
    linear_conv_kernel_dim: int = Field(4, ge=2, description="Gated DeltaNet: causal conv kernel width")
    linear_key_head_dim: int = Field(16, ge=1, description="Gated DeltaNet: q/k head dim")
    linear_value_head_dim: int = Field(16, ge=1, description="Gated DeltaNet: value head dim (state is key x value)")
    linear_num_key_heads: int = Field(2, ge=1, description="Gated DeltaNet: q/k heads")
    linear_num_value_heads: int = Field(4, ge=1, description="Gated DeltaNet: value heads, a multiple of "
                                        "linear_num_key_heads")
    shared_expert_intermediate_size: int = Field(0, ge=0, description="Qwen3-Next/Qwen3.5: width of the MoE block's "
                                                 "shared expert, gated by sigmoid(x . shared_expert_gate); 0: none")

    @model_validator(mode="after")
    def _check(self) -> "MoEArch":
        fam = FAMILIES[self.model_type]
        for k in _other_families_keys(fam):
            if getattr(self, k) is not None:
                raise ValueError(f"{k} is a field of another family; model_type={self.model_type!r} has none")
        for k, v in fam.defaults.items():
            if getattr(self, k) is None:
                setattr(self, k, v)
        for k, v in fam.fixed.items():
            if getattr(self, k) != v:
                raise ValueError(f"{k}={getattr(self, k)!r} is not supported by model_type={self.model_type!r} "
                                 f"(it has {v!r}); see moe_rl/model/arch.py FAMILIES")
        if self.is_mla:
            self._check_mla()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError("num_experts_per_tok must be in [1, num_experts]")
        if self.decoder_sparse_step < 1:
            raise ValueError("decoder_sparse_step must be >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers has layer indices out of range: {bad}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must be in [0, num_hidden_layers]")
        if self.n_shared_experts < 0:
            raise ValueError("n_shared_experts must be >= 0")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"num_experts={self.num_experts} must be a multiple of n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        per_group = self.num_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError("group-limited routing scores a group by its two best experts: "
                             f"num_experts / n_group = {per_group} must be >= 2")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts of topk_group="
                             f"{self.topk_group} groups ({self.topk_group * per_group})")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} x head_dim={self.head_dim} "
                             "must give an even rotary width >= 2")
        self.rope()  # rope_scaling is one we compute (raises naming it otherwise)
        if fam.expert_width_key == "intermediate_size":  # one MLP width, the experts' (gpt-oss)
            self.intermediate_size = self.moe_intermediate_size
        if "layer_types" in fam.own_keys:
            if self.layer_types is None:  # HF's default: even layers slide
                self.layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                    for i in range(self.num_hidden_layers)]
            if len(self.layer_types) != self.num_hidden_layers or "linear_attention" in self.layer_types:
                raise ValueError(f"layer_types must list {self.num_hidden_layers} entries (num_hidden_layers), each "
                                 f"sliding_attention or full_attention; got {self.layer_types}")
            if "sliding_attention" in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
                raise ValueError(f"layer_types has sliding_attention layers: sliding_window must be >= 1, "
                                 f"got {self.sliding_window}")
        self._check_hybrid(fam)
        return self

    def _check_hybrid(self, fam: Family) -> None:
        if self.shared_expert_intermediate_size and not fam.gated_shared_expert:
            raise ValueError(f"shared_expert_intermediate_size={self.shared_expert_intermediate_size} is not supported "
                             f"by model_type={self.model_type!r} (a gated shared expert is Qwen3-Next's / Qwen3.5's)")
        if not fam.hybrid:
            return
        if self.layer_types is None:
            self.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must list {self.num_hidden_layers} entries (num_hidden_layers), each one of "
                             f"{LAYER_TYPES}; got {self.layer_types}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads}")

    # --- what the model code reads -------------------------------------------------------
    @property
    def router(self) -> str:
        return FAMILIES[self.model_type].router

    @property
    def family(self) -> Family:
        """What the family fixes beyond the fields (``Family``: sinks, o_proj bias, norm, experts)."""
        return FAMILIES[self.model_type]

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates (HF: ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mla(self) -> bool:
        return FAMILIES[self.model_type].attention is all_mla

    def _check_mla(self) -> None:
        missing = [k for k in MLA_FIELDS[1:] if getattr(self, k) is None]
        if missing:
            raise ValueError(f"model_type={self.model_type!r} (multi-head latent attention) needs {missing}")
        bad = [k for k in MLA_FIELDS if getattr(self, k) is not None and getattr(self, k) < 1]
        if bad:
            raise ValueError(f"{bad} must be >= 1 (q_lora_rank: null for a plain q_proj)")
        # HF's convention: the rotary width is the rope part of a head, and one latent serves
        # every query head (num_key_value_heads is the head count, unused by the math)
        self.head_dim = self.qk_rope_head_dim
        self.num_key_value_heads = self.num_attention_heads

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head of multi-head latent attention (nope + rope)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def rope(self) -> Rope:
        """The rotary embedding every layer that rotates shares."""
        from .attention.rope import Rope

        try:
            return Rope.from_hf(self.rope_scaling, self.rotary_dim, self.rope_theta, bool(self.rope_interleave))
        except ValueError as e:
            raise ValueError(f"rope_scaling: {e}") from None

    def layer_kinds(self) -> list[str]:
        """The attention kind of each layer (``Family.attention``; keys of
        ``moe_rl.model.attention.MIXERS``)."""
        fam = FAMILIES[self.model_type]
        return [fam.attention(self, i) for i in range(self.num_hidden_layers)]

    def is_moe_layer(self, i: int) -> bool:
        """HF's rules for which decoder layers have a sparse MoE block (Qwen3-MoE's
        mlp_only_layers / decoder_sparse_step, GLM's first_k_dense_replace)."""
        return (
            i >= self.first_k_dense_replace
            and i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def dense_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i)]

    # --- HF config.json -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict) -> "MoEArch":
        d = dict(d)
        model_type = d.get("model_type")
        if model_type in MULTIMODAL:  # a VLM checkpoint: its text model (the vision tower is not loaded)
            text = dict(d.get("text_config") or {})
            if d.get("tie_word_embeddings") is not None:
                text["tie_word_embeddings"] = d["tie_word_embeddings"]
            d, model_type = text, MULTIMODAL[model_type]
        if model_type is None and d.get("architectures"):
            model_type = _BY_ARCHITECTURE.get(d["architectures"][0])
        model_type = _ALIASES.get(model_type or "qwen3_moe", model_type or "qwen3_moe")
        if model_type not in FAMILIES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(FAMILIES)} "
                             "(docs/architecture.md says how a family is added)")
        d["model_type"] = model_type
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        if d.get("partial_rotary_factor") is None and "partial_rotary_factor" in rope:
            d["partial_rotary_factor"] = rope["partial_rotary_factor"]
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        d["rope_scaling"] = None if rope_type == "default" else {
            "rope_type": rope_type, **{k: v for k, v in rope.items() if k not in ("type", "rope_type", "rope_theta",
                                                                                   "partial_rotary_factor")}}
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
        fam = FAMILIES[model_type]
        experts = d.get(fam.experts_key)
        if experts is None:
            experts = d.get("num_local_experts")  # transformers v5 spelling
        d["num_experts"] = experts
        d["moe_intermediate_size"] = d.get(fam.expert_width_key)
        for k in _other_families_keys(fam):
            d.pop(k, None)  # e.g. Qwen3-MoE's sliding_window (off), which moe-rl does not model
        if model_type == "qwen3_moe":
            d.pop("use_qk_norm", None)  # Qwen3-MoE always normalises q and k; HF has no such key
        if FAMILIES[model_type].hybrid:
            d.pop("use_qk_norm", None)
            if d.get("layer_types") is None:  # HF's default pattern: every full_attention_interval-th layer full
                every = int(d.get("full_attention_interval") or 4)
                d["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                    for i in range(int(d["num_hidden_layers"]))]
        if FAMILIES[model_type].attention is all_mla:
            _mla_from_hf(d, model_type)
        if d.get("head_dim") is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        kw = {k: d[k] for k in cls.model_fields if d.get(k) is not None}
        if "q_lora_rank" in d:  # null is meaningful: a plain q_proj
            kw["q_lora_rank"] = d["q_lora_rank"]
        return cls(**kw)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "MoEArch":
        p = Path(path) / "config.json"
        if not p.exists():
            raise FileNotFoundError(f"{p}: no config.json in the checkpoint directory")
        try:
            return cls.from_hf_dict(json.loads(p.read_text()))
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None

    def to_hf_dict(self) -> dict:
        fam = FAMILIES[self.model_type]
        d = self.model_dump()
        d.pop("num_experts")
        d.pop("rope_scaling")
        if not self.is_mla:
            for k in (*MLA_FIELDS, "rope_interleave"):
                d.pop(k)
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}
        others = _other_families_keys(fam)
        if fam.hybrid:
            for k in others:
                d.pop(k)
            return self._hybrid_hf_dict(d, rope)
        for k in others | (set(HYBRID_KEYS) - set(fam.own_keys)):
            d.pop(k)
        if self.model_type == "qwen3_moe":  # HF's Qwen3MoeConfig has none of GLM's keys
            for k in ("use_qk_norm", "partial_rotary_factor", "n_shared_experts", "n_group", "topk_group",
                      "routed_scaling_factor", "first_k_dense_replace"):
                d.pop(k)
            d.update(output_router_logits=False, router_aux_loss_coef=0.0, sliding_window=None,
                     use_sliding_window=False)
        elif self.model_type == "gpt_oss":  # GptOssConfig's keys only; intermediate_size is the experts'
            for k in tuple(fam.fixed) + ("moe_intermediate_size",):
                d.pop(k, None)
            d.update(intermediate_size=self.moe_intermediate_size, output_router_logits=False,
                     router_aux_loss_coef=0.0)
        else:
            for k in fam.fixed:  # keys of other families
                d.pop(k, None)
            rope["partial_rotary_factor"] = self.partial_rotary_factor
            d["num_nextn_predict_layers"] = 0  # no MTP layers are modelled (or saved)
        if self.is_mla:
            for k in ("head_dim", "use_qk_norm", "partial_rotary_factor"):
                d.pop(k, None)  # HF derives head_dim (= qk_rope_head_dim); MLA has no q/k norm
            rope.pop("partial_rotary_factor", None)
            d.update(scoring_func="sigmoid", topk_method="noaux_tc", num_mtp_layers=0)
            if self.model_type == "glm4_moe_lite":
                k = self.first_k_dense_replace
                d.pop("first_k_dense_replace")
                d["mlp_layer_types"] = ["dense"] * k + ["sparse"] * (self.num_hidden_layers - k)
        d.update(
            {fam.experts_key: self.num_experts},
            architectures=[fam.architecture],
            num_local_experts=self.num_experts,
            hidden_act="silu",
            attention_dropout=0.0,
            rope_parameters=rope,
            use_cache=True,
        )
        return d

    def _hybrid_hf_dict(self, d: dict, rope: dict) -> dict:
        """Qwen3-Next's / Qwen3.5's config.json: no GLM keys, no q/k-norm switch, partial rotary
        in rope_parameters; Qwen3.5's text config has no dense-layer or renormalisation keys."""
        fam = FAMILIES[self.model_type]
        for k in ("use_qk_norm", "partial_rotary_factor", "n_shared_experts", "n_group", "topk_group",
                  "routed_scaling_factor", "first_k_dense_replace"):
            d.pop(k)
        if self.model_type == "qwen3_5_moe_text":
            for k in ("intermediate_size", "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob"):
                d.pop(k)
        rope["partial_rotary_factor"] = self.partial_rotary_factor
        d.update(architectures=[fam.architecture], num_experts=self.num_experts, hidden_act="silu",
                 attention_dropout=0.0, rope_parameters=rope, use_cache=True, output_router_logits=False,
                 router_aux_loss_coef=0.0)
        return d

def _mla_from_hf(d: dict, model_type: str) -> None:
    """config.json keys of the multi-head-latent-attention families, in place: HF's defaults for
    absent keys, GLM-4.7-Flash's ``mlp_layer_types``, and what moe-rl refuses to guess."""
    for k, v in _HF_MLA_DEFAULTS[model_type].items():
        d.setdefault(k, v)
    d.pop("head_dim", None)  # HF: head_dim is qk_rope_head_dim
    if d.get("scoring_func", "sigmoid") != "sigmoid" or d.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"scoring_func={d.get('scoring_func')!r} topk_method={d.get('topk_method')!r}: only "
                         "DeepSeek-V3's sigmoid / noaux_tc router is supported")
    quant = d.get("quantization_config")
    if quant is not None and quant.get("quant_method") != "fp8":
        raise ValueError(f"quantization_config.quant_method={quant.get('quant_method')!r}: only block-FP8 "
                         "checkpoints (dequantized on load) or unquantized ones load")
    types = d.get("mlp_layer_types")
    if types is not None:
        k = next((i for i, t in enumerate(types) if t != "dense"), len(types))
        if types[k:] != ["sparse"] * (len(types) - k) or len(types) != d.get("num_hidden_layers", len(types)):
            raise ValueError(f"mlp_layer_types={types}: only dense layers first, then sparse ones, are supported")
        d["first_k_dense_replace"] = k

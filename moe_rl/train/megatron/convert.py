"""HuggingFace (Qwen3-MoE, GLM-4.5, gpt-oss; Qwen3-Next and Qwen3.5-MoE at the end) <-> Megatron-core
GPTModel parameter conversion.

Pure torch: nothing here imports megatron, so the mapping is testable anywhere. One
:class:`MegatronLayout` says how the Megatron model was built (which layer spec, which expert
module, the tensor- and expert-parallel shape and this rank's place in it); every function
below derives names, shapes and shards from it and the :class:`~moe_rl.model.MoEArch`.

Megatron's layout of a decoder layer ``i`` (pipeline parallelism is not used):

======================================  ==========================================================
HF                                      Megatron
======================================  ==========================================================
input_layernorm                         ``input_layernorm.weight`` (local spec) or
                                        ``self_attention.linear_qkv.layer_norm_weight`` (TE spec)
q_proj, k_proj, v_proj                  ``self_attention.linear_qkv.weight``, one row block per
                                        query group ``g``: ``[q heads of g; k_g; v_g]``
o_proj                                  ``self_attention.linear_proj.weight``
q/k/v_proj.bias (GLM attention_bias)     ``self_attention.linear_qkv.bias``, grouped as the weight
q_norm, k_norm (Qwen3; GLM use_qk_norm)  ``self_attention.{q,k}_layernorm.weight``
post_attention_layernorm                ``pre_mlp_layernorm.weight``, or for a dense layer under
                                        the TE spec ``mlp.linear_fc1.layer_norm_weight``
mlp.gate (router)                       ``mlp.router.weight``
mlp.gate.e_score_correction_bias (GLM)  ``mlp.router.expert_bias`` (a buffer, fp32)
mlp.shared_experts.{gate,up}_proj (GLM) ``mlp.shared_experts.linear_fc1.weight`` = ``[gate; up]``
mlp.shared_experts.down_proj (GLM)      ``mlp.shared_experts.linear_fc2.weight``
experts.{e}.{gate,up}_proj              ``mlp.experts.local_experts.{j}.linear_fc1.weight``
                                        (SequentialMLP) or ``mlp.experts.linear_fc1.weight{j}``
                                        (TEGroupedMLP, TorchGroupedMLP): ``[gate; up]``, j = e - ep_rank * E_local
experts.{e}.down_proj                   ``...linear_fc2.weight`` likewise
mlp.{gate,up}_proj (dense layer)        ``mlp.linear_fc1.weight`` = ``[gate; up]``
mlp.down_proj (dense layer)             ``mlp.linear_fc2.weight``
gpt-oss: self_attn.o_proj.bias          ``self_attention.linear_proj.bias``
gpt-oss: self_attn.sinks                ``self_attention.core_attention.softmax_offset``
gpt-oss: mlp.router.{weight,bias}       ``mlp.router.weight``, ``mlp.router.bias``
gpt-oss: experts.gate_up_proj[e]        expert e's ``linear_fc1`` weight [2I, H] = ``[gate; up]``:
  [H, 2I], gate/up interleaved          columns 0::2 and 1::2, transposed; ``gate_up_proj_bias[e]``
                                        likewise de-interleaved into the fc1 bias
gpt-oss: experts.down_proj[e] [I, H]    expert e's ``linear_fc2`` weight (transposed) and
                                        ``down_proj_bias[e]`` its bias
======================================  ==========================================================

(expert biases: ``linear_fc{1,2}.bias{j}`` grouped, ``local_experts.{j}.linear_fc{1,2}.bias``
sequential.)

plus ``embedding.word_embeddings.weight``, ``decoder.final_layernorm.weight`` and
``output_layer.weight``. Under tensor parallelism (rank ``r`` of ``tp``) column-parallel
tensors keep rows ``r`` of ``tp`` equal slices (the fused QKV by query groups, a fused
``[gate; up]`` as ``[gate_r; up_r]``), row-parallel ones (``linear_proj``, ``linear_fc2``) keep
columns, the embedding and output layer keep vocabulary rows; norms and the router are
replicated. Experts are not tensor-parallel (expert_tensor_parallel_size = 1): each EP rank
holds whole experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from moe_rl.model import MoEArch, hf_param_specs, parse_expert_name, stacked_expert_rows
from moe_rl.model.arch import FAMILIES
from moe_rl.model.attention import mixer_class


@dataclass(frozen=True)
class MegatronLayout:
    """How the GPTModel was built, and where this rank sits in it."""

    te: bool = False  # Transformer Engine layer spec (norms fused into the following linear)
    grouped_gemm: bool = False  # TEGroupedMLP / TorchGroupedMLP experts (``linear_fc1.weight{j}``); else SequentialMLP
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self):
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.ep_rank < self.ep_size):
            raise ValueError(f"bad layout ranks: {self}")


def check_arch(arch: MoEArch, layout: MegatronLayout) -> None:
    """Raises ValueError for a model/layout pair this converter cannot shard."""
    tp, ep = layout.tp_size, layout.ep_size
    problems = check_hybrid(arch, layout) if FAMILIES[arch.model_type].hybrid else []
    if arch.tie_word_embeddings:
        problems.append("tie_word_embeddings=True (Qwen3-MoE unties them; not supported)")
    if arch.num_experts % ep:
        problems.append(f"num_experts={arch.num_experts} is not divisible by ep_size={ep}")
    if arch.num_key_value_heads % tp:
        problems.append(f"num_key_value_heads={arch.num_key_value_heads} is not divisible by tp_size={tp}")
    if arch.vocab_size % tp:
        problems.append(f"vocab_size={arch.vocab_size} is not divisible by tp_size={tp} (no vocab padding)")
    if arch.intermediate_size % tp and len(arch.moe_layers) < arch.num_hidden_layers:
        problems.append(f"intermediate_size={arch.intermediate_size} is not divisible by tp_size={tp}")
    if (arch.moe_intermediate_size * arch.n_shared_experts) % tp:
        problems.append(f"the shared experts' width {arch.moe_intermediate_size * arch.n_shared_experts} is not "
                        f"divisible by tp_size={tp}")
    if arch.router == "sigmoid":  # what megatron-core's sigmoid routing can express
        if not arch.norm_topk_prob and arch.num_experts_per_tok > 1:
            problems.append("norm_topk_prob=False with a sigmoid router (megatron-core always renormalises the "
                            "top-k sigmoid scores)")
        if arch.n_group > 1 and arch.num_experts_per_tok // arch.topk_group != 2:
            problems.append(f"n_group={arch.n_group} with num_experts_per_tok // topk_group = "
                            f"{arch.num_experts_per_tok // arch.topk_group}: megatron-core scores a group by its "
                            "top (num_experts_per_tok // topk_group) experts, HF by its top 2")
    if arch.family.experts == "clamped_swiglu":  # gpt-oss: what megatron-core's flags can express
        if not arch.attention_bias:
            problems.append("gpt_oss with attention_bias=False (megatron's add_bias_linear puts a bias on every "
                            "linear, the router's and the experts' too)")
        if arch.swiglu_alpha != 1.702:
            problems.append(f"swiglu_alpha={arch.swiglu_alpha} (megatron's quick_gelu has 1.702 built in)")
    rope = arch.rope()
    if arch.is_mla:
        problems += _mla_problems(arch, layout)
    elif rope.rope_type == "yarn" and (rope.attention_factor is not None or rope.interleaved):
        problems.append("yarn rope with an explicit attention_factor or interleaved pairs (megatron derives the "
                        "concentration factor from factor, mscale and mscale_all_dim)")
    if problems:
        raise ValueError("cannot convert this model to Megatron: " + "; ".join(problems))


def _mla_problems(arch: MoEArch, layout: MegatronLayout) -> list[str]:
    """What megatron-core's multi-latent attention (MLATransformerConfig) cannot express."""
    problems = []
    if layout.tp_size > 1:
        problems.append("multi-head latent attention with tp_size > 1 (its tensor-parallel shards are not mapped)")
    if arch.attention_bias:
        problems.append("attention_bias=True with multi-head latent attention (megatron-core's MLA has no biases)")
    rope = arch.rope()
    if rope.rope_type == "yarn":
        if rope.attention_factor is not None:
            problems.append("rope_scaling.attention_factor (megatron-core derives it from factor and mscale)")
        if not rope.truncate:
            problems.append("rope_scaling.truncate=false (megatron-core's YaRN rounds the correction range)")
        if rope.mscale_all_dim and not rope.mscale:
            problems.append("rope_scaling with mscale_all_dim but no mscale (megatron-core then scales cos/sin by "
                            "mscale / mscale_all_dim, HF by mscale(factor))")
    return problems


# --- names ---------------------------------------------------------------------------------
def _layer_names(arch: MoEArch, layout: MegatronLayout, i: int) -> dict[str, str]:
    """Megatron name of every non-expert tensor of decoder layer i, keyed by HF suffix."""
    p = f"decoder.layers.{i}."
    moe = arch.is_moe_layer(i)
    names = {
        "input_layernorm.weight": p + (
            "self_attention.linear_qkv.layer_norm_weight" if layout.te else "input_layernorm.weight"
        ),
        "self_attn.qkv": p + "self_attention.linear_qkv.weight",
        "self_attn.o_proj.weight": p + "self_attention.linear_proj.weight",
        "post_attention_layernorm.weight": p + (
            "mlp.linear_fc1.layer_norm_weight" if layout.te and not moe else "pre_mlp_layernorm.weight"
        ),
    }
    if arch.is_mla:
        del names["self_attn.qkv"]
        a = p + "self_attention."
        if layout.te:  # TE fuses each norm into the linear after it, as for the input norm
            names["input_layernorm.weight"] = p + "input_layernorm.weight"
        if arch.q_lora_rank is None:
            names["self_attn.q_proj.weight"] = a + "linear_q_proj.weight"
        else:
            names["self_attn.q_a_proj.weight"] = a + "linear_q_down_proj.weight"
            names["self_attn.q_a_layernorm.weight"] = a + (
                "linear_q_up_proj.layer_norm_weight" if layout.te else "q_layernorm.weight")
            names["self_attn.q_b_proj.weight"] = a + "linear_q_up_proj.weight"
        names["self_attn.kv_a_proj_with_mqa.weight"] = a + "linear_kv_down_proj.weight"
        names["self_attn.kv_a_layernorm.weight"] = a + (
            "linear_kv_up_proj.layer_norm_weight" if layout.te else "kv_layernorm.weight")
        names["self_attn.kv_b_proj.weight"] = a + "linear_kv_up_proj.weight"
    elif arch.attention_bias:
        names["self_attn.qkv_bias"] = p + "self_attention.linear_qkv.bias"
        if arch.family.o_proj_bias:
            names["self_attn.o_proj.bias"] = p + "self_attention.linear_proj.bias"
    if arch.family.attention_sinks:
        names["self_attn.sinks"] = p + "self_attention.core_attention.softmax_offset"
    if arch.use_qk_norm:
        names["self_attn.q_norm.weight"] = p + "self_attention.q_layernorm.weight"
        names["self_attn.k_norm.weight"] = p + "self_attention.k_layernorm.weight"
    if moe:
        names["mlp.gate.weight"] = p + "mlp.router.weight"
        if arch.router == "sigmoid":
            names["mlp.gate.e_score_correction_bias"] = p + "mlp.router.expert_bias"
        if arch.router == "topk_softmax":  # gpt-oss: HF's mlp.router, with a bias
            names["mlp.router.weight"] = names.pop("mlp.gate.weight")
            names["mlp.router.bias"] = p + "mlp.router.bias"
        if arch.n_shared_experts:
            names["mlp.shared_experts.fc1"] = p + "mlp.shared_experts.linear_fc1.weight"
            names["mlp.shared_experts.down_proj.weight"] = p + "mlp.shared_experts.linear_fc2.weight"
    else:
        names["mlp.fc1"] = p + "mlp.linear_fc1.weight"
        names["mlp.down_proj.weight"] = p + "mlp.linear_fc2.weight"
    return names


def expert_names(layout: MegatronLayout, layer: int, local: int, kind: str = "weight") -> tuple[str, str]:
    """(fc1, fc2) Megatron names of local expert ``local`` of decoder layer ``layer``
    (``kind`` "bias": their biases, gpt-oss)."""
    p = f"decoder.layers.{layer}.mlp.experts."
    if layout.grouped_gemm:
        return p + f"linear_fc1.{kind}{local}", p + f"linear_fc2.{kind}{local}"
    return p + f"local_experts.{local}.linear_fc1.{kind}", p + f"local_experts.{local}.linear_fc2.{kind}"


def megatron_param_specs(arch: MoEArch, layout: MegatronLayout) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of this rank's GPTModel, and the routers' expert-bias buffers, with its
    local shape (a fixed order, not necessarily the module order)."""
    check_arch(arch, layout)
    if FAMILIES[arch.model_type].hybrid:
        return hybrid_param_specs(arch, layout)
    tp = layout.tp_size
    H, hd = arch.hidden_size, arch.head_dim
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    specs: list[tuple[str, tuple[int, ...]]] = [("embedding.word_embeddings.weight", (arch.vocab_size // tp, H))]
    for i in range(arch.num_hidden_layers):
        n = _layer_names(arch, layout, i)
        moe = arch.is_moe_layer(i)
        specs.append((n["input_layernorm.weight"], (H,)))
        if arch.is_mla:  # HF's shapes (tp 1)
            shapes = dict(mixer_class(arch, i).hf_specs(arch, i))
            specs += [(n["self_attn." + k], shapes[k]) for k in shapes if "self_attn." + k in n and k != "o_proj.weight"]
        else:
            specs.append((n["self_attn.qkv"], ((nq + 2 * nkv) * hd // tp, H)))
        if "self_attn.qkv_bias" in n:
            specs.append((n["self_attn.qkv_bias"], ((nq + 2 * nkv) * hd // tp,)))
        specs.append((n["self_attn.o_proj.weight"], (H, nq * (arch.v_head_dim if arch.is_mla else hd) // tp)))
        if "self_attn.o_proj.bias" in n:
            specs.append((n["self_attn.o_proj.bias"], (H,)))
        if "self_attn.sinks" in n:
            specs.append((n["self_attn.sinks"], (nq // tp,)))
        if "self_attn.q_norm.weight" in n:
            specs += [(n["self_attn.q_norm.weight"], (hd,)), (n["self_attn.k_norm.weight"], (hd,))]
        specs.append((n["post_attention_layernorm.weight"], (H,)))
        if moe:
            I = arch.moe_intermediate_size
            for key in ("mlp.gate.weight", "mlp.router.weight"):
                if key in n:
                    specs.append((n[key], (arch.num_experts, H)))
            for key in ("mlp.gate.e_score_correction_bias", "mlp.router.bias"):
                if key in n:
                    specs.append((n[key], (arch.num_experts,)))
            for j in range(arch.num_experts // layout.ep_size):
                fc1, fc2 = expert_names(layout, i, j)
                specs += [(fc1, (2 * I, H)), (fc2, (H, I))]
                if arch.family.experts == "clamped_swiglu":
                    b1, b2 = expert_names(layout, i, j, "bias")
                    specs += [(b1, (2 * I,)), (b2, (H,))]
            if "mlp.shared_experts.fc1" in n:
                S = I * arch.n_shared_experts
                specs += [(n["mlp.shared_experts.fc1"], (2 * S // tp, H)),
                          (n["mlp.shared_experts.down_proj.weight"], (H, S // tp))]
        else:
            I = arch.intermediate_size
            specs += [(n["mlp.fc1"], (2 * I // tp, H)), (n["mlp.down_proj.weight"], (H, I // tp))]
    specs += [("decoder.final_layernorm.weight", (H,)), ("output_layer.weight", (arch.vocab_size // tp, H))]
    return specs


# --- tensor transforms ------------------------------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: MoEArch) -> torch.Tensor:
    """HF q/k/v [heads * hd, H] (or biases [heads * hd]) -> Megatron's fused QKV, grouped by
    query group."""
    nkv, hd = arch.num_key_value_heads, arch.head_dim
    per = arch.num_attention_heads // nkv
    rest = tuple(q.shape[1:])
    return torch.cat(
        [q.reshape(nkv, per * hd, *rest), k.reshape(nkv, hd, *rest), v.reshape(nkv, hd, *rest)], dim=1
    ).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, arch: MoEArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv` (any number of whole query groups)."""
    hd = arch.head_dim
    per = arch.num_attention_heads // arch.num_key_value_heads
    rest = tuple(qkv.shape[1:])
    g = qkv.reshape(-1, (per + 2) * hd, *rest)
    q, k, v = g.split([per * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _rows(t: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    return t.chunk(layout.tp_size, dim=0)[layout.tp_rank] if layout.tp_size > 1 else t


def _cols(t: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    return t.chunk(layout.tp_size, dim=1)[layout.tp_rank] if layout.tp_size > 1 else t


def _fc1(gate: torch.Tensor, up: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    return torch.cat([_rows(gate, layout), _rows(up, layout)], dim=0)


def _unfc1(full: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A gathered fused fc1 ``[gate_0; up_0; gate_1; up_1; ...]`` -> (gate, up)."""
    shards = full.reshape(tp, 2, full.shape[0] // (2 * tp), full.shape[1])
    return shards[:, 0].reshape(-1, full.shape[1]), shards[:, 1].reshape(-1, full.shape[1])


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate/up interleaved along dim 0 (rows 2i gate, 2i + 1 up) -> ``[gate; up]``."""
    return torch.cat((t[0::2], t[1::2]), dim=0)


def interleave(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`deinterleave`: ``[gate; up]`` along dim 0 -> rows gate_0, up_0, gate_1, ..."""
    gate, up = t.chunk(2, dim=0)
    return torch.stack((gate, up), dim=1).reshape(t.shape)


# multi-head latent attention: HF tensors that map one to one (tp 1), but for the RoPE rows
_MLA_SUFFIXES = tuple(f"self_attn.{x}.weight" for x in (
    "q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"))


def _mla_rope_rows(t: torch.Tensor, suffix: str, arch: MoEArch, to_megatron: bool) -> torch.Tensor:
    """megatron-core's MLA always reads the RoPE dims of q and k as interleaved pairs (HF's
    rope_interleave=True). For a NeoX-layout checkpoint (rope_interleave=False) the output rows
    that feed them are reordered, half i going to pair slot 2i and half-rope + i to 2i + 1, so
    that megatron's de-interleave gives back HF's halves (and the inverse on the way back)."""
    if arch.rope_interleave or suffix not in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight",
                                              "self_attn.kv_a_proj_with_mqa.weight"):
        return t
    r = arch.qk_rope_head_dim
    pairs = torch.arange(r).view(2, r // 2).t().reshape(-1)  # slot j holds HF row pairs[j]
    perm = pairs if to_megatron else torch.argsort(pairs)
    if suffix == "self_attn.kv_a_proj_with_mqa.weight":
        c = arch.kv_lora_rank
        return torch.cat([t[:c], t[c:][perm]])
    per = t.view(arch.num_attention_heads, arch.qk_head_dim, -1)
    nope = arch.qk_nope_head_dim
    return torch.cat([per[:, :nope], per[:, nope:][:, perm]], dim=1).reshape(t.shape)


# --- HF -> Megatron -------------------------------------------------------------------------
def hf_to_megatron(
    get: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor], arch: MoEArch, layout: MegatronLayout
) -> dict[str, torch.Tensor]:
    """This rank's Megatron state from HF tensors (``get(name)`` or a mapping of HF names).

    Only the tensors this rank needs are asked for: all dense ones and the experts of its EP
    rank. Returned tensors are new (contiguous) tensors, never views of the inputs.
    """
    check_arch(arch, layout)
    if FAMILIES[arch.model_type].hybrid:
        return hybrid_hf_to_megatron(get, arch, layout)
    fetch = get.__getitem__ if isinstance(get, Mapping) else get
    out: dict[str, torch.Tensor] = {}
    put = lambda name, t: out.__setitem__(name, t.contiguous().clone())  # noqa: E731
    put("embedding.word_embeddings.weight", _rows(fetch("model.embed_tokens.weight"), layout))
    E_local = arch.num_experts // layout.ep_size
    for i in range(arch.num_hidden_layers):
        hp = f"model.layers.{i}."
        n = _layer_names(arch, layout, i)
        put(n["input_layernorm.weight"], fetch(hp + "input_layernorm.weight"))
        for key in _MLA_SUFFIXES:
            if key in n:
                put(n[key], _mla_rope_rows(fetch(hp + key), key, arch, to_megatron=True))
        for kind, key in (("weight", "self_attn.qkv"), ("bias", "self_attn.qkv_bias")):
            if key in n:
                qkv = fuse_qkv(*(fetch(hp + f"self_attn.{x}_proj.{kind}") for x in "qkv"), arch)
                put(n[key], qkv.chunk(layout.tp_size, 0)[layout.tp_rank] if layout.tp_size > 1 else qkv)
        put(n["self_attn.o_proj.weight"], _cols(fetch(hp + "self_attn.o_proj.weight"), layout))
        if "self_attn.sinks" in n:
            put(n["self_attn.sinks"], _rows(fetch(hp + "self_attn.sinks"), layout))
        for key in ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate.e_score_correction_bias",
                    "self_attn.o_proj.bias", "mlp.router.bias"):
            if key in n:
                put(n[key], fetch(hp + key))
        put(n["post_attention_layernorm.weight"], fetch(hp + "post_attention_layernorm.weight"))
        if "mlp.shared_experts.fc1" in n:
            sp = hp + "mlp.shared_experts."
            out[n["mlp.shared_experts.fc1"]] = _fc1(fetch(sp + "gate_proj.weight"), fetch(sp + "up_proj.weight"), layout)
            put(n["mlp.shared_experts.down_proj.weight"], _cols(fetch(sp + "down_proj.weight"), layout))
        if arch.is_moe_layer(i) and arch.family.experts == "clamped_swiglu":
            put(n["mlp.router.weight"], fetch(hp + "mlp.router.weight"))
            ep = hp + "mlp.experts."
            rows = slice(layout.ep_rank * E_local, (layout.ep_rank + 1) * E_local)
            stacks = {k: fetch(ep + k)[rows] for k in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
            for j in range(E_local):
                fc1, fc2 = expert_names(layout, i, j)
                b1, b2 = expert_names(layout, i, j, "bias")
                out[fc1] = deinterleave(stacks["gate_up_proj"][j].t())
                out[b1] = deinterleave(stacks["gate_up_proj_bias"][j])
                put(fc2, stacks["down_proj"][j].t())
                put(b2, stacks["down_proj_bias"][j])
        elif arch.is_moe_layer(i):
            put(n["mlp.gate.weight"], fetch(hp + "mlp.gate.weight"))
            for j in range(E_local):
                e = layout.ep_rank * E_local + j
                ep = hp + f"mlp.experts.{e}."
                fc1, fc2 = expert_names(layout, i, j)
                out[fc1] = torch.cat([fetch(ep + "gate_proj.weight"), fetch(ep + "up_proj.weight")], dim=0)
                put(fc2, fetch(ep + "down_proj.weight"))
        else:
            out[n["mlp.fc1"]] = _fc1(fetch(hp + "mlp.gate_proj.weight"), fetch(hp + "mlp.up_proj.weight"), layout)
            put(n["mlp.down_proj.weight"], _cols(fetch(hp + "mlp.down_proj.weight"), layout))
    put("decoder.final_layernorm.weight", fetch("model.norm.weight"))
    put("output_layer.weight", _rows(fetch("lm_head.weight"), layout))
    return out


# --- Megatron -> HF -------------------------------------------------------------------------
Gather = Callable[[str, torch.Tensor, int], torch.Tensor]
_QKV_SUFFIXES = {f"self_attn.{x}_proj.{kind}" for x in "qkv" for kind in ("weight", "bias")}


def megatron_to_hf(
    get: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor],
    arch: MoEArch,
    layout: MegatronLayout,
    gather: Gather | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every tensor this rank holds, one at a time, in HF order.

    Dense tensors come whole (tensor-parallel shards are joined with ``gather(name, local,
    dim)``, which must return the concatenation of all TP ranks' shards along ``dim``: an
    all-gather in a real run; required when tp_size > 1). Experts come for this EP rank only,
    under their global HF names. Tensors are views of the Megatron tensors where no
    re-layout is needed (norms, router, experts' fc2), new tensors otherwise; callers that
    keep them across an optimizer step must copy.
    """
    check_arch(arch, layout)
    if FAMILIES[arch.model_type].hybrid:
        yield from hybrid_megatron_to_hf(get, arch, layout)
        return
    fetch = get.__getitem__ if isinstance(get, Mapping) else get
    tp = layout.tp_size
    if tp > 1 and gather is None:
        raise ValueError("megatron_to_hf: tp_size > 1 needs a gather function to join TP shards")
    full = (lambda name, dim: gather(name, fetch(name), dim)) if tp > 1 else (lambda name, dim: fetch(name))
    E_local = arch.num_experts // layout.ep_size
    lo = layout.ep_rank * E_local
    cache: dict[str, tuple[torch.Tensor, ...]] = {}  # fused tensors, split once, consumed in order
    for hf_name, _ in hf_param_specs(arch):
        if stacked_expert_rows(hf_name, arch) is not None:  # gpt-oss: this rank's experts, stacked as HF's
            layer, kind = int(hf_name.split(".")[2]), hf_name.rsplit(".", 1)[1]
            w = {"gate_up_proj": lambda j: interleave(fetch(expert_names(layout, layer, j)[0])).t(),
                 "gate_up_proj_bias": lambda j: interleave(fetch(expert_names(layout, layer, j, "bias")[0])),
                 "down_proj": lambda j: fetch(expert_names(layout, layer, j)[1]).t(),
                 "down_proj_bias": lambda j: fetch(expert_names(layout, layer, j, "bias")[1])}[kind]
            yield hf_name, torch.stack([w(j) for j in range(E_local)])
            continue
        parsed = parse_expert_name(hf_name)
        if parsed is not None:
            layer, e, proj = parsed
            if not lo <= e < lo + E_local:
                continue
            fc1, fc2 = expert_names(layout, layer, e - lo)
            if proj == "down_proj":
                yield hf_name, fetch(fc2)
            else:
                gate, up = fetch(fc1).chunk(2, dim=0)
                yield hf_name, gate if proj == "gate_proj" else up
            continue
        if hf_name == "model.embed_tokens.weight":
            yield hf_name, full("embedding.word_embeddings.weight", 0)
        elif hf_name == "model.norm.weight":
            yield hf_name, fetch("decoder.final_layernorm.weight")
        elif hf_name == "lm_head.weight":
            yield hf_name, full("output_layer.weight", 0)
        else:
            i = int(hf_name.split(".")[2])
            suffix = hf_name.split(".", 3)[3]
            n = _layer_names(arch, layout, i)
            if arch.is_mla and suffix in _MLA_SUFFIXES:
                yield hf_name, _mla_rope_rows(fetch(n[suffix]), suffix, arch, to_megatron=False)
            elif suffix in _QKV_SUFFIXES:
                key = n["self_attn.qkv" if suffix.endswith(".weight") else "self_attn.qkv_bias"]
                if key not in cache:
                    cache[key] = split_qkv(full(key, 0), arch)
                q, k, v = cache[key]
                yield hf_name, {"q": q, "k": k, "v": v}[suffix[len("self_attn.")]]
                if suffix.startswith("self_attn.v"):
                    del cache[key]
            elif suffix in ("mlp.gate_proj.weight", "mlp.up_proj.weight",
                            "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"):
                key = n["mlp.shared_experts.fc1" if suffix.startswith("mlp.shared_experts.") else "mlp.fc1"]
                if key not in cache:
                    cache[key] = _unfc1(full(key, 0), tp)
                gate, up = cache[key]
                yield hf_name, gate if ".gate_proj." in suffix else up
                if ".up_proj." in suffix:
                    del cache[key]
            elif suffix in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.shared_experts.down_proj.weight"):
                yield hf_name, full(n[suffix], 1)
            elif suffix == "self_attn.sinks":
                yield hf_name, full(n[suffix], 0)
            else:
                yield hf_name, fetch(n[suffix])


def megatron_expert_owner(name: str, arch: MoEArch, ep_size: int) -> int | None:
    """EP rank holding an HF expert tensor (None for dense tensors, and for gpt-oss's stacked
    expert tensors, whose rows every rank holds a block of): contiguous blocks of
    num_experts / ep_size experts per rank, as megatron-core's MoELayer assigns them."""
    parsed = parse_expert_name(name)
    return None if parsed is None else parsed[1] // (arch.num_experts // ep_size)


# --- the hybrid Gated DeltaNet families (Qwen3-Next, Qwen3.5-MoE) -----------------------------
# HF <-> Megatron-core for the hybrid Gated DeltaNet families (Qwen3-Next, Qwen3.5-MoE).
#
# Megatron-core builds them with its ``gated_delta_net`` attention variant: with Transformer
# Engine ``get_transformer_block_with_experimental_attention_variant_spec`` (each input norm fused
# into the linear after it, as below), without it the backend's local spec (``deltanet.py``), whose
# input norm is the layer's own ``input_layernorm.weight``; at tensor-parallel size 1
# (``check_hybrid``):
#
# =========================================  ======================================================
# HF (layer i)                                Megatron (``decoder.layers.i.``)
# =========================================  ======================================================
# input_layernorm (DeltaNet layer)            ``self_attention.in_proj.layer_norm_weight`` (local:
#                                             ``input_layernorm.weight``, both layer kinds)
# linear_attn.in_proj_qkvz + in_proj_ba       ``self_attention.in_proj.weight``: contiguous sections
# (Qwen3-Next, grouped per key head), or      ``[q, k, v, z, beta, alpha]`` (all heads of each)
# in_proj_qkv/z/b/a (Qwen3.5)
# linear_attn.conv1d.weight [C, 1, K]         ``self_attention.conv1d.weight`` (channels [q; k; v])
# linear_attn.A_log, dt_bias                  ``self_attention.A_log``, ``self_attention.dt_bias``
# linear_attn.norm.weight (plain ``w``)       ``self_attention.out_norm.weight`` = w - 1 (megatron's
#                                             norms scale by 1 + w: layernorm_zero_centered_gamma)
# linear_attn.out_proj                        ``self_attention.out_proj.weight``
# input_layernorm (attention layer)           ``self_attention.linear_qkv.layer_norm_weight``
# self_attn.q_proj (per head [q; gate]),      ``self_attention.linear_qkv.weight``, per query group
# k_proj, v_proj                              ``[q heads; gate heads; k; v]``
# self_attn.o_proj, q_norm, k_norm            ``linear_proj``, ``q_layernorm``, ``k_layernorm``
# post_attention_layernorm                    ``pre_mlp_layernorm.weight``
# mlp.gate, experts                           ``mlp.router.weight``, experts as in ``convert.py``
# mlp.shared_expert.{gate,up,down}_proj       ``mlp.shared_experts.linear_fc1`` ([gate; up]), ``linear_fc2``
# mlp.shared_expert_gate [1, H]               ``mlp.shared_experts.gate_weight``
# =========================================  ======================================================
#
# The decoder's Gemma norms (1 + w) are megatron's zero-centred norms: their weights copy as they
# are. Pure torch, as convert.py.


def check_hybrid(arch: MoEArch, layout: MegatronLayout) -> list[str]:
    """What this converter cannot do for a hybrid model (empty: fine)."""
    problems = []
    if layout.tp_size != 1:
        problems.append(f"model_type={arch.model_type!r} is converted at tensor-parallel size 1 only "
                        f"(tp_size={layout.tp_size})")
    return problems


def _split_sizes(arch: MoEArch) -> list[int]:
    qk = arch.linear_num_key_heads * arch.linear_key_head_dim
    v = arch.linear_num_value_heads * arch.linear_value_head_dim
    return [qk, qk, v, v, arch.linear_num_value_heads, arch.linear_num_value_heads]


def _hybrid_layer_names(arch: MoEArch, layout: MegatronLayout, i: int) -> dict[str, str]:
    """Megatron name of each non-expert tensor of layer i, keyed by HF suffix (the DeltaNet
    input projection and the gated QKV under the keys ``linear_attn.in_proj`` / ``self_attn.qkv``)."""
    p = f"decoder.layers.{i}."
    a = p + "self_attention."
    if arch.layer_types[i] == "linear_attention":
        names = {"input_layernorm.weight": a + "in_proj.layer_norm_weight", "linear_attn.in_proj": a + "in_proj.weight",
                 "linear_attn.conv1d.weight": a + "conv1d.weight", "linear_attn.A_log": a + "A_log",
                 "linear_attn.dt_bias": a + "dt_bias", "linear_attn.norm.weight": a + "out_norm.weight",
                 "linear_attn.out_proj.weight": a + "out_proj.weight"}
    else:
        names = {"input_layernorm.weight": a + "linear_qkv.layer_norm_weight", "self_attn.qkv": a + "linear_qkv.weight",
                 "self_attn.o_proj.weight": a + "linear_proj.weight", "self_attn.q_norm.weight": a + "q_layernorm.weight",
                 "self_attn.k_norm.weight": a + "k_layernorm.weight"}
    if not layout.te:  # the local spec: the input norm is the layer's own module, as in _layer_names
        names["input_layernorm.weight"] = p + "input_layernorm.weight"
    names.update({"post_attention_layernorm.weight": p + "pre_mlp_layernorm.weight",
                  "mlp.gate.weight": p + "mlp.router.weight"})
    if arch.shared_expert_intermediate_size:
        names.update({"mlp.shared_expert.fc1": p + "mlp.shared_experts.linear_fc1.weight",
                      "mlp.shared_expert.down_proj.weight": p + "mlp.shared_experts.linear_fc2.weight",
                      "mlp.shared_expert_gate.weight": p + "mlp.shared_experts.gate_weight"})
    return names


def hybrid_param_specs(arch: MoEArch, layout: MegatronLayout) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of this rank's GPTModel with its shape (a fixed order)."""
    H, hd = arch.hidden_size, arch.head_dim
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    specs = [("embedding.word_embeddings.weight", (arch.vocab_size, H))]
    conv = 2 * arch.linear_num_key_heads * arch.linear_key_head_dim + arch.linear_num_value_heads * arch.linear_value_head_dim
    hv, dv = arch.linear_num_value_heads, arch.linear_value_head_dim
    for i in range(arch.num_hidden_layers):
        n = _hybrid_layer_names(arch, layout, i)
        specs.append((n["input_layernorm.weight"], (H,)))
        if "linear_attn.in_proj" in n:
            specs += [(n["linear_attn.in_proj"], (sum(_split_sizes(arch)), H)),
                      (n["linear_attn.conv1d.weight"], (conv, 1, arch.linear_conv_kernel_dim)),
                      (n["linear_attn.A_log"], (hv,)), (n["linear_attn.dt_bias"], (hv,)),
                      (n["linear_attn.norm.weight"], (dv,)), (n["linear_attn.out_proj.weight"], (H, hv * dv))]
        else:
            specs += [(n["self_attn.qkv"], ((2 * nq + 2 * nkv) * hd, H)), (n["self_attn.o_proj.weight"], (H, nq * hd)),
                      (n["self_attn.q_norm.weight"], (hd,)), (n["self_attn.k_norm.weight"], (hd,))]
        specs += [(n["post_attention_layernorm.weight"], (H,)), (n["mlp.gate.weight"], (arch.num_experts, H))]
        I = arch.moe_intermediate_size
        for j in range(arch.num_experts // layout.ep_size):
            fc1, fc2 = expert_names(layout, i, j)
            specs += [(fc1, (2 * I, H)), (fc2, (H, I))]
        if arch.shared_expert_intermediate_size:
            S = arch.shared_expert_intermediate_size
            specs += [(n["mlp.shared_expert.fc1"], (2 * S, H)), (n["mlp.shared_expert.down_proj.weight"], (H, S)),
                      (n["mlp.shared_expert_gate.weight"], (1, H))]
    return specs + [("decoder.final_layernorm.weight", (H,)), ("output_layer.weight", (arch.vocab_size, H))]


# --- tensor transforms ------------------------------------------------------------------------
def fuse_in_proj(arch: MoEArch, get: Callable[[str], torch.Tensor], prefix: str) -> torch.Tensor:
    """HF DeltaNet projections (``prefix`` = ``model.layers.i.linear_attn.``) -> Megatron's
    in_proj [q; k; v; z; beta; alpha]."""
    H = arch.hidden_size
    if arch.model_type == "qwen3_5_moe_text":
        return torch.cat([get(prefix + f"in_proj_{x}.weight") for x in ("qkv", "z", "b", "a")])
    hk, dk, dv = arch.linear_num_key_heads, arch.linear_key_head_dim, arch.linear_value_head_dim
    r = arch.linear_num_value_heads // hk
    q, k, v, z = get(prefix + "in_proj_qkvz.weight").view(hk, 2 * dk + 2 * r * dv, H).split([dk, dk, r * dv, r * dv], 1)
    b, a = get(prefix + "in_proj_ba.weight").view(hk, 2 * r, H).split([r, r], 1)
    return torch.cat([t.reshape(-1, H) for t in (q, k, v, z, b, a)])


def split_in_proj(arch: MoEArch, fused: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inverse of ``fuse_in_proj``: HF names (relative to ``linear_attn.``) -> tensors."""
    H = fused.shape[1]
    q, k, v, z, b, a = fused.split(_split_sizes(arch))
    if arch.model_type == "qwen3_5_moe_text":
        return {"in_proj_qkv.weight": torch.cat([q, k, v]), "in_proj_z.weight": z, "in_proj_b.weight": b,
                "in_proj_a.weight": a}
    hk = arch.linear_num_key_heads
    qkvz = torch.cat([t.reshape(hk, -1, H) for t in (q, k, v, z)], 1).reshape(-1, H)
    ba = torch.cat([t.reshape(hk, -1, H) for t in (b, a)], 1).reshape(-1, H)
    return {"in_proj_qkvz.weight": qkvz, "in_proj_ba.weight": ba}


def fuse_gated_qkv(q_proj: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: MoEArch) -> torch.Tensor:
    """HF q_proj (per head [q_h; gate_h]), k_proj, v_proj -> Megatron's linear_qkv with an
    output gate: per query group [q heads; gate heads; k; v]."""
    nq, nkv, hd = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    H = q_proj.shape[1]
    qg = q_proj.view(nkv, nq // nkv, 2, hd, H)
    return torch.cat([qg[:, :, 0].reshape(nkv, -1, H), qg[:, :, 1].reshape(nkv, -1, H), k.view(nkv, hd, H),
                      v.view(nkv, hd, H)], 1).reshape(-1, H)


def split_gated_qkv(fused: torch.Tensor, arch: MoEArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_gated_qkv``: (q_proj, k_proj, v_proj)."""
    nq, nkv, hd = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    per, H = nq // nkv, fused.shape[1]
    q, gate, k, v = fused.view(nkv, (2 * per + 2) * hd, H).split([per * hd, per * hd, hd, hd], 1)
    q_proj = torch.stack([q.reshape(nq, hd, H), gate.reshape(nq, hd, H)], 1).reshape(-1, H)
    return q_proj, k.reshape(-1, H), v.reshape(-1, H)


# --- both directions ----------------------------------------------------------------------------
def hybrid_hf_to_megatron(get: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor], arch: MoEArch,
                          layout: MegatronLayout) -> dict[str, torch.Tensor]:
    fetch = get.__getitem__ if isinstance(get, Mapping) else get
    out: dict[str, torch.Tensor] = {}
    put = lambda name, t: out.__setitem__(name, t.contiguous().clone())  # noqa: E731
    put("embedding.word_embeddings.weight", fetch("model.embed_tokens.weight"))
    E_local = arch.num_experts // layout.ep_size
    for i in range(arch.num_hidden_layers):
        hp = f"model.layers.{i}."
        for key, name in _hybrid_layer_names(arch, layout, i).items():
            if key == "linear_attn.in_proj":
                t = fuse_in_proj(arch, fetch, hp + "linear_attn.")
            elif key == "self_attn.qkv":
                t = fuse_gated_qkv(*(fetch(hp + f"self_attn.{x}_proj.weight") for x in "qkv"), arch)
            elif key == "mlp.shared_expert.fc1":
                t = torch.cat([fetch(hp + "mlp.shared_expert.gate_proj.weight"), fetch(hp + "mlp.shared_expert.up_proj.weight")])
            elif key == "linear_attn.norm.weight":
                t = fetch(hp + key) - 1  # plain w -> megatron's zero-centred (1 + w')
            else:
                t = fetch(hp + key)
            put(name, t)
        for j in range(E_local):
            ep = hp + f"mlp.experts.{layout.ep_rank * E_local + j}."
            fc1, fc2 = expert_names(layout, i, j)
            out[fc1] = torch.cat([fetch(ep + "gate_proj.weight"), fetch(ep + "up_proj.weight")])
            put(fc2, fetch(ep + "down_proj.weight"))
    put("decoder.final_layernorm.weight", fetch("model.norm.weight"))
    put("output_layer.weight", fetch("lm_head.weight"))
    return out


def hybrid_megatron_to_hf(get: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor], arch: MoEArch,
                          layout: MegatronLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor this rank holds, in HF order (experts of this EP rank)."""
    fetch = get.__getitem__ if isinstance(get, Mapping) else get
    E_local = arch.num_experts // layout.ep_size
    lo = layout.ep_rank * E_local
    done: dict[int, dict[str, torch.Tensor]] = {}  # the current layer's tensors, derived once
    for hf_name, _ in hf_param_specs(arch):
        parsed = parse_expert_name(hf_name)
        if parsed is not None:
            layer, e, proj = parsed
            if lo <= e < lo + E_local:
                fc1, fc2 = expert_names(layout, layer, e - lo)
                yield hf_name, (fetch(fc2) if proj == "down_proj" else fetch(fc1).chunk(2)[proj == "up_proj"])
            continue
        if hf_name == "model.embed_tokens.weight":
            yield hf_name, fetch("embedding.word_embeddings.weight")
        elif hf_name == "model.norm.weight":
            yield hf_name, fetch("decoder.final_layernorm.weight")
        elif hf_name == "lm_head.weight":
            yield hf_name, fetch("output_layer.weight")
        else:
            i = int(hf_name.split(".")[2])
            if i not in done:
                done.clear()
                done[i] = _layer_to_hf(fetch, arch, layout, i)
            yield hf_name, done[i][hf_name.split(".", 3)[3]]


def _layer_to_hf(fetch, arch: MoEArch, layout: MegatronLayout, i: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, name in _hybrid_layer_names(arch, layout, i).items():
        t = fetch(name)
        if key == "linear_attn.in_proj":
            out.update({"linear_attn." + k: v for k, v in split_in_proj(arch, t).items()})
        elif key == "self_attn.qkv":
            out.update(zip(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                           split_gated_qkv(t, arch)))
        elif key == "mlp.shared_expert.fc1":
            out["mlp.shared_expert.gate_proj.weight"], out["mlp.shared_expert.up_proj.weight"] = t.chunk(2)
        elif key == "linear_attn.norm.weight":
            out[key] = t + 1
        else:
            out[key] = t
    return out

"""megatron-core's Gated DeltaNet layers for the hybrid families (Qwen3-Next, Qwen3.5-MoE).

The GPTModel of these families is megatron-core's own (>= 0.19: its ``gated_delta_net``
attention variant, ``ssm/gated_delta_net``): ``GatedDeltaNet`` on the linear-attention layers,
``SelfAttention`` with ``attention_output_gate`` on the full-attention layers. Two layer specs:

* Transformer Engine (``hybrid_block_spec`` with ``use_te``): megatron's own
  ``get_transformer_block_with_experimental_attention_variant_spec``, its GatedDeltaNet running
  flash-linear-attention's Triton kernels (``causal_conv1d``, ``l2norm``,
  ``chunk_gated_delta_rule``, all with the micro-batch's ``cu_seqlens``) and TE's norm-fused
  linears. Needs CUDA, TE and flash-linear-attention.
* local (no TE): megatron's modules with the input norms unfused (``input_layernorm``, as the
  local spec of the other families), zero-centred RMSNorms (``ZeroCenteredRMSNorm``: megatron's
  local norms refuse ``layernorm_zero_centered_gamma``), the backend's ``TorchSDPAttention``
  core attention, and ``TorchGatedDeltaNet``: megatron's GatedDeltaNet (its projections, gates,
  norm and packing code) with moe-rl's kernels in place of flash-linear-attention's (whose Triton
  kernels do not run on CPU, not even under ``TRITON_INTERPRET=1``: Triton finds no driver).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from unittest import mock

import torch

from moe_rl.kernels.gated_delta import chunk_gated_delta_rule, compute_dtype, l2norm
from moe_rl.model.attention.deltanet import causal_conv
from moe_rl.model.norm import RMSNorm

MIN_MEGATRON = (0, 19)  # the first release whose GatedDeltaNet takes packed sequences (cu_seqlens)


def megatron_version() -> str:
    import megatron.core

    return getattr(megatron.core, "__version__", "unknown")


def has_packed_gated_delta_net() -> bool:
    """Whether the installed megatron-core's GatedDeltaNet trains packed micro-batches (0.16's
    raises NotImplementedError on ``packed_seq_params``)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(megatron_version()).release[:2] >= MIN_MEGATRON
    except InvalidVersion:
        return False


def check_megatron_has_gated_delta_net(model_type: str) -> None:
    have = megatron_version()
    if not has_packed_gated_delta_net():
        raise RuntimeError(
            f"model_type={model_type!r} on train.backend=megatron needs megatron-core >= "
            f"{'.'.join(map(str, MIN_MEGATRON))} (its GatedDeltaNet with packed sequences); megatron-core {have} "
            "is installed, whose GatedDeltaNet has no packed sequences. Upgrade megatron-core or use "
            "train.backend=native")


class ZeroCenteredRMSNorm(RMSNorm):
    """The norm of megatron's ``layernorm_zero_centered_gamma`` (x_hat * (1 + w), the native
    model's Gemma form) for the local spec, built as megatron builds its norms."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps, zero_centered=True)
        self.weight.data = self.weight.data.to(config.params_dtype)


# --- moe-rl's kernels behind flash-linear-attention's signatures -----------------------------
def packed_causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None):
    """fla's ``causal_conv1d`` as GatedDeltaNet calls it (x [B, T, C], weight [C, K], SiLU) by
    ``moe_rl.model.attention.deltanet.causal_conv``: each packed sequence (each row without
    ``cu_seqlens``) convolved with its own zero left context."""
    if bias is not None or initial_state is not None or output_final_state or activation not in ("silu", "swish"):
        raise ValueError("packed_causal_conv1d: SiLU, no bias, no initial or final state (megatron's training call)")
    B, T, C = x.shape
    cu = _cu_seqlens(cu_seqlens, B, T, x.device)
    out, _ = causal_conv(x.reshape(B * T, C), weight, cu)
    return out.view(B, T, C), None


def packed_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """fla's ``chunk_gated_delta_rule`` as GatedDeltaNet calls it (q, k [B, T, H, Dk] normalised,
    v [B, T, H, Dv], g, beta [B, T, H]; q scaled by ``scale``, default Dk^-1/2, as fla) by
    ``moe_rl.kernels.gated_delta.chunk_gated_delta_rule``: torch on CPU tensors, its Triton scan
    on CUDA ones; packed sequences never see each other's state. Output in v's dtype."""
    if initial_state is not None or output_final_state or use_qk_l2norm_in_kernel:
        raise ValueError("packed_gated_delta_rule: no initial or final state, q/k normalised by the caller "
                         "(megatron's training call)")
    B, T, H, Dk = q.shape
    scale = Dk ** -0.5 if scale is None else scale
    flat = lambda t: t.reshape((B * T,) + tuple(t.shape[2:]))  # noqa: E731
    o, _ = chunk_gated_delta_rule(flat(q).to(compute_dtype(q.dtype)) * scale, flat(k), flat(v), flat(g), flat(beta),
                                  _cu_seqlens(cu_seqlens, B, T, q.device))
    return o.to(v.dtype).view(B, T, H, -1), None


def l2norm_fp32(x: torch.Tensor) -> torch.Tensor:
    """fla's ``l2norm``: computed in fp32 (the native model's order), returned in x's dtype."""
    return l2norm(x.to(compute_dtype(x.dtype))).to(x.dtype)


def _cu_seqlens(cu_seqlens, B: int, T: int, device) -> torch.Tensor:
    if cu_seqlens is None:  # each batch row one sequence
        return torch.arange(0, (B + 1) * T, T, device=device)
    if B != 1:
        raise ValueError(f"packed sequences (cu_seqlens) come as one row, got a batch of {B}")
    return cu_seqlens


@contextlib.contextmanager
def _moe_rl_kernels():
    """Binds megatron's flash-linear-attention names (``gated_delta_net.common``'s ``HAVE_FLA``
    and ``l2norm``, ``gdn``'s ``causal_conv1d``) to moe-rl's for the duration: the module reads
    them as module globals, in its constructor and in its forward."""
    common = importlib.import_module("megatron.core.ssm.gated_delta_net.common")
    gdn = importlib.import_module("megatron.core.ssm.gated_delta_net.gdn")
    patches = [(common, "HAVE_FLA", True), (common, "l2norm", l2norm_fp32), (gdn, "causal_conv1d", packed_causal_conv1d)]
    for mod, name, _ in patches:
        if not hasattr(mod, name):
            raise RuntimeError(f"megatron-core {megatron_version()}: {mod.__name__} has no {name!r} to bind "
                               "moe-rl's DeltaNet kernels to")
    with contextlib.ExitStack() as stack:
        for mod, name, value in patches:
            stack.enter_context(mock.patch.object(mod, name, value))
        yield


@functools.cache
def torch_gated_delta_net_class():
    """``TorchGatedDeltaNet`` (defined on first use: megatron-core is an optional dependency)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from .attention import TorchSDPAttention

    class TorchGatedDeltaNet(GatedDeltaNet):
        """megatron-core's GatedDeltaNet with moe-rl's conv and chunked rule (torch on CPU,
        moe-rl's Triton scan on CUDA) in place of flash-linear-attention's, for the local spec.
        The local spec passes the packing as the block-causal mask (``TorchSDPAttention``'s
        contract); it goes to megatron's packed path as ``cu_seqlens``."""

        def __init__(self, *args, **kwargs):
            with _moe_rl_kernels():
                super().__init__(*args, **kwargs)

        def _setup_variant_attrs(self):
            super()._setup_variant_attrs()
            if self.config.deterministic_mode:  # megatron's torch rule: no packed sequences
                raise ValueError("TorchGatedDeltaNet: deterministic_mode is not supported (megatron's torch rule "
                                 "ignores packed sequences); moe-rl's rule is deterministic")
            self.gated_delta_rule = packed_gated_delta_rule

        def forward(self, hidden_states, attention_mask, inference_context=None, packed_seq_params=None,
                    sequence_len_offset=None, **kwargs):
            if packed_seq_params is None and attention_mask is not None:
                cu = TorchSDPAttention.packing(attention_mask).cu_seqlens.to(torch.int32)
                longest = hidden_states.shape[0]
                packed_seq_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                    max_seqlen_q=longest, max_seqlen_kv=longest)
            with _moe_rl_kernels():
                return super().forward(hidden_states, None, inference_context, packed_seq_params,
                                       sequence_len_offset, **kwargs)

    return TorchGatedDeltaNet


# --- layer specs --------------------------------------------------------------------------------
def hybrid_block_spec(arch, config, use_te: bool):
    """The decoder block spec of a hybrid model (``config.linear_attention_freq``: 1 = Gated
    DeltaNet, 0 = gated softmax attention; every layer MoE)."""
    check_megatron_has_gated_delta_net(arch.model_type)
    if use_te:
        return _te_block_spec(arch, config)
    return _local_block_spec(config)


def _te_block_spec(arch, config):
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec)
    from megatron.core.ssm.gated_delta_net import HAVE_FLA

    if not HAVE_FLA:
        raise RuntimeError(
            f"model_type={arch.model_type!r} with Transformer Engine (train.megatron_use_te=true) runs megatron-core's "
            "GatedDeltaNet on flash-linear-attention's kernels, which do not import: pip install "
            "'flash-linear-attention==0.6.0' (the moe-rl[megatron-gdn] extra), or train.megatron_use_te=false "
            "(megatron's layer with moe-rl's kernels)")
    return get_transformer_block_with_experimental_attention_variant_spec(config)


def _local_block_spec(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from .attention import TorchSDPAttention

    if any(not moe for moe in config.moe_layer_freq):
        raise ValueError("hybrid model with dense (non-MoE) layers: not built by the megatron backend")
    local = get_gpt_layer_local_submodules(num_experts=config.num_moe_experts, qk_layernorm=True,
                                           normalization="RMSNorm")
    attention = local.self_attention
    attention.submodules.q_layernorm = attention.submodules.k_layernorm = ZeroCenteredRMSNorm
    attention.submodules.core_attention = TorchSDPAttention
    delta = ModuleSpec(module=torch_gated_delta_net_class(), submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=ZeroCenteredRMSNorm, out_proj=RowParallelLinear))
    layers = [ModuleSpec(module=TransformerLayer, submodules=dataclasses.replace(
        local, input_layernorm=ZeroCenteredRMSNorm, self_attention=delta if linear else attention,
        pre_mlp_layernorm=ZeroCenteredRMSNorm)) for linear in config.linear_attention_freq]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=ZeroCenteredRMSNorm)

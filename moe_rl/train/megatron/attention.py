"""Fused torch attention for megatron-core's local spec (no Transformer Engine).

megatron-core's local ``DotProductAttention`` materialises the [b, heads, s, s] scores (baddbmm,
masked_fill, softmax, bmm) over the whole packed row, so a row of n sequences costs n times the
attention work and all of its memory traffic. ``TorchSDPAttention`` is a drop-in core attention
that runs the native model's ``PackedCausal`` (each sequence right-padded to the longest and
attended with ``scaled_dot_product_attention(is_causal=True)``). The backend hands the local spec
a block-causal boolean mask (True = masked); the sequence boundaries are read from it once per
mask (one host read, cached across the layers that share the mask) and the mask is checked to be
exactly block-causal, so any other mask is refused rather than silently attended differently.

gpt-oss: ``softmax_type="learnable"`` gives the module megatron's ``softmax_offset`` parameter
[heads] (HF's sinks), and a layer that megatron's ``is_layer_window_attention`` marks sliding
attends within ``window_size[0] + 1`` keys (megatron's (left, 0): keys i - left .. i); both go to
the native model's attention arithmetic (``layouts.sdpa``), inside each packed sequence.
"""
from __future__ import annotations

import torch
from torch import nn

from moe_rl.model.attention import PackedCausal


def is_layer_window_attention(window_size, skip_freq, layer_number: int) -> bool:
    """megatron-core's own rule (transformer/utils.py), which 0.16 and 0.19 share."""
    from megatron.core.transformer.utils import is_layer_window_attention as rule

    return rule(window_size, skip_freq, layer_number)


class TorchSDPAttention(nn.Module):
    def __init__(self, config, layer_number: int = 1, attn_mask_type=None, attention_type=None, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None, **extra):
        super().__init__()
        _refuse_unknown("constructor", extra)
        if (attention_dropout or config.attention_dropout) or config.apply_query_key_layer_scaling \
                or config.context_parallel_size != 1 or config.tensor_model_parallel_size != 1:
            raise ValueError("TorchSDPAttention: no attention dropout or query-key layer scaling, TP = CP = 1 only")
        self.config = config
        self.layer_number = layer_number
        # None: 1/sqrt(head dim); multi-latent attention passes its own (YaRN's mscale);
        # k_channels / v_channels (MLA: they differ) are read off the tensors
        self.softmax_scale = softmax_scale
        self.window = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            if right != 0:
                raise ValueError(f"TorchSDPAttention: window_size={config.window_size}; only causal windows (left, 0)")
            self.window = left + 1
        softmax = getattr(config, "softmax_type", "vanilla")
        if softmax == "learnable":  # megatron's name and shape (DotProductAttention.softmax_offset)
            self.softmax_offset = nn.Parameter(torch.empty(config.num_attention_heads, dtype=config.params_dtype))
        elif softmax != "vanilla":
            raise ValueError(f"TorchSDPAttention: softmax_type={softmax!r} is not implemented (vanilla, learnable)")
        else:
            self.softmax_offset = None

    # (mask, its layout): every layer of a forward gets the same mask (the same object, or under
    # recompute a detached alias of it: the same memory and version counter), so the layout is
    # read once per micro-batch forward; holding the mask keeps its memory from being reused
    _last: tuple[torch.Tensor, PackedCausal, int] | None = None

    @classmethod
    def packing(cls, mask: torch.Tensor) -> PackedCausal:
        """The packed layout behind a block-causal mask [1, 1, T, T] (True = masked)."""
        if cls._last is not None and _same_tensor(cls._last[0], mask) and mask._version == cls._last[2]:
            return cls._last[1]
        T = mask.shape[-1]
        if mask.dtype != torch.bool or tuple(mask.shape) != (1, 1, T, T):
            raise ValueError(f"TorchSDPAttention expects a bool [1, 1, T, T] mask, got {mask.dtype} {tuple(mask.shape)}")
        m = mask[0, 0]
        starts = torch.diagonal(m, -1).nonzero().flatten() + 1  # token i cannot see i - 1: a new sequence
        zero, end = starts.new_zeros(1), starts.new_full((1,), T)
        packed = PackedCausal(torch.cat([zero, starts, end]), T)
        if not torch.equal(packed.mask, ~m):
            raise ValueError("TorchSDPAttention: the attention mask is not block-causal over packed sequences")
        cls._last = (mask, packed, mask._version)
        return packed

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **extra):
        """query [s, b=1, heads, d], key/value [s, 1, groups, d] -> [s, 1, heads * d]."""
        _refuse_unknown("forward", extra)
        if attention_bias is not None or packed_seq_params is not None or query.shape[1] != 1:
            raise ValueError("TorchSDPAttention: one packed row, a block-causal mask, no bias or packed_seq_params")
        if attention_mask is None:
            raise ValueError("TorchSDPAttention needs the block-causal mask the megatron backend passes")
        s = query.shape[0]
        out = self.packing(attention_mask)(self.layer_number, query[:, 0], key[:, 0], value[:, 0],
                                           scale=self.softmax_scale, sinks=self.softmax_offset, window=self.window)
        return out.reshape(s, 1, -1)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` is ``a`` or views the same elements (a detached alias: activation recompute passes
    each layer a detached copy of its inputs)."""
    return a is b or (a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                      and a.storage_offset() == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride())


def _refuse_unknown(where: str, extra: dict) -> None:
    """Arguments a megatron-core release passes that this module does not implement: ignored
    only while unset, refused otherwise (never silently dropped)."""
    used = {k: v for k, v in extra.items() if v is not None and v is not False}
    if used:
        raise ValueError(f"TorchSDPAttention {where}: unsupported megatron-core arguments {sorted(used)}; "
                         "use Transformer Engine (train.megatron_use_te=true)")

"""Batch-invariant ("exact") kernels: every reduction in an order fixed by the shape of one row,
never by the number of rows, so a token's result is the same bits alone or batched, in a
prefill or a decode step, in the engine or the trainer (DESIGN.md, contract 12).

One module per op, each with its CPU kernel (C++ in csrc/exact*.cpp, ``moe_rl._C``), its Triton
kernel for GPUs (one fixed config per dtype, no split-K), an ``autograd.Function`` (the exact
forward, a plain-torch backward) and a plain-torch reference:

* ``linear``: ``x @ w.T + b``;  ``grouped_linear``: the MoE experts' GEMM over expert-sorted rows;
* ``rms_norm``;  ``log_softmax``, ``softmax``, ``token_logprobs``;
* ``attention`` (``packed_attention``, ``cached_attention``): causal, GQA, windows, sinks;
* ``moe_combine``: the top-k slots summed in slot order in fp32;  ``silu_mul``, ``sigmoid``;
* ``seeded_sample``: Gumbel-max from a hash of (seed, position, token).

CPU tensors run the C++ kernels, CUDA tensors the Triton ones (``impl=`` picks explicitly;
"triton" on CPU tensors under ``TRITON_INTERPRET=1``). docs/exact_kernels.md has the
guarantees, the orders and the costs.
"""
from ._common import isa, num_threads, set_isa, set_num_threads
from .attention import (attention, attention_reference, cached_attention, packed_attention,
                        packed_attention_reference)
from .linear import linear
from .moe import grouped_linear, moe_combine, sigmoid, silu_mul
from .norm import rms_norm, rms_norm_reference
from .sampling import gumbel_uniform, seeded_sample
from .softmax import log_softmax, softmax, token_logprobs

__all__ = [
    "attention", "attention_reference", "cached_attention", "packed_attention", "packed_attention_reference",
    "linear", "grouped_linear",
    "moe_combine", "sigmoid", "silu_mul", "rms_norm", "rms_norm_reference", "log_softmax", "softmax",
    "token_logprobs", "seeded_sample", "gumbel_uniform", "isa", "set_isa", "num_threads", "set_num_threads",
]

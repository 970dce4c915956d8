"""Seeded sampling that does not depend on the batch: a request's token at a position is a
function of its log-probs, its seed and that position only (Gumbel-max with counter-based
noise).

Row r picks ``argmax_v(logp[r, v] + g_v)`` (the first on ties), ``g_v = -log(-log(u_v))``, where
``u_v`` in (0, 1) is the top 24 bits of a 32-bit hash of ``(seed[r], position[r], v)``,
centred in their interval. That is an exact draw from ``softmax(logp)`` for independent
uniforms, and nothing in it is shared between rows: no generator state, no draw order, so the
sample is the same alone or batched, in any step, after a retraction or a restart. Tokens to
exclude (top-k/top-p/min-p) carry ``logp = -inf`` and are never picked.

* CPU (``moe_rl._C.exact_gumbel_argmax``): one pass per row, the noise made on the fly.
* GPU: the same hash in int64 torch ops (no product above 2^49: exact), the Gumbel transform
  and the argmax by torch's CUDA kernels (one function per element). ``gumbel_uniform`` gives
  the uniforms of either path: equal bit for bit (the hash is integer maths).

``position`` is the index of the sampled token in its sequence (prompt length + tokens
generated so far), so two requests with one seed still draw differently at each step, and a
resumed request draws what it would have drawn.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _common as C

_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64, without a product above 2^49."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_key(seed: Tensor, pos: Tensor) -> Tensor:
    s_lo, s_hi = seed & _M32, (seed >> 32) & _M32
    p_lo, p_hi = pos & _M32, (pos >> 32) & _M32
    h = _mix32(s_lo ^ _mix32((s_hi + 0x9E3779B9) & _M32))
    h = _mix32(h ^ p_lo)
    return _mix32(h ^ _mix32((p_hi + 0x7F4A7C15) & _M32))


def _uniform_torch(seeds: Tensor, positions: Tensor, V: int) -> Tensor:
    key = _row_key(seeds.long(), positions.long())[:, None]
    v = torch.arange(V, device=seeds.device, dtype=torch.int64)
    h = _mix32((key + _mul32(v, 0x9E3779B9)[None, :]) & _M32)
    return ((h >> 8).float() + 0.5) * (1.0 / 16777216.0)


def _check(logp: Tensor, seeds: Tensor, positions: Tensor) -> None:
    if logp.dim() != 2 or logp.dtype != torch.float32:
        raise ValueError(f"seeded_sample: logp must be float32 [rows, vocab], got {logp.dtype} {tuple(logp.shape)}")
    R = logp.shape[0]
    for name, t in (("seeds", seeds), ("positions", positions)):
        if t.shape != (R,) or t.dtype != torch.int64:
            raise ValueError(f"seeded_sample: {name} must be int64 [{R}], got {t.dtype} {tuple(t.shape)}")


def gumbel_uniform(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """The uniforms [rows, vocab] (fp32) the sampler uses for each row's (seed, position)."""
    if seeds.device.type == "cpu":
        s, p = seeds.long().contiguous(), positions.long().contiguous()
        out = torch.empty(s.shape[0], vocab, dtype=torch.float32)
        C._C.exact_gumbel_uniform(s.data_ptr(), p.data_ptr(), s.shape[0], vocab, out.data_ptr())
        return out
    return _uniform_torch(seeds, positions, vocab)


def seeded_sample(logp: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """One token per row of ``logp`` [R, V] (fp32 log-probs of the sampling distribution, after
    temperature and truncation, ``-inf`` where excluded) -> int64 [R] on logp's device.
    ``seeds``/``positions``: int64 [R] on logp's device."""
    _check(logp, seeds, positions)
    R, V = logp.shape
    if logp.device.type == "cpu":
        lp = logp if logp.stride(1) == 1 else logp.contiguous()
        s, p = seeds.contiguous(), positions.contiguous()
        out = torch.empty(R, dtype=torch.int64)
        C._C.exact_gumbel_argmax(lp.data_ptr(), lp.stride(0), R, V, s.data_ptr(), p.data_ptr(), out.data_ptr(),
                                 C.num_threads())
        return out
    g = -torch.log(-torch.log(_uniform_torch(seeds, positions, V)))
    return (logp + g).argmax(dim=-1)

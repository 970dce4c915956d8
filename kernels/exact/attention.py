"""Batch-invariant causal attention: a query's output depends only on its own query, its
sequence's keys and values and its position, never on the other queries computed with it, so a
full prefill, a chunked prefill and a decode step against a KV cache give the same bits.

Every query at position ``p`` reduces over its keys ``t`` in ``[max(0, p - window + 1), p]`` in
blocks of a fixed number of keys aligned to position 0 of its sequence, with an online
softmax: per block the scores ``scale * q.k``, the running max, the rescale of the running sum
and of the output accumulator by ``exp(m_old - m_new)``, then the block's ``exp(s - m_new)``
added; finally the sinks (one logit per head, a key with a zero value: GPT-OSS) join the
denominator, and the output is ``acc / l``. GQA (``Hq`` a multiple of ``Hkv``) and differing
query/key and value head dims (MLA) are supported.

* CPU (``moe_rl._C.exact_attention``): blocks of 64 keys; one (query, head) at a time, the
  scores in the dot-product lane order of csrc/exact.h, the block's sum in lanes, the value
  accumulation key by key in block order; threads split (query, head) pairs.
* GPU (Triton): tiles of BLOCK_M queries of one sequence x blocks of BLOCK_N keys, ``tl.dot``
  for the scores and the values, one config per dtype. A query's row of a tile is computed from
  its own data only; blocks a query does not see (before its window, after its position) leave
  its state unchanged bit for bit, so the tile it lands in (or a decode tile of one query) does
  not matter.

Layout: ``q [Nq, Hq, Dqk]`` holds the queries of sequences ``s`` at rows
``cu_seqlens_q[s]:cu_seqlens_q[s+1]``, at positions ``pos0[s], pos0[s] + 1, ...``; the keys and
values of sequence ``s`` are ``k[kv_seq[s], kv_start[s] + t]`` of ``k [Sk, T, Hkv, Dqk]`` and
``v [Sk, T, Hkv, Dv]`` (any strides, the head dim contiguous), written before the call (a
decode step writes its new key into the cache first). ``packed_attention`` (a packed training
batch) and ``cached_attention`` (the engine's ``[slots, Hkv, ctx, D]`` cache) fill these in.
Differentiable; the backward is plain torch (the reference recomputed under autograd).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _common as C
from ..grouped_gemm import tile_plan

CPU_BLOCK = 64  # keys per block of the CPU kernel (csrc/exact.h: ATTN_BLOCK)

if C.triton is not None:
    triton, tl = C.triton, C.tl

    # the sequence count and the index tensors' alignment change from step to step (how requests
    # fall into prefill steps): one build serves them all, none compiles inside a measured step
    @triton.jit(do_not_specialize=["S"], do_not_specialize_on_alignment=[
        "tile_seq_ptr", "tile_row_ptr", "cu_ptr", "pos0_ptr", "kv_seq_ptr", "kv_start_ptr"])
    def _exact_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, sinks_ptr, tile_seq_ptr, tile_row_ptr, cu_ptr, pos0_ptr,
                                kv_seq_ptr, kv_start_ptr, S, G, window, scale,
                                stride_qn, stride_qh, stride_ks, stride_kt, stride_kh,
                                stride_vs, stride_vt, stride_vh, stride_on, stride_oh,
                                DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr,
                                PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
        tile = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.load(tile_seq_ptr + tile)
        if s < S:
            row0 = tl.load(tile_row_ptr + tile)
            q_start = tl.load(cu_ptr + s)
            q_end = tl.load(cu_ptr + s + 1)
            p0 = tl.load(pos0_ptr + s) - q_start  # position of row r: p0 + r
            rows = row0 + tl.arange(0, BLOCK_M)
            rmask = rows < q_end
            pos = p0 + rows
            hk = h // G
            k_base = k_ptr + tl.load(kv_seq_ptr + s) * stride_ks + tl.load(kv_start_ptr + s) * stride_kt + hk * stride_kh
            v_base = v_ptr + tl.load(kv_seq_ptr + s) * stride_vs + tl.load(kv_start_ptr + s) * stride_vt + hk * stride_vh
            dq = tl.arange(0, BLOCK_DQK)
            dv = tl.arange(0, BLOCK_DV)
            q = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qn + h * stride_qh + dq[None, :],
                        mask=rmask[:, None] & (dq[None, :] < DQK), other=0.0)
            if DOT_FP32:
                q = q.to(tl.float32)
            p_hi = p0 + tl.minimum(row0 + BLOCK_M, q_end) - 1  # the tile's last position
            lo = tl.where(window > 0, tl.maximum(p0 + row0 - window + 1, 0), 0)
            m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
            for b0 in range(lo // BLOCK_N * BLOCK_N, p_hi + 1, BLOCK_N):
                t = b0 + tl.arange(0, BLOCK_N)
                tmask = t <= p_hi
                k = tl.load(k_base + t[:, None].to(tl.int64) * stride_kt + dq[None, :],
                            mask=tmask[:, None] & (dq[None, :] < DQK), other=0.0)
                if DOT_FP32:
                    k = k.to(tl.float32)
                sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                seen = (t[None, :] <= pos[:, None]) & rmask[:, None]
                if window > 0:
                    seen = seen & (t[None, :] > pos[:, None] - window)
                sc = tl.where(seen, sc, float("-inf"))
                mn = tl.maximum(m, tl.max(sc, axis=1))
                safe = tl.where(mn == float("-inf"), 0.0, mn)
                # exactly 1 and 0 where the row's max did not move / the key is hidden, whatever
                # the hardware exp gives for 0 and -inf: a block a row does not see is a no-op
                alpha = tl.where(mn == m, 1.0, tl.exp(m - safe))
                p = tl.where(seen, tl.exp(sc - safe[:, None]), 0.0)
                l = l * alpha + tl.sum(p, axis=1)
                v = tl.load(v_base + t[:, None].to(tl.int64) * stride_vt + dv[None, :],
                            mask=tmask[:, None] & (dv[None, :] < DV), other=0.0)
                if DOT_FP32:
                    pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
                else:
                    pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                acc = acc * alpha[:, None] + pv
                m = mn
            if HAS_SINKS:
                sk = tl.load(sinks_ptr + h).to(tl.float32)
                mn = tl.maximum(m, sk)
                alpha = tl.exp(m - mn)
                l = l * alpha + tl.exp(sk - mn)
                acc = acc * alpha[:, None]
            out = acc / tl.where(rmask, l, 1.0)[:, None]  # rows past the sequence are not stored
            tl.store(o_ptr + rows[:, None].to(tl.int64) * stride_on + h * stride_oh + dv[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & (dv[None, :] < DV))


def _blocks(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): one config per dtype, for prefill and decode alike."""
    if C.TRITON_INTERPRET:
        return 16, 16, 1
    if dtype == torch.float32:
        return 32, 32, 8  # 8 warps: fp32 tiles of 128-wide heads spill at 4 (sm_90 compile test)
    return 32, 64, 4


def _as_4d(t: Tensor, name: str) -> Tensor:
    if t.dim() == 3:
        t = t.unsqueeze(0)
    if t.dim() != 4:
        raise ValueError(f"exact.attention: {name} must be [Sk, T, H, D] or [T, H, D], got {tuple(t.shape)}")
    return t if t.stride(-1) == 1 else t.contiguous()


def _index(t: Tensor, dtype: torch.dtype, device, name: str, n: int) -> Tensor:
    if t.shape != (n,):
        raise ValueError(f"exact.attention: {name} must have shape [{n}], got {tuple(t.shape)}")
    return t.to(device=device, dtype=dtype).contiguous()


def _forward(q, k, v, cu, pos0, kv_seq, kv_start, scale, window, sinks, impl):
    op = "exact.attention"
    impl = C.pick_impl(op, q, impl)
    C.check_dtype(op, "q", q)
    C.check_dtype(op, "k", k, q.dtype)
    C.check_dtype(op, "v", v, q.dtype)
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [Nq, Hq, Dqk], got {tuple(q.shape)}")
    k, v = _as_4d(k, "k"), _as_4d(v, "v")
    Nq, Hq, Dqk = q.shape
    Sk, T, Hkv, Dv = v.shape
    if k.shape[:3] != v.shape[:3] or k.shape[3] != Dqk or Hq % Hkv:
        raise ValueError(f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together "
                         "(k and v [Sk, T, Hkv, *], k's head dim = q's, Hq a multiple of Hkv)")
    if q.stride(-1) != 1:
        q = q.contiguous()
    S = cu.shape[0] - 1
    dev = q.device
    cu = _index(cu, torch.int32, dev, "cu_seqlens_q", S + 1)
    pos0 = _index(pos0, torch.int32, dev, "pos0", S)
    kv_seq = _index(kv_seq, torch.int64, dev, "kv_seq", S)
    kv_start = _index(kv_start, torch.int64, dev, "kv_start", S)
    if sinks is not None:
        sinks = _index(sinks, torch.float32, dev, "sinks", Hq)
    out = q.new_empty(Nq, Hq, Dv)
    if Nq == 0:
        return out
    if impl == "cpu":
        C._C.exact_attention(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                             k.stride(2), v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), out.data_ptr(),
                             out.stride(0), out.stride(1), cu.data_ptr(), pos0.data_ptr(), kv_seq.data_ptr(),
                             kv_start.data_ptr(), S, Nq, Hq, Hkv, Dqk, Dv, Sk, T, float(scale), int(window),
                             0 if sinks is None else sinks.data_ptr(), C.CODE[q.dtype], C.num_threads())
        return out
    _attention_triton(q, k, v, out, cu, pos0, kv_seq, kv_start, scale, window, sinks)
    return out


def _attention_triton(q, k, v, out, cu, pos0, kv_seq, kv_start, scale, window, sinks) -> None:
    Nq, Hq, Dqk = q.shape
    Hkv, Dv = v.shape[2], v.shape[3]
    bm, bn, warps = _blocks(q.dtype)
    tile_seq, tile_row = tile_plan(cu[1:], Nq, bm)
    grid = (tile_seq.shape[0], Hq)
    _exact_attention_kernel[grid](q, k, v, out, sinks if sinks is not None else q, tile_seq, tile_row, cu, pos0,
                                  kv_seq, kv_start, cu.shape[0] - 1, Hq // Hkv, int(window), float(scale),
                                  q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                                  v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1),
                                  DQK=Dqk, DV=Dv, BLOCK_M=bm, BLOCK_N=bn, BLOCK_DQK=max(16, C.next_pow2(Dqk)),
                                  BLOCK_DV=max(16, C.next_pow2(Dv)), HAS_SINKS=sinks is not None,
                                  PRECISION="ieee", DOT_FP32=C.TRITON_INTERPRET, num_warps=warps)


def attention_reference(q, k, v, cu, pos0, kv_seq, kv_start, scale, window=0, sinks=None):
    """The same maths in plain torch (not batch-invariant), in q's dtype's precision or better:
    a dense [Nq, Sk*T] mask over every key buffer row. For tests and backward passes."""
    k, v = _as_4d(k, "k"), _as_4d(v, "v")
    Nq, Hq, _ = q.shape
    Sk, T, Hkv, Dv = v.shape
    dev = q.device
    cu, pos0, kv_seq, kv_start = (t.to(dev).long() for t in (cu, pos0, kv_seq, kv_start))
    i = torch.arange(Nq, device=dev)
    seq = torch.searchsorted(cu[1:], i, right=True)
    p = pos0[seq] + i - cu[seq]
    j = torch.arange(Sk * T, device=dev)
    t = j - (kv_seq[seq] * T + kv_start[seq])[:, None]  # key j's position in query i's sequence
    seen = (t >= 0) & (t <= p[:, None]) & (j // T == kv_seq[seq][:, None])
    if window > 0:
        seen &= t > (p - window)[:, None]
    kf = k.reshape(Sk * T, Hkv, -1).repeat_interleave(Hq // Hkv, dim=1)
    vf = v.reshape(Sk * T, Hkv, Dv).repeat_interleave(Hq // Hkv, dim=1)
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.einsum("nhd,jhd->hnj", q.to(ct), kf.to(ct)) * scale
    scores = scores.masked_fill(~seen[None], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(ct)[:, None, None].expand(Hq, Nq, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("hnj,jhd->nhd", probs, vf.to(ct)).to(q.dtype)


def packed_attention_reference(q, k, v, cu, max_seqlen, scale, window=0, sinks=None):
    """``packed_attention``'s maths in plain torch: the packed sequences laid out as a right-padded
    [S, max_seqlen] batch (memory S x Hq x max_seqlen^2, not total^2). The backward of
    ``packed_attention``."""
    T, Hq, _ = q.shape
    Hkv, dev = k.shape[1], q.device
    cu = cu.to(dev).long()
    S, L = cu.shape[0] - 1, max_seqlen
    i = torch.arange(T, device=dev)
    seq = torch.searchsorted(cu[1:], i, right=True)
    slot = seq * L + (i - cu[seq])

    def pad(t):  # [T, H, D] -> [S, H, L, D]
        buf = t.new_zeros(S * L, t.shape[1], t.shape[2]).index_copy(0, slot, t)
        return buf.view(S, L, t.shape[1], t.shape[2]).transpose(1, 2)
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qp = pad(q).to(ct)
    kp = pad(k).to(ct).repeat_interleave(Hq // Hkv, dim=1)
    vp = pad(v).to(ct).repeat_interleave(Hq // Hkv, dim=1)
    scores = (qp @ kp.transpose(-1, -2)) * scale  # [S, Hq, L, L]
    r = torch.arange(L, device=dev)
    seen = r[None, :] <= r[:, None]
    if window > 0:
        seen = seen & (r[:, None] - r[None, :] < window)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(ct)[None, :, None, None].expand(S, Hq, L, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    out = (probs @ vp).transpose(1, 2).reshape(S * L, Hq, -1)
    return out.index_select(0, slot).to(q.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, pos0, kv_seq, kv_start, scale, window, sinks, impl, packed_max):
        ctx.save_for_backward(q, k, v, cu, pos0, kv_seq, kv_start, sinks)
        ctx.scale, ctx.window, ctx.packed_max = scale, window, packed_max
        return _forward(q, k, v, cu, pos0, kv_seq, kv_start, scale, window, sinks, impl)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, cu, pos0, kv_seq, kv_start, sinks = ctx.saved_tensors
        ins = [q, k, v] + ([sinks] if sinks is not None else [])
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in ins]
            sk = leaves[3] if sinks is not None else None
            if ctx.packed_max is not None:  # a packed batch (packed_attention): per-sequence padding
                out = packed_attention_reference(leaves[0], leaves[1], leaves[2], cu, ctx.packed_max, ctx.scale,
                                                 ctx.window, sk)
            else:
                out = attention_reference(*leaves[:3], cu, pos0, kv_seq, kv_start, ctx.scale, ctx.window, sk)
            grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
        dq, dk, dv = grads[:3]
        dsinks = grads[3] if sinks is not None else None
        return dq, dk, dv, None, None, None, None, None, None, dsinks, None, None


def attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, pos0: Tensor, kv_seq: Tensor,
              kv_start: Tensor, *, scale: float | None = None, window: int = 0, sinks: Tensor | None = None,
              impl: str | None = None) -> Tensor:
    """Causal attention of ``q [Nq, Hq, Dqk]`` over ``k [Sk, T, Hkv, Dqk]``, ``v [Sk, T, Hkv, Dv]``
    (see the module docstring for the layout) -> ``[Nq, Hq, Dv]`` in q's dtype (float32 or
    bfloat16, k and v alike). ``cu_seqlens_q`` int32 [S+1], ``pos0`` int32 [S], ``kv_seq`` and
    ``kv_start`` int64 [S], on q's device. ``scale`` defaults to ``Dqk ** -0.5``; ``window`` > 0
    keeps the last ``window`` keys of each query (its own included); ``sinks`` fp32 [Hq].
    A query's output is bit-identical whatever else is computed with it. On CPU every key read is
    checked to lie in the buffers (IndexError otherwise)."""
    return _attention(q, k, v, cu_seqlens_q, pos0, kv_seq, kv_start, scale, window, sinks, impl, None)


def _attention(q, k, v, cu, pos0, kv_seq, kv_start, scale, window, sinks, impl, packed_max):
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if C.needs_grad(q, k, v, sinks):
        return _Attention.apply(q, k, v, cu, pos0, kv_seq, kv_start, scale, window, sinks, impl, packed_max)
    return _forward(q, k, v, cu, pos0, kv_seq, kv_start, scale, window, sinks, impl)


def packed_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *, scale: float | None = None,
                     window: int = 0, sinks: Tensor | None = None, max_seqlen: int | None = None,
                     impl: str | None = None) -> Tensor:
    """Self-attention of a packed batch (a training micro-batch): ``q/k/v [total, H, D]``, sequence
    ``s`` at rows ``cu_seqlens[s]:cu_seqlens[s+1]``, positions from 0. ``max_seqlen`` (the longest
    sequence, a host integer) is used by the backward only (its padded layout); without it the
    backward reads it from ``cu_seqlens``."""
    cu = cu_seqlens.to(torch.int32)
    S = cu.shape[0] - 1
    zeros = torch.zeros(S, dtype=torch.int32, device=cu.device)
    packed_max = None
    if C.needs_grad(q, k, v, sinks):
        packed_max = max_seqlen if max_seqlen is not None else int(cu.diff().max()) if S else 0
    return _attention(q, k, v, cu, zeros, zeros.long(), cu[:-1].long(), scale, window, sinks, impl, packed_max)


def cached_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, slots: Tensor,
                     pos0: Tensor, *, scale: float | None = None, window: int = 0, sinks: Tensor | None = None,
                     impl: str | None = None) -> Tensor:
    """Attention against the engine's KV cache ``[slots, Hkv, ctx, D]`` (new keys already
    written): sequence ``s`` (queries ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``, a prefill chunk or
    one decode token) lives in cache slot ``slots[s]`` and starts at position ``pos0[s]``."""
    return attention(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), cu_seqlens_q, pos0, slots.long(),
                     torch.zeros_like(slots, dtype=torch.int64), scale=scale, window=window, sinks=sinks, impl=impl)

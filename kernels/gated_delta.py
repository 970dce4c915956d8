"""The gated delta rule (Gated DeltaNet's token mixing), chunked over packed sequences, and its
one-token recurrent step.

Per value head, with a state ``S`` [Dk, Dv] that starts at the sequence's initial state::

    S_t = e^{g_t} S_{t-1} + beta_t k_t (v_t - e^{g_t} S_{t-1}^T k_t)^T,      o_t = S_t^T q_t

Training and prefill run the chunked form (chunks of ``CHUNK`` = 64 tokens, as transformers' and
flash-linear-attention's): inside a chunk everything is batched matmuls (the UT transform by a
unit-lower-triangular solve, the intra-chunk attention), and only the passage of the state from
one chunk to the next is sequential. Decode runs the recurrence one token at a time
(``recurrent_step``). Their sums are ordered differently, so the two agree to rounding only.

Packed sequences (``cu_seqlens``) never see each other's state: every sequence starts a new
chunk (the sequences are laid out chunk-aligned, at most ``CHUNK - 1`` padding rows each, padding
rows are neutral: zero k/v/q/beta and zero log-decay) and the state scan of a sequence runs
over its own chunks only, from its own initial state.

Self-contained, Liger-style: the sequential chunk scan is a ``torch.library.custom_op``
(``moe_rl::gdn_scan``, with its fake and its autograd; a compiled decoder block treats it as one
opaque call, so a batch's chunk count never causes a recompile) with two implementations:

* ``impl="torch"`` (CPU tensors): a loop over the chunks of the longest sequence, every
  sequence's chunk batched, and the backward the same loop reversed (exact gradients, checked
  against autograd and against a float64 token-by-token recurrence in tests/kernels).
* ``impl="triton"`` (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``): one program per
  (sequence, head, block of ``BLOCK_V`` value columns) carries its block of the state through
  its sequence's chunks (the state's columns are independent), reading the chunk count on the
  device. The block lives in the output buffer of the final state (the backward: of the
  initial state's gradient) and is read and written ``BLOCK_K`` key rows at a time, a barrier
  between a tile's last read and its update, so that no tile outgrows the registers; the backward first re-runs the scan to store the state entering each chunk (not kept
  from the forward: it is ``H x Dk x Dv`` per chunk), then walks the chunks backwards. Partial
  sums over the value blocks are added in torch.

The intra-chunk quantities around the scan are plain torch ops (autograd), the same on CPU and
GPU. Everything is computed in fp32 (fp64 for fp64 inputs), as transformers' reference does.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from .launch import on_device_of

try:  # Triton is optional: the torch implementation needs none of it.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CHUNK = 64


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: the dtype the rule is computed in."""
    return torch.promote_types(dtype, torch.float32)


# --- the one-token step (decode) -----------------------------------------------------------
def recurrent_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of each of B sequences: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state
    [B, H, Dk, Dv] (the compute dtype) -> (o [B, H, Dv], the new state). Batched ops only."""
    cd = state.dtype
    q, k, v, g, beta = (t.to(cd) for t in (q, k, v, g, beta))
    s = state * g.exp()[..., None, None]
    kv = torch.einsum("bhkv,bhk->bhv", s, k)
    s = s + k[..., :, None] * ((v - kv) * beta[..., None])[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def gated_delta_rule_reference(q, k, v, g, beta, cu_seqlens, initial_state=None):
    """The recurrence, token by token per sequence (host loops: tests only). Same arguments and
    results as ``chunk_gated_delta_rule``."""
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    cd = compute_dtype(q.dtype)
    cu = cu_seqlens.tolist()
    o = torch.zeros(T, H, Dv, dtype=cd, device=q.device)
    finals = []
    for s in range(len(cu) - 1):
        st = (initial_state[s : s + 1].to(cd) if initial_state is not None
              else torch.zeros(1, H, Dk, Dv, dtype=cd, device=q.device))
        for t in range(cu[s], cu[s + 1]):
            o_t, st = recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], st)
            o[t] = o_t[0]
        finals.append(st[0])
    return o, (torch.stack(finals) if finals else torch.zeros(0, H, Dk, Dv, dtype=cd, device=q.device))


# --- the chunked form ----------------------------------------------------------------------
def chunk_layout(cu_seqlens: Tensor, total: int, chunk: int = CHUNK) -> tuple[Tensor, Tensor, Tensor, int]:
    """Where the ``total`` packed tokens sit when every sequence starts a chunk: (row of each
    token in the chunk-aligned layout [chunks * chunk], first chunk of each sequence, chunk count
    of each sequence, number of chunk slots). The slot count is a bound from shapes alone
    (``(total + S * (chunk - 1)) // chunk``), so nothing is read on the host."""
    num_seqs = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    nch = (lens + chunk - 1) // chunk
    first = torch.cumsum(nch, 0) - nch
    tok = torch.arange(total, device=cu.device)
    # each token's sequence: cu[0] = 0 <= tok, so searching all of cu counts one more than cu[1:]
    # (a slice as the sorted sequence fails Inductor's searchsorted lowering in torch 2.11)
    seq = (torch.searchsorted(cu, tok, right=True) - 1).clamp(max=max(num_seqs - 1, 0))
    rows = first[seq] * chunk + (tok - cu[seq])
    slots = max((total + num_seqs * (chunk - 1)) // chunk, 1)
    return rows, first, nch, slots


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                           initial_state: Tensor | None = None, *, chunk: int = CHUNK,
                           impl: str | None = None) -> tuple[Tensor, Tensor]:
    """The gated delta rule over packed sequences, chunked.

    q, k [T, H, Dk] (q/k as the rule reads them: L2-normalised, q scaled), v [T, H, Dv], g [T, H]
    (log of the decay, <= 0), beta [T, H]; ``cu_seqlens`` [S + 1] (device) the sequence
    boundaries; ``initial_state`` [S, H, Dk, Dv] or None (zeros). Returns (o [T, H, Dv], final
    state [S, H, Dk, Dv]), both in the compute dtype. Differentiable in q, k, v, g, beta and the
    initial state. ``impl``: "triton" (default for CUDA tensors) or "torch"."""
    impl = _impl(q, impl)
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    S = cu_seqlens.shape[0] - 1
    cd = compute_dtype(q.dtype)
    rows, first, nch, NC = chunk_layout(cu_seqlens, T, chunk)

    def lay(t):  # [T, H, ...] -> [NC, H, chunk, ...] chunk-aligned, zeros between sequences
        buf = t.new_zeros((NC * chunk,) + tuple(t.shape[1:])).index_copy(0, rows, t)
        buf = buf.view((NC, chunk) + tuple(t.shape[1:]))
        return buf.transpose(1, 2)

    q, k, v, g, beta = (lay(t.to(cd)) for t in (q, k, v, g, beta))
    gc = g.cumsum(-1)  # [NC, H, C] log decay from the chunk's start
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(future, float("-inf")).exp()  # [NC, H, C, C]
    kb = k * beta[..., None]
    # UT transform: (I + strictly-lower(beta k k^T * decay))^-1 applied to beta v and beta k e^gc
    ut = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(ut, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, kb * gc.exp()[..., None], upper=False, unitriangular=True)
    aqk = (q @ k.transpose(-1, -2)) * decay  # intra-chunk attention, causal incl. the diagonal
    qg = q * gc.exp()[..., None]
    kd = k * (gc[..., -1:] - gc).exp()[..., None]
    s0 = (initial_state.to(cd) if initial_state is not None
          else q.new_zeros(S, H, Dk, Dv))
    o, final = _gdn_scan_op(qg.contiguous(), kd.contiguous(), w.contiguous(), u.contiguous(), aqk.contiguous(),
                            gc[..., -1].exp().contiguous(), first, nch, s0.contiguous(), impl)
    o = o.transpose(1, 2).reshape(NC * chunk, H, Dv).index_select(0, rows)
    return o, final


def _impl(x: Tensor, impl: str | None) -> str:
    if impl is None:
        impl = "triton" if x.is_cuda else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"gated delta rule: impl must be 'triton' or 'torch', got {impl!r}")
    if impl == "triton" and (triton is None or not (x.is_cuda or TRITON_INTERPRET)):
        raise RuntimeError("gated delta rule (impl='triton'): needs triton and a CUDA tensor (or TRITON_INTERPRET=1 "
                           "set before importing moe_rl.kernels.gated_delta)")
    return impl


# --- the chunk scan: torch ---------------------------------------------------------------------
def _scan_torch(qg, kd, w, u, aqk, decay, first, nch, s0, keep_states: bool = False):
    """Per sequence, carries the state through its chunks (``_gdn_scan_op``'s arguments).
    Returns (o [NC, H, C, Dv], final [S, H, Dk, Dv], states entering each chunk or None)."""
    NC = u.shape[0]
    o = u.new_zeros((NC + 1,) + tuple(u.shape[1:]))  # row NC: where idle sequences write
    states = u.new_zeros((NC + 1, u.shape[1], w.shape[-1], u.shape[-1])) if keep_states else None
    s = s0.clone()
    for i in range(int(nch.max()) if nch.numel() else 0):
        live = i < nch
        c = torch.where(live, first + i, NC)
        cc = c.clamp(max=NC - 1)
        v_new = u[cc] - w[cc] @ s
        o.index_copy_(0, c, qg[cc] @ s + aqk[cc] @ v_new)
        if keep_states:
            states.index_copy_(0, c, s)
        s = torch.where(live[:, None, None, None], s * decay[cc][..., None, None] + kd[cc].transpose(-1, -2) @ v_new, s)
    return o[:NC], s, (states[:NC] if keep_states else None)


def _scan_bwd_torch(qg, kd, w, u, aqk, decay, first, nch, s0, do, dfinal):
    """The scan's gradients, the chunks walked backwards (states re-made by a forward pass)."""
    NC = u.shape[0]
    _, _, states = _scan_torch(qg, kd, w, u, aqk, decay, first, nch, s0, keep_states=True)
    grads = [t.new_zeros((NC + 1,) + tuple(t.shape[1:])) for t in (qg, kd, w, u, aqk, decay)]
    dqg, dkd, dw, du, daqk, ddecay = grads
    ds = dfinal.clone()
    for i in reversed(range(int(nch.max()) if nch.numel() else 0)):
        live = i < nch
        c = torch.where(live, first + i, NC)
        cc = c.clamp(max=NC - 1)
        s, do_c = states[cc], do[cc]
        v_new = u[cc] - w[cc] @ s
        dv_new = aqk[cc].transpose(-1, -2) @ do_c + kd[cc] @ ds
        daqk.index_copy_(0, c, do_c @ v_new.transpose(-1, -2))
        dqg.index_copy_(0, c, do_c @ s.transpose(-1, -2))
        dkd.index_copy_(0, c, v_new @ ds.transpose(-1, -2))
        dw.index_copy_(0, c, -(dv_new @ s.transpose(-1, -2)))
        du.index_copy_(0, c, dv_new)
        ddecay.index_copy_(0, c, (s * ds).sum((-1, -2)))
        prev = (ds * decay[cc][..., None, None] + qg[cc].transpose(-1, -2) @ do_c
                - w[cc].transpose(-1, -2) @ dv_new)
        ds = torch.where(live[:, None, None, None], prev, ds)
    return tuple(t[:NC] for t in grads) + (ds,)


# --- the chunk scan: Triton --------------------------------------------------------------------
def _blocks(dk: int, dv: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_V): the key rows of the state each dot reads at a time and the value
    columns of one program. On sm_90 the fp32 dots run on the FMA units, each thread holding
    its rows of an operand over the whole reduction: a [Dk=128, 32] state block in one tile
    spilled ~2 KB of stack per thread; 16-row key tiles keep every tile in registers (165
    registers forward, 216 backward, no stack: tests/kernels/test_sm90_compile.py checks).
    32 value columns (not 16, which also fits) halve the chunk tiles each program re-reads.
    Never under 16: Triton (3.6, the GPU image's) refuses a ``tl.dot`` with a dimension below 16,
    so a head narrower than a tile runs one masked tile. The interpreter uses 16 x 16 so that the
    tests' small heads run several tiles of each."""
    return 16, max(16, min(triton.next_power_of_2(dv), 16 if TRITON_INTERPRET else 32))


def _launch_options() -> dict:
    """8 warps, one stage: the state tiles are read back from memory that the same program has
    just written (after a barrier), which a software-pipelined prefetch would read early."""
    return {"num_warps": 1} if TRITON_INTERPRET else {"num_warps": 8, "num_stages": 1}


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not TRITON_INTERPRET and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


if triton is not None:

    @triton.jit
    def _scan_program(first_ptr, nch_ptr, H, DV, BLOCK_V: tl.constexpr):
        """Which scan this program runs: (its value block, its sequence x head row, the head, the
        sequence's first chunk and chunk count, its value columns and their mask)."""
        pid_v = tl.program_id(0)
        sh = tl.program_id(1)
        seq = sh // H
        c0 = tl.load(first_ptr + seq)
        n = tl.load(nch_ptr + seq)
        rv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        return pid_v, sh, sh % H, c0, n, rv, rv < DV

    @triton.jit
    def _state_tile(k0, rv, vm, DK, DV, BLOCK_K: tl.constexpr):
        """Offsets and mask of key rows [k0, k0 + BLOCK_K) x the program's value columns in a
        [Dk, Dv] state; the key rows and their mask."""
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < DK
        return rk[:, None] * DV + rv[None, :], km[:, None] & vm[None, :], rk, km

    @triton.jit
    def _copy_state(src_ptr, dst_ptr, base, rv, vm, DK, DV, BLOCK_K: tl.constexpr):
        """The program's block of a state from src to dst (its working copy), then a barrier."""
        for k0 in range(0, DK, BLOCK_K):
            off, m, rk, km = _state_tile(k0, rv, vm, DK, DV, BLOCK_K)
            tl.store(dst_ptr + base + off, tl.load(src_ptr + base + off, mask=m, other=0.0), mask=m)
        tl.debug_barrier()

    @triton.jit(do_not_specialize=["store_states"])
    def _gdn_scan_fwd_kernel(qg_ptr, kd_ptr, w_ptr, u_ptr, aqk_ptr, decay_ptr, first_ptr, nch_ptr, s0_ptr,
                             o_ptr, final_ptr, states_ptr, H, DK, DV, store_states,
                             C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                             PRECISION: tl.constexpr):
        """One (value block, sequence x head): the state block [Dk, BLOCK_V] through the
        sequence's chunks, kept in ``final`` (its working copy, read and written BLOCK_K key rows
        at a time so that no tile outgrows the registers). Layouts (contiguous): qg/kd/w [NC, H,
        C, Dk], u/o [NC, H, C, Dv], aqk [NC, H, C, C], decay [NC, H], s0/final [S, H, Dk, Dv],
        states [NC, H, Dk, Dv]."""
        pid_v, sh, h, c0, n, rv, vm = _scan_program(first_ptr, nch_ptr, H, DV, BLOCK_V)
        rc = tl.arange(0, C)
        base = sh.to(tl.int64) * DK * DV
        _copy_state(s0_ptr, final_ptr, base, rv, vm, DK, DV, BLOCK_K)
        for i in range(0, n):
            ch = (c0 + i).to(tl.int64) * H + h  # the (chunk, head) row
            vv = ch * C * DV + rc[:, None] * DV + rv[None, :]
            v_new = tl.load(u_ptr + vv, mask=vm[None, :], other=0.0)
            qs = tl.zeros_like(v_new)
            for k0 in range(0, DK, BLOCK_K):  # v_new = u - w s, qs = qg s
                off, m, rk, km = _state_tile(k0, rv, vm, DK, DV, BLOCK_K)
                s = tl.load(final_ptr + base + off, mask=m, other=0.0)
                if store_states:
                    tl.store(states_ptr + ch * DK * DV + off, s, mask=m)
                kk = ch * C * DK + rc[:, None] * DK + rk[None, :]
                v_new -= tl.dot(tl.load(w_ptr + kk, mask=km[None, :], other=0.0), s, input_precision=PRECISION)
                qs += tl.dot(tl.load(qg_ptr + kk, mask=km[None, :], other=0.0), s, input_precision=PRECISION)
            aqk = tl.load(aqk_ptr + ch * C * C + rc[:, None] * C + rc[None, :])
            tl.store(o_ptr + vv, qs + tl.dot(aqk, v_new, input_precision=PRECISION), mask=vm[None, :])
            a = tl.load(decay_ptr + ch)
            for k0 in range(0, DK, BLOCK_K):  # s = a s + kd^T v_new
                off, m, rk, km = _state_tile(k0, rv, vm, DK, DV, BLOCK_K)
                kd = tl.load(kd_ptr + ch * C * DK + rc[:, None] * DK + rk[None, :], mask=km[None, :], other=0.0)
                s = tl.load(final_ptr + base + off, mask=m, other=0.0) * a
                s += tl.dot(tl.trans(kd), v_new, input_precision=PRECISION)
                tl.debug_barrier()  # every thread has read these rows before they change
                tl.store(final_ptr + base + off, s, mask=m)
            tl.debug_barrier()  # the new state is in place before the next chunk reads it

    @triton.jit
    def _gdn_scan_bwd_kernel(qg_ptr, kd_ptr, w_ptr, u_ptr, aqk_ptr, decay_ptr, first_ptr, nch_ptr, states_ptr,
                             do_ptr, dfinal_ptr, dqg_ptr, dkd_ptr, dw_ptr, du_ptr, daqk_ptr, ddecay_ptr, ds0_ptr,
                             H, NCH, DK, DV,
                             C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                             PRECISION: tl.constexpr):
        """The scan's gradients for one (value block, sequence x head), chunks walked backwards,
        the state's gradient kept in ``ds0`` (its working copy, BLOCK_K key rows at a time).
        du, ds0 are written per block of value columns; dqg/dkd/dw/daqk/ddecay sum over all value
        columns, so each block writes its partial sum at [pid_v] of a [NV, ...] buffer."""
        pid_v, sh, h, c0, n, rv, vm = _scan_program(first_ptr, nch_ptr, H, DV, BLOCK_V)
        rc = tl.arange(0, C)
        base = sh.to(tl.int64) * DK * DV
        part = pid_v.to(tl.int64) * NCH * H  # this block's rows in the partial-sum buffers
        _copy_state(dfinal_ptr, ds0_ptr, base, rv, vm, DK, DV, BLOCK_K)
        for j in range(0, n):
            ch = (c0 + n - 1 - j).to(tl.int64) * H + h
            vv = ch * C * DV + rc[:, None] * DV + rv[None, :]
            v_new = tl.load(u_ptr + vv, mask=vm[None, :], other=0.0)
            do = tl.load(do_ptr + vv, mask=vm[None, :], other=0.0)
            aqk = tl.load(aqk_ptr + ch * C * C + rc[:, None] * C + rc[None, :])
            dv_new = tl.dot(tl.trans(aqk), do, input_precision=PRECISION)
            sds = tl.zeros([BLOCK_K, BLOCK_V], dtype=v_new.dtype)
            for k0 in range(0, DK, BLOCK_K):  # v_new = u - w s, dv_new = aqk^T do + kd ds, sum(s * ds)
                off, m, rk, km = _state_tile(k0, rv, vm, DK, DV, BLOCK_K)
                s = tl.load(states_ptr + ch * DK * DV + off, mask=m, other=0.0)
                ds = tl.load(ds0_ptr + base + off, mask=m, other=0.0)
                kk = ch * C * DK + rc[:, None] * DK + rk[None, :]
                v_new -= tl.dot(tl.load(w_ptr + kk, mask=km[None, :], other=0.0), s, input_precision=PRECISION)
                dv_new += tl.dot(tl.load(kd_ptr + kk, mask=km[None, :], other=0.0), ds, input_precision=PRECISION)
                sds += s * ds
            tl.store(du_ptr + vv, dv_new, mask=vm[None, :])
            tl.store(daqk_ptr + (part + ch) * C * C + rc[:, None] * C + rc[None, :],
                     tl.dot(do, tl.trans(v_new), input_precision=PRECISION))
            tl.store(ddecay_ptr + part + ch, tl.sum(tl.sum(sds, axis=1), axis=0))
            a = tl.load(decay_ptr + ch)
            for k0 in range(0, DK, BLOCK_K):  # the key rows' gradients, then ds = a ds + qg^T do - w^T dv_new
                off, m, rk, km = _state_tile(k0, rv, vm, DK, DV, BLOCK_K)
                s = tl.load(states_ptr + ch * DK * DV + off, mask=m, other=0.0)
                ds = tl.load(ds0_ptr + base + off, mask=m, other=0.0)
                kk = ch * C * DK + rc[:, None] * DK + rk[None, :]
                pk = (part + ch) * C * DK + rc[:, None] * DK + rk[None, :]
                tl.store(dqg_ptr + pk, tl.dot(do, tl.trans(s), input_precision=PRECISION), mask=km[None, :])
                tl.store(dkd_ptr + pk, tl.dot(v_new, tl.trans(ds), input_precision=PRECISION), mask=km[None, :])
                tl.store(dw_ptr + pk, -tl.dot(dv_new, tl.trans(s), input_precision=PRECISION), mask=km[None, :])
                qg = tl.load(qg_ptr + kk, mask=km[None, :], other=0.0)
                w = tl.load(w_ptr + kk, mask=km[None, :], other=0.0)
                ds = (ds * a + tl.dot(tl.trans(qg), do, input_precision=PRECISION)
                      - tl.dot(tl.trans(w), dv_new, input_precision=PRECISION))
                tl.debug_barrier()  # every thread has read these rows before they change
                tl.store(ds0_ptr + base + off, ds, mask=m)
            tl.debug_barrier()  # the new gradient is in place before the next chunk reads it


def _scan_grid(s0: Tensor, u: Tensor):
    S, H, Dk, Dv = s0.shape
    bk, bv = _blocks(Dk, Dv)
    return (triton.cdiv(Dv, bv), S * H), bk, bv


def _scan_fwd_triton(qg, kd, w, u, aqk, decay, first, nch, s0, keep_states: bool = False):
    NC, H, C, Dv = u.shape
    Dk = w.shape[-1]
    o = torch.zeros_like(u)  # chunks of no sequence stay zero
    final = torch.empty_like(s0)
    states = u.new_zeros(NC, H, Dk, Dv) if keep_states else final  # (unused unless kept)
    if s0.shape[0] * H:
        grid, bk, bv = _scan_grid(s0, u)
        with on_device_of(u):  # the engine's prefill runs in its step thread
            _gdn_scan_fwd_kernel[grid](qg, kd, w, u, aqk, decay, first, nch, s0, o, final, states, H, Dk, Dv,
                                       int(keep_states), C=C, BLOCK_K=bk, BLOCK_V=bv, PRECISION=_precision(u.dtype),
                                       **_launch_options())
    return o, final, (states if keep_states else None)


def _scan_bwd_triton(qg, kd, w, u, aqk, decay, first, nch, s0, do, dfinal):
    NC, H, C, Dv = u.shape
    Dk = w.shape[-1]
    _, _, states = _scan_fwd_triton(qg, kd, w, u, aqk, decay, first, nch, s0, keep_states=True)
    du = torch.zeros_like(u)
    ds0 = torch.empty_like(s0)
    if not s0.shape[0] * H:
        return (torch.zeros_like(qg), torch.zeros_like(kd), torch.zeros_like(w), du, torch.zeros_like(aqk),
                torch.zeros_like(decay), ds0)
    grid, bk, bv = _scan_grid(s0, u)
    nv = grid[0]
    dqg, dkd, dw = (u.new_zeros((nv,) + tuple(t.shape)) for t in (qg, kd, w))
    daqk = u.new_zeros((nv,) + tuple(aqk.shape))
    ddecay = u.new_zeros((nv,) + tuple(decay.shape))
    with on_device_of(u):
        _gdn_scan_bwd_kernel[grid](qg, kd, w, u, aqk, decay, first, nch, states, do.contiguous(),
                                   dfinal.contiguous(), dqg, dkd, dw, du, daqk, ddecay, ds0, H, NC, Dk, Dv,
                                   C=C, BLOCK_K=bk, BLOCK_V=bv, PRECISION=_precision(u.dtype), **_launch_options())
    return dqg.sum(0), dkd.sum(0), dw.sum(0), du, daqk.sum(0), ddecay.sum(0), ds0


# --- the op --------------------------------------------------------------------------------------
@torch.library.custom_op("moe_rl::gdn_scan", mutates_args=())
def _gdn_scan_op(qg: Tensor, kd: Tensor, w: Tensor, u: Tensor, aqk: Tensor, decay: Tensor, first: Tensor,
                 nch: Tensor, s0: Tensor, impl: str) -> tuple[Tensor, Tensor]:
    """qg/kd/w [NC, H, C, Dk], u [NC, H, C, Dv], aqk [NC, H, C, C], decay [NC, H] (e^{g} over a
    chunk), first/nch [S] (each sequence's first chunk and chunk count), s0 [S, H, Dk, Dv] ->
    (o [NC, H, C, Dv], final state [S, H, Dk, Dv])."""
    fwd = _scan_fwd_triton if impl == "triton" else _scan_torch
    o, final, _ = fwd(qg, kd, w, u, aqk, decay, first, nch, s0)
    return o, final


@_gdn_scan_op.register_fake
def _(qg, kd, w, u, aqk, decay, first, nch, s0, impl):
    return u.new_empty(u.shape), s0.new_empty(s0.shape)


@torch.library.custom_op("moe_rl::gdn_scan_bwd", mutates_args=())
def _gdn_scan_bwd_op(qg: Tensor, kd: Tensor, w: Tensor, u: Tensor, aqk: Tensor, decay: Tensor, first: Tensor,
                     nch: Tensor, s0: Tensor, do: Tensor, dfinal: Tensor,
                     impl: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    bwd = _scan_bwd_triton if impl == "triton" else _scan_bwd_torch
    return bwd(qg, kd, w, u, aqk, decay, first, nch, s0, do, dfinal)


@_gdn_scan_bwd_op.register_fake
def _(qg, kd, w, u, aqk, decay, first, nch, s0, do, dfinal, impl):
    return tuple(t.new_empty(t.shape) for t in (qg, kd, w, u, aqk, decay, s0))


def _setup_context(ctx, inputs, output):
    *tensors, impl = inputs
    ctx.save_for_backward(*tensors)
    ctx.impl = impl


def _backward(ctx, do, dfinal):
    qg, kd, w, u, aqk, decay, first, nch, s0 = ctx.saved_tensors
    do = torch.zeros_like(u) if do is None else do.contiguous()
    dfinal = torch.zeros_like(s0) if dfinal is None else dfinal.contiguous()
    grads = _gdn_scan_bwd_op(qg, kd, w, u, aqk, decay, first, nch, s0, do, dfinal, ctx.impl)
    dqg, dkd, dw, du, daqk, ddecay, ds0 = grads
    return dqg, dkd, dw, du, daqk, ddecay, None, None, ds0, None


_gdn_scan_op.register_autograd(_backward, setup_context=_setup_context)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (flash-linear-attention's and transformers')."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


__all__ = ["CHUNK", "chunk_gated_delta_rule", "chunk_layout", "recurrent_step", "gated_delta_rule_reference",
           "l2norm", "compute_dtype"]

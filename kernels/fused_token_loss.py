"""Fused LM-head token loss: ``sum_t l_t(logp_t, H_t)`` over tokens, with its gradients with
respect to ``hidden`` and ``weight`` produced during the forward, in three GEMMs.

A loss that is a sum of per-token terms, each an elementwise function of that token's
log-prob ``logp_t = log_softmax(hidden @ weight.T / T)[t, y_t]`` and entropy ``H_t`` (PPO and
CISPO with token-level weights: the advantage, old and behaviour log-probs, masks, TIS and
IcePop weights and the global token count are all known before the forward), has an upstream
gradient per token, ``g_t = dl_t/dlogp_t`` and ``e_t = dl_t/dH_t``, that is known as soon as
the token's log-prob is. So the logits need not be recomputed in a backward:

per slab of ``R`` rows (:func:`_plan_fused`; 1024 rows, 8 slabs at N=8192, V=151936)::

  1. logits = hidden_slab @ weight.T            GEMM 1, fp32, tile by tile (Triton);
     each tile keeps its row max m and writes exp(z - m) in the input dtype to a [R, V]
     buffer, plus per 128-column group (m, sum-exp, U) in fp32 and the target logit
  2. merge the groups -> log-prob and entropy per row (exact fp32, as fused_logprobs)
  3. g, e = autograd of token_loss(logp, H) on the [R] vectors (a few elementwise ops)
  4. in place: d_logits = (g (1[j=y] - p_j) - e p_j (logp_j + H)) / T,  p_j = exp(z_j - m) e^(m - lse)
  5. d_hidden_slab = d_logits @ weight          GEMM 2, one cuBLAS call over the whole vocab
  6. d_weight += d_logits.T @ hidden_slab       GEMM 3, accumulated over slabs

Against 2NHV + 6NHV for a forward plus a recomputing backward (``fused_logprobs``), this is
6NHV, the three GEMMs of an unfused LM head, at the price of the ``[R, V]`` buffer.

Precision. Log-probs and entropies come from the fp32 statistics, as in ``fused_logprobs``.
The stored ``exp(z - m)`` is rounded to the input dtype (relative error 2^-9 in bf16), but the
column that attains a tile's max stores exactly 1, so the entries where ``1 - p`` or
``logp_j + H`` could cancel (a confident token) are exact. ``d_hidden`` gets the same
mean-row compensation as ``fused_logprobs``: the kernel sums the written ``d_logits`` per row,
the exact row sum is known from the statistics (0 without a vocab split), and the difference
times the mean weight row is subtracted. ``d_weight`` is a sum over slabs rounded once per slab
to the weight's dtype (8 slabs: ~0.35% relative in bf16).

Vocab-parallel (``tp_group``) as in ``fused_logprobs``: statistics all-reduced, the token
gradients computed identically on every rank, ``d_hidden`` all-reduced in fp32 inside the op,
``d_weight`` for this rank's rows.
"""
from __future__ import annotations

import torch

from .fused_logprobs import (
    TRITON_INTERPRET,
    Plan,
    _balanced_rows,
    _merge_partials,
    check_inputs,
    check_labels,
    local_labels,
    mm_fp32,
    tp_merge,
    vocab_offset,
)
from .launch import on_device_of

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - the torch implementation needs no Triton
    triton = None
    tl = None

# Statistics granularity (columns per (max, sum-exp, U) group): divides every BLOCK_N.
_STAT_GROUP = 128
# Slab height: at most this many slabs (each one more rounding of d_weight, and a d_weight GEMM
# as deep as the slab), slabs of at least this many rows, and a cap on the [R, V] buffer.
_FUSED_MAX_SLABS = 8
_FUSED_MIN_ROWS = 1024
_FUSED_MAX_BYTES = 2**30
# The elementwise d_logits kernel: rows per program (one 128-column group wide).
_DZ_BLOCK_M = 32

if triton is not None:
    from .fused_logprobs import _DOT_FP32, _INTERPRET_META, _grid_logits_tile, lm_head_autotune

    @triton.jit
    def _probs_kernel(h_ptr, w_ptr, labels_ptr, e_ptr, m_ptr, s_ptr, u_ptr, zy_ptr,
                      R, V, H, stride_hn, stride_hk, stride_wv, stride_wk, stride_em, stride_en,
                      stride_sg, inv_t,
                      COMPUTE_ENTROPY: tl.constexpr, STAT_GROUP: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr):
        """One logits tile: exp(z - tile max) stored in the input dtype; (max, sum-exp, U) in
        fp32 for the tile's first 128-column group and (max, 0, 0) for its others, so the
        [groups, rows] layout does not depend on BLOCK_N; the target logit."""
        pid_n, offs_m, offs_n, row_mask, col_mask, z = _grid_logits_tile(
            h_ptr, w_ptr, R, V, H, stride_hn, stride_hk, stride_wv, stride_wk, inv_t,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_FP32)
        z = tl.where(col_mask[None, :], z, float("-inf"))
        m = tl.max(z, axis=1)  # finite: every tile has a valid column
        zc = tl.where(col_mask[None, :], z - m[:, None], 0.0)
        p = tl.where(col_mask[None, :], tl.exp(zc), 0.0)
        e_ptrs = e_ptr + offs_m.to(tl.int64)[:, None] * stride_em + offs_n[None, :] * stride_en
        tl.store(e_ptrs, p.to(e_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])

        label = tl.load(labels_ptr + offs_m, mask=row_mask, other=-1)
        zy = tl.sum(tl.where(offs_n[None, :] == label[:, None], z, 0.0), axis=1)
        in_tile = (label >= pid_n * BLOCK_N) & (label < pid_n * BLOCK_N + BLOCK_N)
        tl.store(zy_ptr + offs_m, zy, mask=row_mask & in_tile)  # a single writer per row

        s = tl.sum(p, axis=1)
        zero = tl.zeros([BLOCK_M], dtype=tl.float32)
        G: tl.constexpr = BLOCK_N // STAT_GROUP
        n_groups = tl.cdiv(V, STAT_GROUP)
        for k in tl.static_range(G):
            grp = pid_n * G + k
            smask = row_mask & ((offs_m * 0 + grp) < n_groups)
            base = grp * stride_sg + offs_m
            tl.store(m_ptr + base, m, mask=smask)
            if k == 0:
                tl.store(s_ptr + base, s, mask=smask)
                if COMPUTE_ENTROPY:
                    tl.store(u_ptr + base, tl.sum(p * zc, axis=1), mask=smask)
            else:
                tl.store(s_ptr + base, zero, mask=smask)
                if COMPUTE_ENTROPY:
                    tl.store(u_ptr + base, zero, mask=smask)

    @triton.jit
    def _dz_kernel(e_ptr, dz_ptr, labels_ptr, m_ptr, mx_ptr, logs_ptr, ent_ptr, gl_ptr, ge_ptr,
                   err_ptr, R, V, stride_em, stride_en, stride_sg, inv_t,
                   HAS_GL: tl.constexpr, HAS_GE: tl.constexpr, TRACK_ERR: tl.constexpr,
                   BLOCK_M: tl.constexpr, STAT_GROUP: tl.constexpr):
        """In place over one [BLOCK_M, 128] block: exp(z - m) (``e_ptr``'s dtype) -> d_logits
        (w.r.t. the raw logits, ``dz_ptr``'s dtype, the same memory); with TRACK_ERR the row
        sums of the values as written (rounded)."""
        pid_m = tl.program_id(0)
        grp = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = grp * STAT_GROUP + tl.arange(0, STAT_GROUP)
        row_mask = offs_m < R
        mask = row_mask[:, None] & (offs_n < V)[None, :]
        offs = offs_m.to(tl.int64)[:, None] * stride_em + offs_n[None, :] * stride_en
        e = tl.load(e_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mg = tl.load(m_ptr + grp * stride_sg + offs_m, mask=row_mask, other=0.0)
        mx = tl.load(mx_ptr + offs_m, mask=row_mask, other=0.0)
        log_s = tl.load(logs_ptr + offs_m, mask=row_mask, other=0.0)
        shift = (mg - mx) - log_s  # log-prob of the column holding the group's max
        p = e * tl.exp(shift)[:, None]
        dz = tl.zeros([BLOCK_M, STAT_GROUP], dtype=tl.float32)
        if HAS_GL:
            label = tl.load(labels_ptr + offs_m, mask=row_mask, other=-1)
            gl = tl.load(gl_ptr + offs_m, mask=row_mask, other=0.0)
            onehot = tl.where(offs_n[None, :] == label[:, None], 1.0, 0.0)
            dz += gl[:, None] * (onehot - p)
        if HAS_GE:
            ent = tl.load(ent_ptr + offs_m, mask=row_mask, other=0.0)
            ge = tl.load(ge_ptr + offs_m, mask=row_mask, other=0.0)
            # where exp underflowed to 0 the term is 0 (no 0 * log 0)
            logp = tl.where(e > 0.0, tl.log(tl.where(e > 0.0, e, 1.0)) + shift[:, None], 0.0)
            dz -= ge[:, None] * p * (logp + ent[:, None])
        out = (dz * inv_t).to(dz_ptr.dtype.element_ty)
        tl.store(dz_ptr + offs, out, mask=mask)
        if TRACK_ERR:
            rowsum = tl.sum(tl.where(mask, out.to(tl.float32), 0.0), axis=1)
            tl.store(err_ptr + grp * stride_sg + offs_m, rowsum, mask=row_mask)

    if TRITON_INTERPRET:
        _probs_launch = _probs_kernel
    else:  # idempotent (every output fully rewritten), so autotuning may rerun it
        _probs_launch = lm_head_autotune(_probs_kernel, "probs", ["V", "H", "COMPUTE_ENTROPY"])


# ----------------------------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------------------------
def _plan_fused(n: int, h: int, v: int, itemsize: int, impl: str = "triton") -> Plan:
    """Slab height: ``ceil(n / _FUSED_MAX_SLABS)`` rows but at least ``_FUSED_MIN_ROWS`` (128
    for torch) or all ``n``, with the slab's buffers under ``_FUSED_MAX_BYTES``. Triton, per row: the
    ``[R, V]`` probabilities/d_logits buffer (itemsize * v), the group statistics
    (12 bytes per 128 columns) and the fp32 d_hidden product (4h); torch: about three fp32
    ``[R, V]`` temporaries and fp32 copies of the row (8h). ``vocab`` is unused (the whole
    vocabulary is one chunk)."""
    if impl == "triton":
        per_row, min_rows = itemsize * v + 12 * -(-v // _STAT_GROUP) + 4 * h, _FUSED_MIN_ROWS
    else:  # the CPU's GEMMs are efficient at 128 rows already; its memory is the host's
        per_row, min_rows = 12 * v + 8 * h, 128
    cap = max(128, _FUSED_MAX_BYTES // per_row)
    want = max(min_rows, -(-n // _FUSED_MAX_SLABS))
    return Plan(rows=_balanced_rows(n, min(want, cap)), vocab=v)


def fused_scratch_bytes(plan: Plan, n: int, h: int, v: int, itemsize: int) -> int:
    """The Triton path's scratch for ``plan`` (what :func:`_plan_fused` budgets)."""
    return min(plan.rows, n) * (itemsize * v + 12 * -(-v // _STAT_GROUP) + 4 * h)


# ----------------------------------------------------------------------------------------------
# The shared per-slab steps
# ----------------------------------------------------------------------------------------------
def _token_grads(token_loss, logp, ent, rows: slice, ignored):
    """(sum of the slab's token losses, dl/dlogp, dl/dH or None) from the caller's per-token
    loss function, differentiated on the [R] vectors (ignored rows get no gradient)."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_()
        en = ent.detach().requires_grad_() if ent is not None else None
        per_token = token_loss(lp, en, rows)
        if not isinstance(per_token, torch.Tensor) or per_token.shape != lp.shape:
            raise ValueError(f"fused_token_loss: token_loss must return one loss per token "
                             f"{tuple(lp.shape)}, got "
                             f"{getattr(per_token, 'shape', type(per_token).__name__)}")
        total = torch.where(ignored, 0.0, per_token).sum()  # ignored rows: no loss, no gradient
        inputs = [lp] + ([en] if en is not None else [])
        grads = (torch.autograd.grad(total, inputs, allow_unused=True) if total.requires_grad
                 else [None] * len(inputs))
    zero = torch.zeros((), device=logp.device, dtype=torch.float32)
    gl = torch.zeros_like(logp) if grads[0] is None else grads[0].float()
    gl = torch.where(ignored, zero, gl).contiguous()
    ge = None
    if en is not None and grads[1] is not None:
        ge = torch.where(ignored, zero, grads[1].float()).contiguous()
    return total.detach().float(), gl, ge


def _finish_slab(m_loc, s_loc, u_loc, zy, ignored, tp_group, token_loss, rows: slice, logp, ent):
    """From a slab's statistics over this rank's vocabulary: the full-vocabulary ones
    (all-reduced under ``tp_group``), the log-probs and entropies (written to ``logp[rows]``,
    ``ent[rows]``; ignored rows 0), the token loss and its gradients. Returns (max, log S,
    entropy or None, loss, dl/dlogp, dl/dH or None)."""
    m, s, u, zy = (tp_merge(m_loc, s_loc, u_loc, zy, tp_group) if tp_group is not None
                   else (m_loc, s_loc, u_loc, zy))
    log_s = torch.log(s)
    zero = torch.zeros_like(log_s)
    lp = torch.where(ignored, zero, (zy - m) - log_s)
    en = torch.where(ignored, zero, log_s - u / s) if u is not None else None
    logp[rows] = lp
    if en is not None:
        ent[rows] = en
    total, gl, ge = _token_grads(token_loss, lp, en, rows, ignored)
    return m, log_s, en, total, gl, ge


def _exact_rowsum(gl, ge, in_shard, m_loc, s_loc, u_loc, m, log_s, ent, inv_t):
    """sum over this rank's columns of the exact d_logits row, from the fp32 statistics:
    g (1[y in shard] - P) - e (sum p logp + H P) with P this shard's probability mass (1 and
    then 0 in total without a vocab split)."""
    c = (m_loc - m) - log_s
    scale = torch.exp(c)
    mass = s_loc * scale
    out = gl * (in_shard.float() - mass)
    if ge is not None:
        out = out - ge * (scale * (u_loc + s_loc * c) + ent * mass)
    return out * inv_t


# ----------------------------------------------------------------------------------------------
# Triton implementation
# ----------------------------------------------------------------------------------------------
def _fused_triton(hidden, weight, labels_local, ignored, token_loss, inv_t, entropy, plan,
                  tp_group, need_dh, need_dw):
    n, hdim = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    exact = hidden.dtype == torch.float32
    rows = min(plan.rows, n)
    n_groups = triton.cdiv(v, _STAT_GROUP)
    # One [rows, V] buffer in the input dtype: exp(z - m) in, d_logits out (in place). (fp16
    # for exp(z - m) would be finer on [0, 1] but flushes what is < 6e-8 of a tile's max,
    # which can add up over 150k columns; measured, the bf16 rounding of d_logits dominates.)
    probs = torch.empty((rows, v), device=dev, dtype=hidden.dtype)
    stats = torch.empty((3 if entropy else 2, n_groups, rows), device=dev, dtype=torch.float32)
    zy_buf = torch.empty(rows, device=dev, dtype=torch.float32)
    part = None if exact or not need_dh else torch.empty((rows, hdim), device=dev, dtype=torch.float32)
    wbar = weight.sum(0, dtype=torch.float32).div_(v) if not exact and need_dh else None
    d_hidden = torch.empty_like(hidden) if need_dh else None
    d_weight = torch.empty_like(weight) if need_dw else None
    logp = torch.empty(n, device=dev, dtype=torch.float32)
    ent = torch.empty(n, device=dev, dtype=torch.float32) if entropy else None
    loss = torch.zeros((), device=dev, dtype=torch.float32)
    extra = _INTERPRET_META if TRITON_INTERPRET else {}
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        r = r1 - r0
        h_slab, lab, ign = hidden[r0:r1], labels_local[r0:r1], ignored[r0:r1]
        e_buf = dz_buf = probs[:r]
        m_g, s_g = stats[0, :, :r], stats[1, :, :r]
        u_g = stats[2, :, :r] if entropy else s_g
        zy = zy_buf[:r].zero_()

        def grid(meta):
            return (triton.cdiv(r, meta["BLOCK_M"]) * triton.cdiv(v, meta["BLOCK_N"]),)

        with on_device_of(h_slab):
            _probs_launch[grid](h_slab, weight, lab, e_buf, m_g, s_g, u_g, zy, r, v, hdim,
                                h_slab.stride(0), h_slab.stride(1), weight.stride(0), weight.stride(1),
                                e_buf.stride(0), e_buf.stride(1), stats.stride(1), inv_t,
                                COMPUTE_ENTROPY=entropy, STAT_GROUP=_STAT_GROUP, DOT_FP32=_DOT_FP32,
                                **extra)
        m_loc, s_loc, u_loc = _merge_partials(m_g, s_g, u_g if entropy else None)
        m, log_s, en, total, gl, ge = _finish_slab(m_loc, s_loc, u_loc, zy, ign, tp_group, token_loss,
                                                   slice(r0, r1), logp, ent)
        loss += total
        if not (need_dh or need_dw):
            continue
        err = s_g  # the group sums are merged: the buffer takes the rounded row sums
        with on_device_of(e_buf):
            _dz_kernel[(triton.cdiv(r, _DZ_BLOCK_M), n_groups)](
                e_buf, dz_buf, lab, m_g, m, log_s, en if ge is not None else m, gl,
                ge if ge is not None else m, err, r, v, e_buf.stride(0), e_buf.stride(1),
                stats.stride(1), inv_t, HAS_GL=True, HAS_GE=ge is not None, TRACK_ERR=not exact,
                BLOCK_M=_DZ_BLOCK_M, STAT_GROUP=_STAT_GROUP, num_warps=4)
        if need_dh:
            if exact:
                out = torch.mm(dz_buf, weight, out=d_hidden[r0:r1])
            else:
                out = mm_fp32(dz_buf, weight, out=part[:r])
                drift = err.sum(0) - _exact_rowsum(gl, ge, lab >= 0, m_loc, s_loc, u_loc, m, log_s,
                                                   en, inv_t)
                out.addr_(drift, wbar, alpha=-1.0)
            if tp_group is not None:
                torch.distributed.all_reduce(out, group=tp_group)
            if not exact:
                d_hidden[r0:r1].copy_(out)
        if need_dw:
            if r0 == 0:
                torch.mm(dz_buf.T, h_slab, out=d_weight)
            else:
                d_weight.addmm_(dz_buf.T, h_slab)
    return loss, logp, ent, d_hidden, d_weight


# ----------------------------------------------------------------------------------------------
# torch implementation (the CPU default): the same steps with fp32 [R, V] logits
# ----------------------------------------------------------------------------------------------
def _fused_torch(hidden, weight, labels_local, ignored, token_loss, inv_t, entropy, plan,
                 tp_group, need_dh, need_dw):
    n, hdim = hidden.shape
    dev = hidden.device
    wf = weight.float()
    d_hidden = torch.empty_like(hidden) if need_dh else None
    d_weight = torch.empty_like(weight) if need_dw else None
    logp = torch.empty(n, device=dev, dtype=torch.float32)
    ent = torch.empty(n, device=dev, dtype=torch.float32) if entropy else None
    loss = torch.zeros((), device=dev, dtype=torch.float32)
    for r0 in range(0, n, plan.rows):
        r1 = min(n, r0 + plan.rows)
        hf = hidden[r0:r1].float()
        lab, ign = labels_local[r0:r1], ignored[r0:r1]
        z = hf @ wf.T
        z.mul_(inv_t)
        in_shard = lab >= 0
        zy = torch.where(in_shard, z.gather(1, lab.clamp(min=0)[:, None])[:, 0], 0.0)
        m_loc = z.max(dim=1).values
        zc = z.sub_(m_loc[:, None])
        p = torch.exp(zc)
        s_loc = p.sum(dim=1)
        u_loc = torch.linalg.vecdot(p, zc) if entropy else None
        m, log_s, en, total, gl, ge = _finish_slab(m_loc, s_loc, u_loc, zy, ign, tp_group, token_loss,
                                                   slice(r0, r1), logp, ent)
        loss += total
        if not (need_dh or need_dw):
            continue
        c = (m_loc - m) - log_s
        p.mul_(torch.exp(c)[:, None])  # probabilities
        if ge is not None:  # -e p (logp_j + H), logp_j = zc + c, built in the zc buffer
            dz = zc.add_((c + en)[:, None]).mul_(p).mul_(-ge[:, None])
            dz.sub_(p.mul_(gl[:, None]))
        else:
            dz = p.mul_(-gl[:, None])
        dz.scatter_add_(1, lab.clamp(min=0)[:, None], torch.where(in_shard, gl, 0.0)[:, None])
        dz.mul_(inv_t)
        if need_dh:
            out = dz @ wf
            if tp_group is not None:
                torch.distributed.all_reduce(out, group=tp_group)
            d_hidden[r0:r1].copy_(out)
        if need_dw:
            if d_weight.dtype == torch.float32:  # straight into the output, no [V, H] temporary
                if r0 == 0:
                    torch.mm(dz.T, hf, out=d_weight)
                else:
                    d_weight.addmm_(dz.T, hf)
            elif r0 == 0:
                d_weight.copy_(dz.T @ hf)
            else:
                d_weight.add_(dz.T @ hf)
        del z, zc, p, dz
    return loss, logp, ent, d_hidden, d_weight


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------
class _FusedTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, token_loss, temperature, return_entropy, tp_group,
                impl, plan):
        n = hidden.shape[0]
        v_local = weight.shape[0]
        v_start, v_total = vocab_offset(v_local, hidden.device, tp_group)
        ignored = check_labels(labels, v_total, "fused_token_loss")
        labels_local = local_labels(labels, ignored, v_start, v_local)
        if plan is None:
            plan = _plan_fused(n, hidden.shape[1], v_local, hidden.element_size(), impl)
        run = _fused_triton if impl == "triton" else _fused_torch
        loss, logp, ent, d_hidden, d_weight = run(
            hidden, weight, labels_local, ignored, token_loss, 1.0 / temperature, return_entropy,
            plan, tp_group, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.used = False
        ctx.set_materialize_grads(False)
        if return_entropy:
            ctx.mark_non_differentiable(logp, ent)
            return loss, logp, ent
        ctx.mark_non_differentiable(logp)
        return loss, logp

    @staticmethod
    def backward(ctx, g_loss, *_):
        if ctx.used:
            raise RuntimeError("fused_token_loss: its gradients were produced in the forward and "
                               "handed out once; call backward once per forward")
        ctx.used = True
        d_hidden, d_weight = ctx.saved_tensors
        if g_loss is None:
            return (None,) * 9
        # scaled in place on the device (no host sync to ask whether g_loss is 1)
        if d_hidden is not None:
            d_hidden.mul_(g_loss)
        if d_weight is not None:
            d_weight.mul_(g_loss)
        return d_hidden, d_weight, None, None, None, None, None, None, None


def fused_token_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                     token_loss, temperature: float = 1.0, return_entropy: bool = False,
                     tp_group=None, *, impl: str | None = None, plan: Plan | None = None):
    """The loss ``sum_t token_loss(logp, H)_t`` of the LM head, with its gradients computed in
    the forward (three GEMMs; see the module docstring).

    Args:
        hidden, weight, labels, temperature, tp_group, impl: as :func:`fused_logprobs`.
        token_loss: ``f(logp [R], entropy [R] or None, rows: slice) -> [R]`` per-token losses,
            differentiable with respect to ``logp`` and ``entropy``, called once per slab with
            the slab's rows ``rows`` of the inputs (fp32 vectors; ``entropy`` is None unless
            ``return_entropy``). Each token's loss must depend on that token's log-prob and
            entropy only (elementwise): per-token constants (advantages, old log-probs,
            weights, normalisers) are indexed with ``rows``.
        return_entropy: compute the entropy (for a loss that uses it, or for metrics).
        plan: override the slab height (tests; see :func:`_plan_fused`).

    Returns:
        ``(loss, logprobs, entropy)``: the fp32 scalar loss (differentiable with respect to
        ``hidden`` and ``weight``; call backward once), and the fp32 ``[N]`` log-probs and
        entropies (None unless ``return_entropy``), detached, for metrics.
    """
    impl = check_inputs(hidden, weight, labels, temperature, impl, "fused_token_loss")
    out = _FusedTokenLoss.apply(hidden, weight, labels.long(), token_loss, float(temperature),
                                bool(return_entropy), tp_group, impl, plan)
    return out if return_entropy else (out[0], out[1], None)


__all__ = ["fused_token_loss"]

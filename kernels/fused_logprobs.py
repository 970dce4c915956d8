"""Fused LM-head log-probs and entropy: ``log_softmax(hidden @ weight.T / T)[labels]`` without
materialising the ``[tokens, vocab]`` logits.

Self-contained, Liger-style: the Triton kernels, the ``torch.autograd.Function`` that drives
them, and a plain-torch chunked implementation of the same maths all live in this file.

Maths (per token row, ``x = hidden @ weight.T`` in fp32, ``z = x / T``)::

    M   = max_j z_j                   S = sum_j exp(z_j - M)        lse = M + log S
    U   = sum_j exp(z_j - M) (z_j - M)                              (always <= 0)
    logp = (z_y - M) - log S          H = lse - sum_j p_j z_j = log S - U / S

Keeping ``U`` relative to the running max (instead of ``sum p z``) avoids the cancellation
``lse - sum p z`` suffers when the logits are large in magnitude. Tiles over the vocabulary are
merged with the usual online rescaling: when the running max moves from ``m`` to ``m'``,
``S <- S e^(m-m')`` and ``U <- e^(m-m') (U + S (m - m'))``.

Gradients, with upstream ``g`` (log-prob) and ``e`` (entropy)::

    dlogp/dz_j = 1[j = y] - p_j
    dH/dz_j    = -p_j (z_j - sum_k p_k z_k) = -p_j (logp_j + H)
    dL/dx_j    = (g (1[j = y] - p_j) - e p_j (logp_j + H)) / T

``logp_j + H`` is finite even where ``p_j`` underflows to 0, so there is no ``0 * -inf``.

Implementations (``impl``):

* ``"triton"`` (the default for CUDA tensors). Forward: one program per (row block, vocab
  split of ``_SPLIT_V`` columns) loops over ``BLOCK_N``-wide vocab tiles, each a ``tl.dot``
  over the hidden dimension accumulating in fp32, and keeps online ``(max, sum-exp, U)`` for
  its split plus the target logit; a tiny torch reduction merges the ``[splits, N]`` partials.
  Backward (:func:`_backward_triton`): per (row slab, vocab chunk) a Triton kernel
  recomputes the logits tile by tile and writes ``d_logits`` for the chunk in the input dtype
  into a reused buffer; two cuBLAS GEMMs turn it into ``d_weight`` (written per chunk,
  accumulated over row slabs) and ``d_hidden`` (accumulated over vocab chunks in fp32, with
  the bf16 rounding of ``d_logits`` compensated along the mean weight row). Slabs and chunks
  are large (1024 x 15360 at N=8192, V=151936: three GEMMs of ~129 GFLOP per step, 80 steps)
  under a scratch budget of ~1.5% of the materialised fp32 logits (see :func:`_plan`). Work:
  2NHV forward, 6NHV backward (the logits are recomputed), against 6NHV for the three bare
  GEMMs of an unfused LM head: a floor of 8/6 = 1.33x. A loss whose per-token gradient is
  known in the forward does better: ``moe_rl.kernels.fused_token_loss`` (3 GEMMs).
  Also runs on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before this
  module is imported), which is how CI exercises the kernels.
* ``"torch"`` (the default for CPU tensors): the same algorithm in plain torch, chunked over
  rows and vocabulary, with the logits chunk computed in fp32.

Asking for ``impl="triton"`` where Triton cannot run raises; nothing falls back silently.

Vocab-parallel (``tp_group``): ``weight`` holds this rank's contiguous slice of the vocabulary
(rank order = vocabulary order; shard sizes may differ), ``hidden`` and ``labels`` are the same
on every rank and ``labels`` are global ids. A small all-reduce of the shard sizes gives each
rank its vocabulary offset. Each rank computes its partial ``(M, S, U, z_y)``; one MAX
all-reduce and one SUM all-reduce over ``[S; U; z_y]`` give every rank the full-vocabulary
log-probs and entropy. In backward each rank produces ``d_weight`` for its own
rows and ``d_hidden`` is SUM all-reduced (in fp32) inside the op, so every rank gets the full
gradient of its (replicated) ``hidden``: do not reduce it again.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

from .launch import on_device_of

try:  # Triton is optional: the torch implementation needs none of it.
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = exc

IGNORE_INDEX = -100
# Triton's interpreter is chosen when the kernels are decorated, i.e. at import of this module.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

log = logging.getLogger(__name__)

# Forward: width of the vocabulary range one program reduces (multiple of every BLOCK_N).
_SPLIT_V = 2048
# Backward scratch budget: this fraction of the materialised fp32 logits (N * V * 4 bytes), or
# the floor if that is larger (small N: the fraction would force slivers of GEMMs).
_BWD_BUDGET_FRACTION = 0.015
_BWD_BUDGET_FLOOR = 64 * 2**20
# Backward vocab chunk widths tried, widest first, and the slab height they must leave.
_BWD_VOCAB_CHUNKS = (16384, 8192, 4096, 2048)
_BWD_MIN_ROWS = 512
# Backward: column-group width of the d_logits rounding-error sums (divides every BLOCK_N).
_ERR_GROUP = 128


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _tile_swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """Grouped program order (as in Triton's matmul tutorial) for L2 reuse."""
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m
        return pid_m, pid_n

    @triton.jit
    def _logits_tile(h_ptr, w_ptr, offs_m, offs_n, row_mask, col_mask, H,
                     stride_hn, stride_hk, stride_wv, stride_wk,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_FP32: tl.constexpr):
        """fp32 ``hidden[offs_m] @ weight[offs_n].T`` tile, input dtype operands."""
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hn + offs_k[None, :] * stride_hk
        b_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wv + offs_k[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_mask = (k0 + offs_k) < H
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=col_mask[None, :] & k_mask[:, None], other=0.0)
            if DOT_FP32:  # interpreter: its bf16 tl.dot is wrong; bf16 products are exact in fp32
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            # "ieee": fp32 inputs stay fp32 (no TF32); ignored for bf16/fp16 operands.
            acc = tl.dot(a, b, acc=acc, input_precision="ieee")
            a_ptrs += BLOCK_K * stride_hk
            b_ptrs += BLOCK_K * stride_wk
        return acc

    @triton.jit
    def _grid_logits_tile(h_ptr, w_ptr, R, C, H, stride_hn, stride_hk, stride_wv, stride_wk, inv_t,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr):
        """The tile of logits / T that this program owns in an [R, C] grid of BLOCK_M x BLOCK_N
        tiles (swizzled): (its column-tile index, row and column offsets and masks, the tile)."""
        pid_m, pid_n = _tile_swizzle(tl.program_id(0), tl.cdiv(R, BLOCK_M), tl.cdiv(C, BLOCK_N),
                                     GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = offs_m < R
        col_mask = offs_n < C
        z = _logits_tile(h_ptr, w_ptr, offs_m, offs_n, row_mask, col_mask, H,
                         stride_hn, stride_hk, stride_wv, stride_wk,
                         BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32) * inv_t
        return pid_n, offs_m, offs_n, row_mask, col_mask, z

    @triton.jit
    def _fwd_kernel(h_ptr, w_ptr, labels_ptr, m_ptr, s_ptr, u_ptr, zy_ptr,
                    N, V, H, stride_hn, stride_hk, stride_wv, stride_wk, inv_t,
                    SPLIT_V: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr):
        """Partial (max, sum-exp, U) of one row block over one vocab split; target logit."""
        num_pid_m = tl.cdiv(N, BLOCK_M)
        num_splits = tl.cdiv(V, SPLIT_V)
        pid_m, pid_s = _tile_swizzle(tl.program_id(0), num_pid_m, num_splits, GROUP_M)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = offs_m < N
        label = tl.load(labels_ptr + offs_m, mask=row_mask, other=-1)
        v_start = pid_s * SPLIT_V
        v_end = tl.minimum(v_start + SPLIT_V, V)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        s_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        u_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        zy = tl.zeros([BLOCK_M], dtype=tl.float32)
        for v0 in range(v_start, v_end, BLOCK_N):
            offs_n = v0 + tl.arange(0, BLOCK_N)
            col_mask = offs_n < v_end
            z = _logits_tile(h_ptr, w_ptr, offs_m, offs_n, row_mask, col_mask, H,
                             stride_hn, stride_hk, stride_wv, stride_wk,
                             BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32) * inv_t
            z = tl.where(col_mask[None, :], z, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(z, axis=1))  # finite: every tile has a valid column
            zc = tl.where(col_mask[None, :], z - m_new[:, None], 0.0)
            p = tl.where(col_mask[None, :], tl.exp(zc), 0.0)
            alpha = tl.exp(m_i - m_new)  # 0 on the first tile (m_i = -inf)
            if COMPUTE_ENTROPY:
                shift = tl.where(s_i > 0.0, m_i - m_new, 0.0) * s_i  # 0 on the first tile
                u_i = alpha * (u_i + shift) + tl.sum(p * zc, axis=1)
            s_i = s_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            hit = offs_n[None, :] == label[:, None]
            zy += tl.sum(tl.where(hit, z, 0.0), axis=1)

        part = pid_s * N + offs_m
        tl.store(m_ptr + part, m_i, mask=row_mask)
        tl.store(s_ptr + part, s_i, mask=row_mask)
        if COMPUTE_ENTROPY:
            tl.store(u_ptr + part, u_i, mask=row_mask)
        # Exactly one split holds each (in-shard) label, so this store has a single writer.
        in_split = (label >= v_start) & (label < v_end)
        tl.store(zy_ptr + offs_m, zy, mask=row_mask & in_split)

    @triton.jit
    def _dlogits_kernel(h_ptr, w_ptr, labels_ptr, mx_ptr, logs_ptr, ent_ptr, gl_ptr, ge_ptr, dz_ptr,
                        err_ptr, R, C, H, v_off, stride_hn, stride_hk, stride_wv, stride_wk,
                        stride_dm, stride_dn, stride_eg, inv_t,
                        HAS_GL: tl.constexpr, HAS_GE: tl.constexpr, TRACK_ERR: tl.constexpr,
                        ERR_GROUP: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr):
        """d_logits (w.r.t. the raw logits x) of an [R, C] slab x chunk, recomputing the tile."""
        pid_n, offs_m, offs_n, row_mask, col_mask, z = _grid_logits_tile(
            h_ptr, w_ptr, R, C, H, stride_hn, stride_hk, stride_wv, stride_wk, inv_t,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_FP32)
        mx = tl.load(mx_ptr + offs_m, mask=row_mask, other=0.0)
        log_s = tl.load(logs_ptr + offs_m, mask=row_mask, other=0.0)
        # (z - max) - log S, not z - lse: lse rounded to fp32 would bias every p by ulp(lse).
        # Out-of-range lanes get logp = 0 (never stored) so exp() cannot overflow there.
        logp = tl.where(row_mask[:, None] & col_mask[None, :],
                        (z - mx[:, None]) - log_s[:, None], 0.0)
        p = tl.exp(logp)
        dz = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if HAS_GL:
            label = tl.load(labels_ptr + offs_m, mask=row_mask, other=-1)
            gl = tl.load(gl_ptr + offs_m, mask=row_mask, other=0.0)
            onehot = tl.where((offs_n[None, :] + v_off) == label[:, None], 1.0, 0.0)
            dz += gl[:, None] * (onehot - p)
        if HAS_GE:
            ent = tl.load(ent_ptr + offs_m, mask=row_mask, other=0.0)
            ge = tl.load(ge_ptr + offs_m, mask=row_mask, other=0.0)
            dz -= ge[:, None] * p * (logp + ent[:, None])
        dz = dz * inv_t
        mask = row_mask[:, None] & col_mask[None, :]
        dz_out = dz.to(dz_ptr.dtype.element_ty)
        d_ptrs = dz_ptr + offs_m.to(tl.int64)[:, None] * stride_dm + offs_n[None, :] * stride_dn
        tl.store(d_ptrs, dz_out, mask=mask)
        if TRACK_ERR:
            # Rounding error of d_logits summed per row over each ERR_GROUP-wide column group
            # (see _backward_triton). The [groups, rows] layout does not depend on BLOCK_N, so
            # whichever config the autotuner picks writes every group: nothing stale is left.
            err = tl.where(mask, dz_out.to(tl.float32) - dz, 0.0)
            G: tl.constexpr = BLOCK_N // ERR_GROUP
            err = tl.sum(tl.reshape(err, (BLOCK_M, G, ERR_GROUP)), axis=2)
            grp = pid_n * G + tl.arange(0, G)
            e_ptrs = err_ptr + grp[None, :] * stride_eg + offs_m[:, None]
            tl.store(e_ptrs, err, mask=row_mask[:, None] & (grp[None, :] * ERR_GROUP < C))

    # Hopper (sm_90) autotune configs per kernel and operand width: (BLOCK_M, BLOCK_N, BLOCK_K,
    # num_warps, num_stages), GROUP_M 8. Each is spill-free: `cuobjdump -res-usage` of its sm_90
    # cubin shows stack 0 with Triton 3.6 (the GPU image's) and 3.9, checked in CI by
    # tests/kernels/test_sm90_compile.py. 16-bit: two consumer warpgroups (8 warps) on a
    # 128x128 or 64x256 tile keep 64 fp32 accumulators per thread, which leaves the registers
    # the online softmax needs; the 128x256 tiles cuBLAS uses at these shapes (128 accumulators)
    # spilled 0.4-1.2 KB per thread in every kernel. fp32 (IEEE dots, on the CUDA cores):
    # 32-64 x 128 tiles of 32-deep K slices (48 KiB of shared memory at 3 stages). The forward's
    # 128 x 128 tiles read the hidden rows half as often per logit as 64 x 256 (its first H100
    # round ran at 416 TFLOP/s against cuBLAS's 720 with 64 x 256 only); spill-free with
    # Triton 3.6, 8 bytes of stack with 3.9 (KNOWN_SPILLS of the sm_90 test).
    _LM_HEAD_CONFIGS = {
        ("fwd", 2): [(64, 256, 64, 8, 3), (64, 256, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4)],
        ("dlogits", 2): [(128, 128, 64, 8, 4), (64, 256, 64, 8, 4)],
        ("probs", 2): [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4)],
        ("fwd", 4): [(64, 128, 32, 8, 3), (32, 128, 32, 4, 3)],
        ("dlogits", 4): [(64, 128, 32, 8, 3), (32, 128, 32, 4, 3)],
        ("probs", 4): [(64, 128, 32, 8, 3), (32, 128, 32, 4, 3)],
    }

    def lm_head_configs(kernel: str, itemsize: int) -> list:
        """The autotune configs of LM-head kernel ``kernel`` ("fwd", "dlogits", "probs") for
        operands of ``itemsize`` bytes (2: bf16/fp16, 4: fp32)."""
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=w, num_stages=st)
                for m, n, k, w, st in _LM_HEAD_CONFIGS[(kernel, itemsize)]]

    def lm_head_autotune(kernel_fn, kernel: str, key: list[str]):
        """``kernel_fn`` autotuned over :func:`lm_head_configs` of its operands' width (read from
        its first argument, the hidden states): the autotuner's early pruning keeps one width's
        configs. ``key``: the arguments a tuned config is kept for, the constexpr variants
        included (a config tuned without entropy is not reused with it); Triton adds every
        tensor argument's dtype to the key itself."""
        by_width = {size: lm_head_configs(kernel, size) for size in (2, 4)}

        def for_width(configs, named_args, **kwargs):
            return by_width[named_args["h_ptr"].element_size()]

        return triton.autotune(by_width[2] + by_width[4], key=key,
                               prune_configs_by={"early_config_prune": for_width})(kernel_fn)

    # The interpreter runs one fixed small config (its blocks are numpy arrays; autotuning there
    # would only time numpy). BLOCK_N=256 keeps V=151936 ragged (151936 = 593.5 * 256).
    _INTERPRET_META = {"BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 4}
    # Triton 3.9's interpreter computes bf16/fp16 tl.dot wrongly (it multiplies the raw bits),
    # so under the interpreter the operands are upcast to fp32 first: the same maths, since
    # bf16/fp16 products are exact in fp32 and the accumulator is fp32 either way.
    _DOT_FP32 = TRITON_INTERPRET
    if TRITON_INTERPRET:
        _fwd_launch, _dlogits_launch = _fwd_kernel, _dlogits_kernel
    else:
        _fwd_launch = lm_head_autotune(_fwd_kernel, "fwd", ["V", "H", "COMPUTE_ENTROPY"])
        _dlogits_launch = lm_head_autotune(_dlogits_kernel, "dlogits", ["C", "H", "HAS_GL", "HAS_GE", "TRACK_ERR"])


def triton_available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether the Triton implementation can run on ``device``, and if not, why."""
    if triton is None:
        return False, f"triton is not importable ({_TRITON_IMPORT_ERROR!r})"
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda" and not TRITON_INTERPRET:
        return False, (f"the Triton kernels need a CUDA tensor, or TRITON_INTERPRET=1 set before "
                       f"importing {__name__}, to run on device {dev.type!r}")
    return True, ""


# ----------------------------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Chunking: ``rows`` per slab and ``vocab`` columns per chunk (torch forward, backward)."""

    rows: int
    vocab: int


def _balanced_rows(n: int, max_rows: int, step: int = 128) -> int:
    """Slab height: at most ``max_rows`` (a multiple of ``step``, at least ``step``), with the
    ``n`` rows split into equal slabs, so the last one is not a sliver."""
    if max_rows >= n:
        return max(n, 1)
    max_rows = max(step, max_rows // step * step)
    slabs = -(-n // max_rows)
    rows = -(-n // slabs)
    rows = -(-rows // step) * step
    return min(rows, max_rows)


def _plan(n: int, h: int, v: int, itemsize: int, impl: str = "triton") -> Plan:
    """Backward chunking under a scratch budget: the larger of ``_BWD_BUDGET_FRACTION`` of the
    fp32 logits (``n * v * 4`` bytes) and ``_BWD_BUDGET_FLOOR``.

    Triton path, scratch per slab row: the fp32 d_hidden accumulator (4h), for bf16/fp16 inputs
    the fp32 product of one chunk (4h), the d_logits chunk (itemsize * vocab) and the rounding
    sums (4 bytes per 128 columns of the vocabulary). The widest vocab chunk (of 16384, 8192,
    4096, 2048) that still leaves slabs of ``_BWD_MIN_ROWS`` rows is taken: every chunk costs
    one pass over the fp32 accumulator, and every slab one more rounding of d_weight (it is
    accumulated over slabs in the weight's dtype) plus a d_weight GEMM as deep as the slab.
    Slabs and chunks are then evened out. At (8192, 4096, 151936) bf16 that is 8 slabs of 1024
    rows x 10 chunks of 15360 columns (the last 13696): three GEMMs of 1024 x 15360 x 4096
    (~129 GFLOP) per step, 960 output tiles of 128x128 (or 64x256) per d_logits launch (~7.3
    waves on 132 SMs). Torch path: fp32 copies of the slab (4h), the d_hidden accumulator (4h) and
    about three fp32 ``[rows, vocab]`` temporaries, 4096-column chunks.
    """
    budget = max(_BWD_BUDGET_FRACTION * n * v * 4, _BWD_BUDGET_FLOOR)
    if impl != "triton":
        vocab = max(1, min(v, 4096))
        return Plan(rows=_balanced_rows(n, int(budget // (8 * h + 12 * vocab))), vocab=vocab)
    acc = 4 * h if itemsize == 4 else 8 * h
    err = 0 if itemsize == 4 else 4 * -(-v // _ERR_GROUP)
    for vocab in _BWD_VOCAB_CHUNKS:
        vocab = max(1, min(v, vocab))
        rows = int(budget // (acc + err + itemsize * vocab))
        if rows >= min(n, _BWD_MIN_ROWS):
            break
    # equal chunks (multiples of 256 columns): a ragged last one would be a small, badly
    # quantised launch (e.g. 4480 columns x 1024 rows = 288 tiles of 64x256 on 132 SMs, 2.2 waves)
    return Plan(rows=_balanced_rows(n, rows), vocab=_balanced_rows(v, vocab, 256))


def plan_scratch_bytes(plan: Plan, n: int, h: int, v: int, itemsize: int) -> int:
    """The Triton backward's scratch for ``plan`` (what :func:`_plan` budgets)."""
    rows, vocab = min(plan.rows, n), min(plan.vocab, v)
    acc = 4 * h if itemsize == 4 else 8 * h
    err = 0 if itemsize == 4 else 4 * -(-v // _ERR_GROUP)
    return rows * (acc + err + itemsize * vocab)


# ----------------------------------------------------------------------------------------------
# Forward partials: (m, s, u, zy) over this rank's vocabulary
# ----------------------------------------------------------------------------------------------
def _merge_partials(m, s, u):
    """Merge [P, N] partials (each relative to its own max) into [N] ones."""
    mx = m.max(dim=0).values
    scale = torch.exp(m - mx)
    s_tot = (s * scale).sum(dim=0)
    u_tot = None if u is None else (scale * (u + s * (m - mx))).sum(dim=0)
    return mx, s_tot, u_tot


def _partials_triton(hidden, weight, labels_local, inv_t, entropy):
    n, h = hidden.shape
    v = weight.shape[0]
    splits = triton.cdiv(v, _SPLIT_V)
    dev = hidden.device
    m = torch.empty((splits, n), device=dev, dtype=torch.float32)
    s = torch.empty((splits, n), device=dev, dtype=torch.float32)
    u = torch.empty((splits, n), device=dev, dtype=torch.float32) if entropy else s
    zy = torch.zeros(n, device=dev, dtype=torch.float32)
    if n == 0:
        return m[0], s[0], (u[0] if entropy else None), zy

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_M"]) * splits,)

    extra = _INTERPRET_META if TRITON_INTERPRET else {}
    with on_device_of(hidden):
        _fwd_launch[grid](hidden, weight, labels_local, m, s, u, zy, n, v, h,
                          hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
                          inv_t, SPLIT_V=_SPLIT_V, COMPUTE_ENTROPY=entropy, DOT_FP32=_DOT_FP32,
                          **extra)
    mx, s_tot, u_tot = _merge_partials(m, s, u if entropy else None)
    return mx, s_tot, u_tot, zy


def _partials_torch(hidden, weight, labels_local, inv_t, entropy, plan: Plan):
    n = hidden.shape[0]
    v = weight.shape[0]
    dev = hidden.device
    m = torch.full((n,), float("-inf"), device=dev, dtype=torch.float32)
    s = torch.zeros(n, device=dev, dtype=torch.float32)
    u = torch.zeros(n, device=dev, dtype=torch.float32) if entropy else None
    zy = torch.zeros(n, device=dev, dtype=torch.float32)
    for r0 in range(0, n, plan.rows):
        r1 = min(n, r0 + plan.rows)
        hf = hidden[r0:r1].float()
        lab = labels_local[r0:r1]
        mr, sr, ur, zr = m[r0:r1], s[r0:r1], (u[r0:r1] if entropy else None), zy[r0:r1]
        for c0 in range(0, v, plan.vocab):
            c1 = min(v, c0 + plan.vocab)
            z = hf @ weight[c0:c1].float().T
            z.mul_(inv_t)
            in_chunk = (lab >= c0) & (lab < c1)
            idx = (lab - c0).clamp(0, c1 - c0 - 1)
            zr.add_(torch.where(in_chunk, z.gather(1, idx[:, None])[:, 0], torch.zeros_like(zr)))
            m_new = torch.maximum(mr, z.max(dim=1).values)
            zc = z.sub_(m_new[:, None])  # in place: two [rows, vocab] buffers live at most
            p = torch.exp(zc)
            alpha = torch.exp(mr - m_new)
            if entropy:
                shift = torch.where(sr > 0, mr - m_new, torch.zeros_like(sr)) * sr
                ur.copy_(alpha * (ur + shift) + torch.linalg.vecdot(p, zc))
            sr.copy_(sr * alpha + p.sum(dim=1))
            mr.copy_(m_new)
            del z, zc, p
    return m, s, u, zy


def tp_merge(m, s, u, zy, tp_group):
    """Full-vocabulary ``(max, sum-exp, U, z_y)`` from every rank's partials over its shard:
    one MAX all-reduce, one SUM all-reduce of ``[S; z_y; U]`` rescaled to the global max."""
    import torch.distributed as dist

    m_glob = m.clone()
    dist.all_reduce(m_glob, op=dist.ReduceOp.MAX, group=tp_group)
    scale = torch.exp(m - m_glob)
    parts = [s * scale, zy]
    if u is not None:
        parts.append(scale * (u + s * (m - m_glob)))
    packed = torch.stack(parts)
    dist.all_reduce(packed, group=tp_group)
    return m_glob, packed[0], (packed[2] if u is not None else None), packed[1]


def check_labels(labels: torch.Tensor, v_total: int, where: str) -> torch.Tensor:
    """``labels == IGNORE_INDEX`` after checking every label is in ``[0, v_total)`` or ignored.
    On a device (CUDA) the check is asynchronous (``torch._assert_async``: no host sync in the
    training step; a bad label fails the next kernel launch with a device-side assert); on the
    CPU it raises ValueError at once."""
    ignored = labels == IGNORE_INDEX
    bad = ((labels < 0) & ~ignored) | (labels >= v_total)
    msg = f"{where}: labels must be in [0, {v_total}) or {IGNORE_INDEX} (ignored)"
    if labels.device.type != "cpu":
        torch._assert_async(~bad.any(), msg)
    elif labels.numel() and bool(bad.any()):
        raise ValueError(f"{msg}; got e.g. {int(labels[bad][0])}")
    return ignored


def local_labels(labels, ignored, v_start, v_local):
    """Labels relative to this rank's shard; -1 where ignored or outside the shard."""
    local = labels - v_start
    return torch.where(ignored | (local < 0) | (local >= v_local),
                       torch.full_like(labels, -1), local).contiguous()


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------
# aten::mm.dtype_out (torch >= 2.8): bf16/fp16 x bf16/fp16 -> fp32 on cuBLAS.
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype_out")
_WARNED: set[str] = set()


def mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` into fp32 ``out`` without rounding the product to ``a``'s dtype first
    (cuBLAS accumulates in fp32 either way). On a CPU tensor (the interpreter's tests) the
    operands are upcast: bf16/fp16 products are exact in fp32, so it is the same maths."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if not a.is_cuda:
        return torch.mm(a.float(), b.float(), out=out)
    if _MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    if "mm_fp32" not in _WARNED:
        _WARNED.add("mm_fp32")
        log.warning("fused_logprobs: this torch (%s) has no fp32-output mm for %s inputs; the "
                    "backward rounds each chunk's d_hidden product to %s before summing it in "
                    "fp32 (less exact when the logits share a large common offset); torch>=2.8 "
                    "avoids it", torch.__version__, a.dtype, a.dtype)
    return out.copy_(a @ b)


def _dlogits_triton(h_slab, w_chunk, lab, mx, log_s, ent, gl, ge, v_off, inv_t, out, err):
    r, hdim = h_slab.shape
    c = w_chunk.shape[0]

    def grid(meta):
        return (triton.cdiv(r, meta["BLOCK_M"]) * triton.cdiv(c, meta["BLOCK_N"]),)

    dummy = mx
    extra = _INTERPRET_META if TRITON_INTERPRET else {}
    with on_device_of(h_slab):
        _dlogits_launch[grid](h_slab, w_chunk, lab, mx, log_s, ent if ent is not None else dummy,
                              gl if gl is not None else dummy, ge if ge is not None else dummy, out,
                              err if err is not None else dummy, r, c, hdim, v_off,
                              h_slab.stride(0), h_slab.stride(1),
                              w_chunk.stride(0), w_chunk.stride(1), out.stride(0), out.stride(1),
                              err.stride(0) if err is not None else 0,
                              inv_t, HAS_GL=gl is not None, HAS_GE=ge is not None,
                              TRACK_ERR=err is not None, ERR_GROUP=_ERR_GROUP, DOT_FP32=_DOT_FP32, **extra)
    return out


def _backward_triton(hidden, weight, labels_local, mx, log_s, ent, gl, ge, inv_t, plan, tp_group):
    """d_hidden and d_weight as a few large GEMMs per (row slab, vocab chunk).

    Per slab of ``plan.rows`` rows and chunk of ``plan.vocab`` columns: one Triton kernel
    recomputes the logits and writes ``d_logits`` in the input dtype into a reused buffer; one
    GEMM adds ``d_logits @ W_chunk`` to the slab's fp32 d_hidden accumulator (for bf16/fp16
    with an fp32 output, see :func:`mm_fp32`: a chunk's product holds the chunk's share of any
    common component of the weight rows, which need not cancel within a chunk); one GEMM
    writes ``d_logits.T @ hidden_slab`` into the chunk's rows of d_weight (accumulated over
    slabs in place, in the weight's dtype).

    Rounding ``d_logits`` to bf16 is harmless for d_weight but can wreck d_hidden when the
    weight rows share a large common component (logits with a big common offset): d_hidden_i
    = sum_j dz_ij w_j then cancels, and the rounding errors delta_ij no longer do. Write w_j =
    wbar + (w_j - wbar) with wbar the mean weight row: the kernel also returns e_i = sum_j
    delta_ij (per 128-column group), and subtracting e_i * wbar once per slab leaves only
    sum_j delta_ij (w_j - wbar), an error proportional to the spread of the weight rows
    instead of their mean.
    """
    n, hdim = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    d_hidden = torch.empty_like(hidden)
    d_weight = torch.empty_like(weight)
    if n == 0:
        return d_hidden, d_weight.zero_()
    exact = hidden.dtype == torch.float32
    rows, vocab = min(plan.rows, n), min(plan.vocab, v)
    chunks = [(c0, min(v, c0 + vocab)) for c0 in range(0, v, vocab)]
    acc = torch.empty((rows, hdim), device=dev, dtype=torch.float32)
    part = None if exact else torch.empty((rows, hdim), device=dev, dtype=torch.float32)
    dz_buf = torch.empty((rows, vocab), device=dev, dtype=hidden.dtype)
    err = wbar = None
    if not exact:
        err = torch.empty((sum(triton.cdiv(c1 - c0, _ERR_GROUP) for c0, c1 in chunks), rows),
                          device=dev, dtype=torch.float32)
        wbar = weight.sum(0, dtype=torch.float32).div_(v)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        r = r1 - r0
        h_slab, a = hidden[r0:r1], acc[:r]
        args = (labels_local[r0:r1], mx[r0:r1], log_s[r0:r1], None if ent is None else ent[r0:r1],
                None if gl is None else gl[r0:r1], None if ge is None else ge[r0:r1])
        g0 = 0
        for ci, (c0, c1) in enumerate(chunks):
            w_chunk, dz = weight[c0:c1], dz_buf[:r, :c1 - c0]
            groups = triton.cdiv(c1 - c0, _ERR_GROUP)
            _dlogits_triton(h_slab, w_chunk, *args, c0, inv_t, dz,
                            None if exact else err[g0:g0 + groups, :r])
            g0 += groups
            if exact:
                if ci == 0:
                    torch.mm(dz, w_chunk, out=a)
                else:
                    a.addmm_(dz, w_chunk)
            elif ci == 0:
                mm_fp32(dz, w_chunk, out=a)
            else:
                a.add_(mm_fp32(dz, w_chunk, out=part[:r]))
            if r0 == 0:  # GEMM straight into the output rows, no temporary
                torch.mm(dz.T, h_slab, out=d_weight[c0:c1])
            else:
                d_weight[c0:c1].addmm_(dz.T, h_slab)
        if not exact:
            a.addr_(err[:, :r].sum(0), wbar, alpha=-1.0)
        if tp_group is not None:
            torch.distributed.all_reduce(a, group=tp_group)
        d_hidden[r0:r1].copy_(a)
    return d_hidden, d_weight


def _dlogits_torch(h_slab, w_chunk, lab, mx, log_s, ent, gl, ge, v_off, inv_t):
    logp = h_slab.float() @ w_chunk.float().T
    logp.mul_(inv_t).sub_(mx[:, None]).sub_(log_s[:, None])
    p = torch.exp(logp)
    if ge is not None:  # dz = -e p (logp + H), built in the logp buffer
        dz = logp.add_(ent[:, None]).mul_(p).mul_(-ge[:, None])
    else:
        dz = torch.zeros_like(logp)
    if gl is not None:  # + g (onehot - p)
        dz.sub_(p.mul_(gl[:, None]))
        # the label's column (a row whose label lies outside the chunk adds 0): no nonzero, whose
        # size the host would have to read
        c = w_chunk.shape[0]
        hit = (lab >= v_off) & (lab < v_off + c)
        col = (lab - v_off).clamp(0, c - 1)
        dz.scatter_add_(1, col[:, None], torch.where(hit, gl, torch.zeros_like(gl))[:, None])
    return dz.mul_(inv_t)


def _backward_torch(hidden, weight, labels_local, mx, log_s, ent, gl, ge, inv_t, plan, tp_group):
    """The same per (row slab, vocab chunk), all in fp32 (CPU default)."""
    n, hdim = hidden.shape
    v = weight.shape[0]
    d_hidden = torch.empty_like(hidden)
    d_weight = torch.empty_like(weight)
    if n == 0:
        return d_hidden, d_weight.zero_()
    for r0 in range(0, n, plan.rows):
        r1 = min(n, r0 + plan.rows)
        h_slab = hidden[r0:r1].float()
        acc = torch.zeros((r1 - r0, hdim), device=hidden.device, dtype=torch.float32)
        args = (labels_local[r0:r1], mx[r0:r1], log_s[r0:r1], None if ent is None else ent[r0:r1],
                None if gl is None else gl[r0:r1], None if ge is None else ge[r0:r1])
        for c0 in range(0, v, plan.vocab):
            c1 = min(v, c0 + plan.vocab)
            w_chunk = weight[c0:c1]
            dz = _dlogits_torch(hidden[r0:r1], w_chunk, *args, c0, inv_t)
            acc.addmm_(dz, w_chunk.float())
            if r0 == 0:
                d_weight[c0:c1].copy_(dz.T @ h_slab)
            else:
                d_weight[c0:c1].add_(dz.T @ h_slab)
            del dz
        if tp_group is not None:
            torch.distributed.all_reduce(acc, group=tp_group)
        d_hidden[r0:r1].copy_(acc)
        del acc
    return d_hidden, d_weight


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------
def vocab_offset(v_local: int, device, tp_group) -> tuple[int, int]:
    """(start of this rank's shard, total vocabulary) from every rank's shard size."""
    if tp_group is None:
        return 0, v_local
    import torch.distributed as dist

    world = dist.get_world_size(tp_group)
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    sizes[dist.get_rank(tp_group)] = v_local
    dist.all_reduce(sizes, group=tp_group)
    sizes = sizes.tolist()
    rank = dist.get_rank(tp_group)
    return int(sum(sizes[:rank])), int(sum(sizes))


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, return_entropy, tp_group, impl, plan):
        inv_t = 1.0 / temperature
        n = hidden.shape[0]
        v_local = weight.shape[0]
        v_start, v_total = vocab_offset(v_local, hidden.device, tp_group)
        ignored = check_labels(labels, v_total, "fused_logprobs")
        labels_local = local_labels(labels, ignored, v_start, v_local)
        if plan is None:
            plan = _plan(n, hidden.shape[1], v_local, hidden.element_size(), impl)

        if impl == "triton":
            m, s, u, zy = _partials_triton(hidden, weight, labels_local, inv_t, return_entropy)
        else:
            m, s, u, zy = _partials_torch(hidden, weight, labels_local, inv_t, return_entropy, plan)
        if tp_group is not None:
            m, s, u, zy = tp_merge(m, s, u, zy, tp_group)

        log_s = torch.log(s)
        zero = torch.zeros_like(log_s)
        logp = torch.where(ignored, zero, (zy - m) - log_s)
        ent = torch.where(ignored, zero, log_s - u / s) if return_entropy else None

        ctx.save_for_backward(hidden, weight, labels_local, ignored, m, log_s,
                              ent if ent is not None else log_s)
        ctx.inv_t, ctx.tp_group, ctx.impl, ctx.plan = inv_t, tp_group, impl, plan
        ctx.has_ent = return_entropy
        ctx.set_materialize_grads(False)
        if return_entropy:
            return logp, ent
        return logp

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, labels_local, ignored, mx, log_s, ent = ctx.saved_tensors
        g_logp = grads[0]
        g_ent = grads[1] if ctx.has_ent else None
        if g_logp is None and g_ent is None:
            return (None,) * 8
        zero = torch.zeros((), device=mx.device, dtype=torch.float32)

        def prep(g):
            return None if g is None else torch.where(ignored, zero, g.float()).contiguous()

        backward = _backward_triton if ctx.impl == "triton" else _backward_torch
        d_hidden, d_weight = backward(hidden, weight, labels_local, mx, log_s,
                                      ent if g_ent is not None else None,
                                      prep(g_logp), prep(g_ent), ctx.inv_t, ctx.plan,
                                      ctx.tp_group)
        return d_hidden, d_weight, None, None, None, None, None, None


def check_inputs(hidden, weight, labels, temperature, impl, where: str) -> str:
    """Validates the LM-head inputs shared by the fused ops; returns the implementation."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{where}: expected hidden [N, H] and weight [V, H], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"{where}: labels must be [N]={hidden.shape[0]}, "
                         f"got {tuple(labels.shape)}")
    if hidden.dtype != weight.dtype or hidden.dtype not in (torch.float32, torch.bfloat16,
                                                            torch.float16):
        raise TypeError(f"{where}: hidden and weight must share a float32/bfloat16/"
                        f"float16 dtype, got {hidden.dtype} and {weight.dtype}")
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(f"{where}: hidden, weight and labels must be on one device")
    if weight.shape[0] == 0:
        raise ValueError(f"{where}: weight has no vocabulary rows")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature > 0):
        raise ValueError(f"{where}: temperature must be a finite float > 0, "
                         f"got {temperature!r}")
    if impl is None:
        impl = "triton" if hidden.is_cuda else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"{where}: impl must be 'triton' or 'torch', got {impl!r}")
    if impl == "triton":
        ok, why = triton_available(hidden.device)
        if not ok:
            raise RuntimeError(f"{where}(impl='triton'): {why}")
    return impl


def fused_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   temperature: float = 1.0, return_entropy: bool = False, tp_group=None,
                   *, impl: str | None = None, plan: Plan | None = None):
    """Per-token log-probs (and entropy) of the LM head, without materialising the logits.

    Args:
        hidden: ``[N, H]`` final hidden states (fp32, bf16 or fp16).
        weight: ``[V, H]`` LM-head weight, same dtype and device (with ``tp_group``: this
            rank's contiguous ``[V_local, H]`` slice of the vocabulary).
        labels: ``[N]`` int64 target ids (global ids under ``tp_group``); ``-100`` means
            ignore: log-prob 0, entropy 0, no gradient from that row. Out-of-range labels
            raise ValueError (on CUDA: a device-side assert, see :func:`check_labels`).
        temperature: the logits are ``hidden @ weight.T / temperature`` (must be > 0).
        return_entropy: also return the entropy of ``softmax(logits)`` per row.
        tp_group: a ``torch.distributed`` process group over which the vocabulary is sharded.
        impl: ``"triton"`` or ``"torch"``; default ``"triton"`` for CUDA tensors and
            ``"torch"`` otherwise. ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1``
            (set before import) and raises if Triton cannot run; it never falls back.
        plan: override the row-slab / vocab-chunk sizes (tests; see :func:`_plan`).

    Returns:
        fp32 ``logprobs [N]``, or ``(logprobs, entropy)`` fp32 ``[N]`` each. Both are
        differentiable with respect to ``hidden`` and ``weight``.
    """
    impl = check_inputs(hidden, weight, labels, temperature, impl, "fused_logprobs")
    return _FusedLogprobs.apply(hidden, weight, labels.long(),
                                float(temperature), bool(return_entropy), tp_group, impl, plan)


__all__ = ["fused_logprobs", "triton_available", "Plan", "IGNORE_INDEX"]

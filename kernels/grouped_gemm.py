"""Grouped GEMM over expert-sorted rows with no host sync: ``y[r] = x[r] @ w[g].T`` for every
row r of group g, the groups given by their end offsets on the device.

Self-contained, Liger-style: the Triton kernels, the op that drives them (a
``torch.library.custom_op`` with its fake and its autograd) and a plain-torch reference.

Why: ``torch._grouped_mm`` runs CUTLASS only for bf16 on sm_90+; for float32/float16 on a GPU
its fallback copies the offsets to the host and loops over the groups (a host sync and E
launches per call), and its meta kernel accepts bf16 only, so ``torch.compile`` cannot trace it
for float32 even on a CPU, where the kernel itself runs (torch 2.13). This op gives both cases
one traceable, sync-free call:

* ``impl="triton"`` (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``): MegaBlocks' /
  ScatterMoE's static tiling. Group g's rows are cut into ``ceil(count_g / BLOCK_M)`` row tiles;
  the launch grid has a static ``ceil(rows / BLOCK_M) + E`` tiles (the most any split of the
  rows can need), each program works out its group and first row from the group ends (every
  group's tile count and their running sum, in registers: ``_tile_of``, the in-kernel form of
  ``tile_plan``), and programs past the last used tile exit. The weight gradient (``dW[g] = dY_g^T X_g``) is a second kernel on a static
  ``E x N-tiles x K-tiles`` grid, each program looping over its group's rows (the loop bound
  is read on the device). The input gradient is the first kernel on ``w`` transposed (strides
  only). Float32 dots are exact IEEE products unless ``torch.backends.cuda.matmul.allow_tf32``
  asks for TF32, as torch's own matmuls do.
* ``impl="torch"`` (CPU tensors): ``torch._grouped_mm``'s CPU kernel (float32, bfloat16,
  float16), behind this op's fake so that ``torch.compile`` traces it.

Either way the op's output size is ``[rows, N]`` from shapes alone, so nothing reads device
values on the host and a CUDA graph can capture it.
"""
from __future__ import annotations

import json
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

# Triton's interpreter is chosen when the kernels are decorated, i.e. at import of this module.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# (BLOCK_N, BLOCK_K, num_warps, num_stages) where the mean group has at most 16 rows (a decode
# step: a few rows per expert). Such a call moves the chosen experts' weights and little else, so
# its tiles are narrow and deep (many programs, each with many bytes in flight) rather than
# square. These are the defaults; `moe-rl bench grouped-gemm --save` times candidates on a GPU and
# writes the fastest to a file per device, as SGLang's fused-MoE configs are (see tuned_tiles).
SMALL_GROUP_BLOCKS = {torch.float32: (32, 128, 4, 4), torch.bfloat16: (32, 128, 4, 4),
                      torch.float16: (32, 128, 4, 4)}
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
CONFIG_ENV = "MOE_RL_GROUPED_GEMM_CONFIG"
_TUNED: dict[int, dict[torch.dtype, tuple[int, int, int, int]]] = {}


def config_file(device_name: str) -> str:
    """The tuned-tiles file of a GPU model: ``configs/grouped_gemm_<name>.json``, the name as
    ``torch.cuda.get_device_name`` gives it, spaces and slashes as underscores."""
    return os.path.join(CONFIG_DIR, "grouped_gemm_" + device_name.replace(" ", "_").replace("/", "_") + ".json")


def tuned_tiles(device: torch.device) -> dict[torch.dtype, tuple[int, int, int, int]]:
    """Small-group tiles per dtype for ``device`` (read once per device): the file named by
    ``$MOE_RL_GROUPED_GEMM_CONFIG`` if set, else this GPU model's file under ``configs/`` if there
    is one, else ``SMALL_GROUP_BLOCKS``. A file holds ``{"float32": [BLOCK_N, BLOCK_K,
    num_warps, num_stages], ...}``; dtypes it leaves out keep the defaults."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _TUNED:
        named = os.environ.get(CONFIG_ENV)
        path = named or config_file(torch.cuda.get_device_name(index))
        tiles = dict(SMALL_GROUP_BLOCKS)
        if named or os.path.exists(path):
            with open(path) as f:  # a file named but missing or malformed is an error, not the defaults
                data = json.load(f)
            for name, value in data.items():
                dtype = getattr(torch, name, None)
                if dtype in tiles:
                    tiles[dtype] = tuple(int(v) for v in value)
        _TUNED[index] = tiles
    return _TUNED[index]


def _blocks(dtype: torch.dtype, rows: int = 0, groups: int = 1,
            device: torch.device | None = None) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). A float32 IEEE dot runs on the CUDA
    cores (64-wide tiles), a 16-bit one on the tensor cores (128 x 128 x 64). A float32 row tile
    is no taller than the mean group (``rows / groups``, at least 16, ``tl.dot``'s least): in a
    decode step each expert gets a few rows, and a 64-row tile would spend 7/8 of its products
    on masked rows (8 rows per expert at 64 tokens, top-4 of 32 experts). Groups of at most 16
    rows on the mean take 16-row tiles in every dtype, their other sizes from ``tuned_tiles``
    on a CUDA ``device``, else ``SMALL_GROUP_BLOCKS``."""
    if TRITON_INTERPRET:
        return 16, 32, 16, 1, 1
    mean = -(-rows // max(groups, 1))
    if 0 < mean <= 16:
        table = tuned_tiles(device) if device is not None and device.type == "cuda" else SMALL_GROUP_BLOCKS
        return (16, *table[dtype])
    return large_group_blocks(dtype, mean)


def large_group_blocks(dtype: torch.dtype, mean: int) -> tuple[int, int, int, int, int]:
    """The tiles of groups of more than 16 rows on the mean (training's): see ``_blocks``."""
    if dtype == torch.float32:
        return min(64, max(16, triton.next_power_of_2(mean))), 64, 32, 4, 3
    return 128, 128, 64, 8, 3


def tile_plan(offs: Tensor, rows: int, block_m: int) -> tuple[Tensor, Tensor]:
    """(group, first row) of each of the ``ceil(rows / block_m) + E`` row tiles of the launch
    grid, int32, on ``offs``' device: tile t belongs to group ``group[t]`` and covers rows
    ``[row[t], min(row[t] + block_m, end of the group))``; unused tiles get group E. Device
    ops of static shapes only (no host read)."""
    E = offs.shape[0]
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    t = torch.arange(triton_cdiv(rows, block_m) + E, device=offs.device)
    group = torch.searchsorted(tile_end, t, right=True)
    g = group.clamp(max=E - 1)
    row = (ends[g] - counts[g]) + (t - (tile_end[g] - tiles[g])) * block_m
    return group.to(torch.int32), row.to(torch.int32)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if triton is not None:

    @triton.jit
    def _tile_of(t, offs_ptr, E, BLOCK_M: tl.constexpr, E_P2: tl.constexpr):
        """(group, first row, group end) of row tile ``t``, as :func:`tile_plan` gives them,
        worked out by the program itself from the group ends: every group's tile count and their
        running sum in registers (``E_P2`` >= E lanes). A separate plan cost ~22 small kernels
        per GEMM call, more launches than the rest of a one-token decode step. Group E: past
        the last tile."""
        e = tl.arange(0, E_P2)
        ends = tl.load(offs_ptr + e, mask=e < E, other=0)
        starts = tl.load(offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
        tiles = tl.where(e < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        tile_end = tl.cumsum(tiles, 0)
        g = tl.sum((tile_end <= t).to(tl.int32), 0)  # the first group whose tiles end after t
        here = e == g
        row0 = tl.sum(tl.where(here, starts + (t - (tile_end - tiles)) * BLOCK_M, 0), 0)
        end = tl.sum(tl.where(here, ends, 0), 0)
        return g, row0, end

    @triton.jit
    def _gmm_kernel(x_ptr, w_ptr, y_ptr, offs_ptr, N, K, E,
                    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_ym, stride_yn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_P2: tl.constexpr,
                    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
        """One (row tile, column tile) of y = x @ w[g].T; tiles past the last group's exit."""
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        g, row0, end = _tile_of(t, offs_ptr, E, BLOCK_M, E_P2)
        if g < E:
            offs_m = row0 + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            m_mask = offs_m < end
            n_mask = offs_n < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            w_base = w_ptr + g.to(tl.int64) * stride_we
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < K
                a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk,
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                            mask=n_mask[None, :] & k_mask[:, None], other=0.0)
                if DOT_FP32:  # the interpreter's 16-bit dot is wrong: same maths in fp32
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc += tl.dot(a, b, input_precision=PRECISION)
            tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn,
                     acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _gmm_wgrad_kernel(dy_ptr, x_ptr, dw_ptr, offs_ptr, N, K,
                          stride_dym, stride_dyn, stride_xm, stride_xk, stride_we, stride_wn, stride_wk,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
        """One (group, column tile, K tile) of dW[g] = dY_g^T @ X_g, looping over the group's rows
        (an empty group writes zeros)."""
        g = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
        end = tl.load(offs_ptr + g)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        k_mask = offs_k < K
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = offs_m < end
            dy = tl.load(dy_ptr + offs_m[:, None].to(tl.int64) * stride_dym + offs_n[None, :] * stride_dyn,
                         mask=m_mask[:, None] & n_mask[None, :], other=0.0)
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk,
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if DOT_FP32:
                dy = dy.to(tl.float32)
                x = x.to(tl.float32)
            acc += tl.dot(tl.trans(dy), x, input_precision=PRECISION)
        tl.store(dw_ptr + g.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                 acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not TRITON_INTERPRET and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _gmm_triton(x: Tensor, w: Tensor, offs: Tensor, blocks: tuple[int, ...] | None = None) -> Tensor:
    """``blocks``: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) in place of ``_blocks``'
    choice (the tile benchmark's candidates)."""
    rows, K = x.shape
    E, N = w.shape[0], w.shape[1]
    y = x.new_empty(rows, N)
    if rows == 0 or N == 0:
        return y
    bm, bn, bk, warps, stages = blocks or _blocks(x.dtype, rows, E, x.device)
    grid = (triton_cdiv(rows, bm) + E, triton_cdiv(N, bn))  # the most row tiles any split needs
    with on_device_of(x):  # the engine's forward runs in its step thread
        _gmm_kernel[grid](x, w, y, offs, N, K, E, x.stride(0), x.stride(1), w.stride(0),
                          w.stride(1), w.stride(2), y.stride(0), y.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                          E_P2=triton.next_power_of_2(E), PRECISION=_precision(x.dtype),
                          DOT_FP32=TRITON_INTERPRET, num_warps=warps, num_stages=stages)
    return y


def _gmm_wgrad_triton(dy: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    E, N, K = offs.shape[0], dy.shape[1], x.shape[1]
    dw = dy.new_empty(E, N, K)
    if E == 0 or N == 0 or K == 0:
        return dw
    bm, bn, bk, warps, stages = _blocks(dy.dtype, dy.shape[0], E, dy.device)
    bk = min(bk, bn)  # the wgrad tile is [BLOCK_N, BLOCK_K]
    grid = (E, triton_cdiv(N, bn), triton_cdiv(K, bk))
    with on_device_of(dy):
        _gmm_wgrad_kernel[grid](dy, x, dw, offs, N, K, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
                                dw.stride(0), dw.stride(1), dw.stride(2), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                PRECISION=_precision(dy.dtype), DOT_FP32=TRITON_INTERPRET, num_warps=warps,
                                num_stages=stages)
    return dw


# --- the op ----------------------------------------------------------------------------------
@torch.library.custom_op("moe_rl::grouped_mm", mutates_args=())
def _grouped_mm_op(x: Tensor, w: Tensor, offs: Tensor, impl: str) -> Tensor:
    if impl == "triton":
        return _gmm_triton(x, w, offs)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


@_grouped_mm_op.register_fake
def _(x, w, offs, impl):
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("moe_rl::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(dy: Tensor, x: Tensor, offs: Tensor, impl: str) -> Tensor:
    """[E, N, K]: dW[g] = dy[rows of g].T @ x[rows of g] (zero for an empty group)."""
    if impl == "triton":
        return _gmm_wgrad_triton(dy, x, offs)
    return torch._grouped_mm(dy.transpose(0, 1), x, offs=offs)


@_grouped_mm_wgrad_op.register_fake
def _(dy, x, offs, impl):
    return dy.new_empty(offs.shape[0], dy.shape[1], x.shape[1])


def _setup_context(ctx, inputs, output):
    x, w, offs, impl = inputs
    ctx.save_for_backward(x, w, offs)
    ctx.impl = impl


def _backward(ctx, dy):
    x, w, offs = ctx.saved_tensors
    dy = dy.contiguous()  # e.g. the expanded gradient of a sum: torch._grouped_mm refuses 0 strides
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _grouped_mm_op(dy, w.transpose(1, 2), offs, ctx.impl)
    if ctx.needs_input_grad[1]:
        dw = _grouped_mm_wgrad_op(dy, x, offs, ctx.impl)
    return dx, dw, None, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_gemm(x: Tensor, w: Tensor, offs: Tensor, impl: str | None = None) -> Tensor:
    """x [rows, K] sorted by group, w [E, N, K] (``nn.Linear`` layout per group), offs int32 [E]
    (end row of each group; rows after the last one are in no group and their output rows are
    left unwritten) -> [rows, N], row r of group g being
    ``x[r] @ w[g].T``. Differentiable in x and w.

    ``impl``: "triton" (default for CUDA tensors) or "torch" (``torch._grouped_mm``, default
    elsewhere). "triton" on CPU tensors needs ``TRITON_INTERPRET=1`` set before import; nothing
    falls back silently."""
    if impl is None:
        impl = "triton" if x.is_cuda else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"grouped_gemm: impl must be 'triton' or 'torch', got {impl!r}")
    # meta tensors (shapes only, tests) take the op's fake whatever the impl
    if impl == "triton" and not x.is_meta and (triton is None or not (x.is_cuda or TRITON_INTERPRET)):
        raise RuntimeError("grouped_gemm(impl='triton'): needs triton and a CUDA tensor (or TRITON_INTERPRET=1 "
                           "set before importing moe_rl.kernels.grouped_gemm)")
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise TypeError(f"grouped_gemm: x and w must share a float32/bfloat16/float16 dtype, got {x.dtype}, {w.dtype}")
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1] or offs.shape != (w.shape[0],):
        raise ValueError(f"grouped_gemm: expected x [rows, K], w [E, N, K], offs [E]; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(offs.shape)}")
    if offs.dtype != torch.int32:
        raise TypeError(f"grouped_gemm: offs must be int32, got {offs.dtype}")
    return _grouped_mm_op(x, w, offs, impl)


def grouped_gemm_reference(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """The same as a Python loop of matmuls over the groups (host reads: tests only)."""
    out, start = x.new_zeros(x.shape[0], w.shape[1]), 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[g].T
        start = end
    return out


__all__ = ["grouped_gemm", "grouped_gemm_reference", "tile_plan"]

"""Grouped expert compute: rows sorted by expert, one grouped GEMM per projection.

``dispatch`` turns a flat list of expert ids into the permutation the grouped GEMM needs
(one stable sort, group end offsets by a searchsorted, optional per-group padding), all on
the device with no host sync and nothing that loops over experts in Python.
``grouped_mm`` runs ``torch._grouped_mm`` (CUTLASS) for bf16 on sm_90+, and otherwise, for
float32/bfloat16/float16, ``moe_rl.kernels.grouped_gemm``: a Triton grouped GEMM on a static
tile grid on other GPUs and dtypes, torch's CPU kernel on a CPU, both behind one custom op that
``torch.compile`` traces (eager on a CPU, ``torch._grouped_mm`` is called directly). None of them
reads device values on the host. Float64 (tests) takes a
padded batched matmul, which reads the largest group's size (one host sync). All have autograd
formulas, so the backward is grouped GEMMs too, not one full-size weight gradient per expert.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.kernels.grouped_gemm import DTYPES, grouped_gemm


_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


@dataclass
class Dispatch:
    """Where each (token, slot) row goes.

    ``order`` [M]: flat row index of each expert-sorted row; ``slot`` [M]: padded-buffer row
    of each flat row (its inverse permutation, plus padding); ``offs`` int32 [E]: end row of
    each expert's group in the padded buffer; ``rows``: the padded buffer's length, a static
    bound (M + E * (align - 1)) so that no host sync is needed. With padding the last group
    ends at or before ``rows``: the rows after ``offs[-1]`` belong to no group, the grouped
    GEMMs neither compute nor write them (their output rows there are undefined), and
    :func:`unpermute` never reads them (:func:`in_groups` masks them where a plain op spans
    every row).
    """

    order: torch.Tensor
    slot: torch.Tensor
    offs: torch.Tensor
    rows: int


def group_align(x: torch.Tensor) -> int:
    """Rows per group a multiple of this: CUTLASS's grouped GEMM (``grouped_kernel``: bf16 on
    sm_90/sm_100) wants 16-byte aligned group starts, also along the token dim that the weight
    gradient contracts over. The Triton kernel and the CPU take groups starting anywhere: 1, no
    padding (a padded dispatch costs ~10 more small kernels per MoE layer)."""
    return 16 // x.element_size() if grouped_kernel(x) == "cutlass" else 1


def dispatch(ids: torch.Tensor, num_experts: int, align: int = 1) -> Dispatch:
    """ids [M] (int64, each in [0, num_experts)) -> the sort/padding plan for ``ids``' rows."""
    M = ids.shape[0]
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    bounds = torch.arange(1, num_experts + 1, device=ids.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, bounds)  # end of each expert's run in the sorted rows
    if align == 1:
        slot = torch.empty_like(order).scatter_(0, order, torch.arange(M, device=ids.device))
        return Dispatch(order, slot, ends.to(torch.int32), M)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_counts = (counts + align - 1) // align * align
    padded_ends = padded_counts.cumsum(0)
    rows = M + num_experts * (align - 1)
    # sorted row i of expert e moves from e's sorted start to e's padded start
    shift = (padded_ends - padded_counts) - (ends - counts)
    pos = torch.arange(M, device=ids.device) + shift[sorted_ids]
    slot = torch.empty_like(order).scatter_(0, order, pos)
    # the buffer's tail (up to E * (align - 1) rows after the last group) is in no group: giving
    # it to the last expert would run that many zero rows through its GEMMs on every call
    return Dispatch(order, slot, padded_ends.to(torch.int32), rows)


def in_groups(rows: int, offs: torch.Tensor) -> torch.Tensor:
    """[rows, 1] bool: whether each row of a grouped buffer lies in a group (before ``offs[-1]``);
    a plain op over every row of a grouped GEMM's output masks the undefined tail with it."""
    return (torch.arange(rows, device=offs.device) < offs[-1])[:, None]


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [rows, K] grouped by ``offs`` (int32 group ends; rows after the last one are in no group,
    their output rows undefined), w [E, N, K]
    (nn.Linear layout per group) -> [rows, N], row r of group e being x[r] @ w[e].T."""
    kernel = grouped_kernel(x, w)
    if kernel == "cutlass" or (kernel == "torch" and x.device.type == "cpu" and not torch.compiler.is_compiling()):
        # eager on a CPU: torch's own op and autograd (the custom op's Python dispatch costs ~0.15
        # ms per forward+backward, ~3% of a tiny CPU step); traced, or on a device standing for a
        # GPU (meta, fakedev): the custom op, with the fake that torch's meta kernel lacks for fp32
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if kernel == "padded":
        return padded_grouped_mm(x, w, offs)
    return grouped_gemm(x, w, offs, impl=kernel)


CUTLASS_MAJORS = (9, 10)  # the compute capabilities torch builds its CUTLASS grouped GEMM for


def grouped_kernel(x: torch.Tensor, w: torch.Tensor | None = None) -> str:
    """Which grouped GEMM ``grouped_mm`` runs for ``x``'s device and dtype (and the weight
    ``w`` [E, N, K] it multiplies, when given):

    * "cutlass": ``torch._grouped_mm`` for bf16 on CUDA sm_90 and sm_100 (its meta kernel is
      bf16-only; on other GPUs torch's fallback loops over the groups on the host),
      when ``w``'s N and K are multiples of 16 bytes (:func:`cutlass_aligned`);
    * "triton": the Triton kernel of ``moe_rl.kernels.grouped_gemm`` (CUDA otherwise);
    * "torch": ``torch._grouped_mm`` (float32, bf16, fp16; the CPU kernel, the suite run on
      torch 2.11, the GPU image's, 2.13 and 2.14), called directly when eager on a CPU and
      through that module's custom op when traced by ``torch.compile`` (its fake, which torch's
      own meta kernel lacks for float32) or on a device that stands for a GPU in the tests
      (``fakedev``, meta: one device op, as on CUDA);
    * "padded": ``padded_grouped_mm`` (float64; CPU torch < 2.11): one host sync per call."""
    if x.dtype not in DTYPES or (x.device.type == "cpu" and _TORCH < (2, 11)):
        return "padded"
    if x.device.type != "cuda":
        return "torch"
    if x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(x.device)[0] in CUTLASS_MAJORS:
        return "cutlass" if w is None or cutlass_aligned(w) else "triton"
    return "triton"


def cutlass_aligned(w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes a grouped GEMM with weight ``w`` [E, N, K], forward
    and backward: it wants every operand's leading stride a multiple of 16 bytes, which for
    contiguous operands means N and K are. An expert LoRA of rank r gives N = r (x @ A^T) or
    K = r (h @ B^T): in bf16 a rank that is not a multiple of 8 fails its stride check, so those
    GEMMs run on the Triton kernel (any strides), forward and backward alike."""
    per_16_bytes = 16 // w.element_size()
    return w.shape[1] % per_16_bytes == 0 and w.shape[2] % per_16_bytes == 0


def padded_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The same as one batched matmul over groups padded to the largest one. Reading that size
    is a host sync, the price of this fallback (float64 only: the tests' reference dtype).
    Rows after ``offs[-1]`` (in no group) come out as zeros."""
    E, rows = w.shape[0], x.shape[0]
    ends = offs.long()
    starts = ends - torch.diff(ends, prepend=ends.new_zeros(1))
    cap = int((ends - starts).max()) if rows else 0
    r = torch.arange(rows, device=x.device)
    group = torch.searchsorted(ends, r, right=True).clamp(max=E - 1)
    spare = E * cap  # one row past the padded groups takes the rows in no group
    slot = torch.where(r < ends[-1], group * cap + (r - starts[group]), spare)
    xp = x.new_zeros(spare + 1, x.shape[1]).index_copy(0, slot, x)[:spare].view(E, cap, x.shape[1])
    y = torch.bmm(xp, w.transpose(1, 2)).reshape(spare, w.shape[1])
    return torch.cat([y, y.new_zeros(1, y.shape[1])]).index_select(0, slot)


def permute(x: torch.Tensor, d: Dispatch, k: int = 1) -> torch.Tensor:
    """The padded, expert-grouped rows of a flat list whose row f is x[f // k] -> [d.rows, H]."""
    return permute_rows(x, d.order, d.slot, d.rows, k)


def unpermute(y: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """Grouped rows [d.rows, H] back in the flat order [M, H] (padding dropped)."""
    return unpermute_rows(y, d.order, d.slot)


def permute_rows(x: torch.Tensor, order: torch.Tensor, slot: torch.Tensor, rows: int, k: int = 1) -> torch.Tensor:
    """``permute`` by its parts: flat row f is x[f // k], sorted row i is flat row order[i] and
    lands in row slot[order[i]] of a [rows, H] buffer (slot: order's inverse, plus padding)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Permute.apply(x, order, slot, rows, k)
    return _permute(x, order, slot, rows, k)


def unpermute_rows(y: torch.Tensor, order: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``unpermute`` by its parts: flat row f is y[slot[f]]."""
    if torch.is_grad_enabled() and y.requires_grad:
        return _Unpermute.apply(y, order, slot)
    return y.index_select(0, slot)


def _permute(x, order, slot, rows: int, k: int) -> torch.Tensor:
    src = x.index_select(0, order // k if k > 1 else order)
    if rows == order.shape[0]:
        return src
    return x.new_zeros(rows, x.shape[1]).index_copy(0, slot[order], src)


# Both backwards are gathers (and a sum over each token's k rows), where autograd would give
# index_select's backward as an index_add: atomic adds, bf16 ones on a GPU, which took 10% of
# the large train preset's step on an H100. The forwards are the plain ops, so a forward with
# or without grad (trainer, engine) computes the same bits.
class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, slot, rows: int, k: int):
        ctx.save_for_backward(slot)
        ctx.k = k
        return _permute(x, order, slot, rows, k)

    @staticmethod
    def backward(ctx, g):
        (slot,) = ctx.saved_tensors
        gx = g.index_select(0, slot)  # each flat row's grouped row: [M, H], M = tokens * k
        if ctx.k > 1:
            gx = gx.view(-1, ctx.k, gx.shape[1]).sum(1)  # fp32 accumulation of 16-bit grads
        return gx, None, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, order, slot):
        ctx.save_for_backward(order, slot)
        ctx.rows = y.shape[0]
        return y.index_select(0, slot)

    @staticmethod
    def backward(ctx, g):
        order, slot = ctx.saved_tensors
        if ctx.rows == slot.shape[0]:  # no padding: slot is order's inverse
            return g.index_select(0, order), None, None
        # padding rows (and the tail in no group) get a zero grad; slot's rows are distinct
        return g.new_zeros(ctx.rows, g.shape[1]).index_copy(0, slot, g), None, None

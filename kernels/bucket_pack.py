"""Pack many tensors into one flat buffer (and back) in a single launch.

Weight sync moves thousands of small tensors per bucket; a per-tensor copy loop costs one
kernel launch (or one Python-level op) per tensor. Here a bucket is described by element
offsets into a flat 1-D buffer of the bucket's dtype, and:

- on CUDA one Triton launch copies every tensor: a ``BucketCopy`` plan holds a device table
  of fixed-size chunks (tensor offset, flat offset, length), one program per chunk, built
  once per layout, so a sync after the first costs one launch. Copies are bitwise (moved as
  integers of the widest width the alignment allows, 16 bytes per access where it can), so
  any dtype works, bf16 included.
- on CPU torch does it (``torch.cat(out=)`` when the tensors fill the buffer in order,
  otherwise one ``copy_`` per tensor).

``pack_reference`` / ``unpack_reference`` are the plain-torch definitions the tests compare
against. The Triton path also runs under ``TRITON_INTERPRET=1`` on CPU tensors (tests).
"""
from __future__ import annotations

import collections
import os
from typing import Sequence

import torch

from .launch import on_device_of

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is absent
    HAVE_TRITON = False

__all__ = [
    "pack",
    "unpack",
    "pack_reference",
    "unpack_reference",
    "contiguous_offsets",
    "triton_available",
    "BucketCopy",
]

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def contiguous_offsets(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Element offsets that place ``tensors`` back to back (the flattened-bucket layout)."""
    out, pos = [], 0
    for t in tensors:
        out.append(pos)
        pos += t.numel()
    return out


# --- plain-torch reference ---------------------------------------------------------------
def pack_reference(tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
    for t, o in zip(tensors, offsets):
        out[o : o + t.numel()].copy_(t.reshape(-1))
    return out


def unpack_reference(flat: torch.Tensor, outs: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    for t, o in zip(outs, offsets):
        t.copy_(flat[o : o + t.numel()].view(t.shape))


# --- Triton ----------------------------------------------------------------------------
def triton_available() -> bool:
    return HAVE_TRITON


if HAVE_TRITON:

    @triton.jit
    def _bucket_copy_kernel(flat_ptr, anchor_ptr, t_off_ptr, f_off_ptr, n_ptr, TO_FLAT: tl.constexpr,
                            CHUNK: tl.constexpr, VEC: tl.constexpr):
        # One program copies one chunk of n elements between the flat buffer (element offset
        # f_off) and a tensor (element offset t_off from the anchor, the first tensor: the
        # tensors are separate allocations, so the offset may be negative). Elements are
        # integers of the widest width dividing every address and size, and VEC of them at a
        # time: the hints let Triton issue 16-byte loads and stores.
        pid = tl.program_id(0)
        t_off = tl.multiple_of(tl.load(t_off_ptr + pid), VEC)
        f_off = tl.multiple_of(tl.load(f_off_ptr + pid), VEC)
        n = tl.multiple_of(tl.load(n_ptr + pid), VEC)
        r = tl.arange(0, CHUNK)
        m = r < n
        if TO_FLAT:
            tl.store(flat_ptr + f_off + r, tl.load(anchor_ptr + t_off + r, mask=m), mask=m)
        else:
            tl.store(anchor_ptr + t_off + r, tl.load(flat_ptr + f_off + r, mask=m), mask=m)


CHUNK_BYTES = 16384  # bytes per program


def _check_copyable(tensors, dtype: torch.dtype) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("the Triton bucket copy needs contiguous tensors")
        if t.dtype != dtype:
            raise TypeError(f"tensor of dtype {t.dtype} in a bucket of dtype {dtype}")
_CACHE_SIZE = 64


def _alignment(x: int) -> int:
    """The largest power of two up to 16 dividing x (bytes)."""
    return 16 if x % 16 == 0 else (x & -x)


class BucketCopy:
    """The copy table between ``tensors`` and a flat buffer layout (element ``offsets`` in a
    buffer of ``dtype``), built once on the host and kept on the device: each ``pack`` or
    ``unpack`` is then one kernel launch with O(1) host work, whatever the tensor count.

    The table holds addresses, so the plan is valid while the tensors keep their storage; it
    holds references to them, which keeps that storage alive. ``flat_align`` is the byte
    alignment every flat buffer given later has (at least)."""

    def __init__(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], dtype: torch.dtype,
                 flat_align: int = 16, chunk_bytes: int = CHUNK_BYTES, keep_refs: bool = True):
        if not tensors:
            raise ValueError("a bucket copy of no tensors")
        es = torch.empty((), dtype=dtype).element_size()
        _check_copyable(tensors, dtype)
        self.tensors = list(tensors) if keep_refs else None
        self.numel = max(o + t.numel() for t, o in zip(tensors, offsets))
        self.dtype = dtype
        self.device = tensors[0].device
        addrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
        numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
        offs = torch.as_tensor(list(offsets), dtype=torch.int64)
        # element width and vector: the largest power of two (<= 16 bytes) dividing every
        # address, offset and size; int32 lanes from 4 bytes up, VEC of them per access
        g = min(_alignment(flat_align), _alignment(int(addrs[0])))
        for v in (addrs - addrs[0], offs * es, numels * es):
            nz = v[v != 0]
            if nz.numel():
                g = min(g, _alignment(int(torch.gcd(nz.abs(), torch.tensor(16)).min())))
        self.align = g
        width = 4 if g >= 4 else g
        self.vec = g // width
        self.int_dtype = _INT_OF_WIDTH[width]
        chunk = max(self.vec, chunk_bytes // width)
        self.chunk = 1 << (chunk - 1).bit_length()  # a power of two (tl.arange)
        lens = numels * es // width  # in copy elements (exact: width divides every size)
        nchunks = (lens + self.chunk - 1) // self.chunk
        tid = torch.repeat_interleave(torch.arange(len(tensors)), nchunks)
        first = torch.cumsum(nchunks, 0) - nchunks
        start = (torch.arange(int(nchunks.sum())) - first[tid]) * self.chunk
        self.t_off = (((addrs - addrs[0]) // width)[tid] + start).to(self.device)
        self.f_off = (offs[tid] * es // width + start).to(self.device)
        self.n = torch.clamp(lens[tid] - start, max=self.chunk).to(torch.int32).to(self.device)
        self._anchor = tensors[0] if keep_refs else None

    def _launch(self, flat: torch.Tensor, to_flat: bool, anchor: torch.Tensor | None = None) -> None:
        anchor = self._anchor if anchor is None else anchor
        if flat.dtype != self.dtype or flat.numel() < self.numel or flat.device != self.device:
            raise ValueError(f"flat buffer ({flat.dtype}, {flat.numel()} on {flat.device}) does not fit this plan "
                             f"({self.dtype}, {self.numel} on {self.device})")
        if _alignment(flat.data_ptr()) < self.align:
            raise ValueError(f"flat buffer aligned to {_alignment(flat.data_ptr())} bytes, plan needs {self.align}")
        with on_device_of(flat):  # pack/unpack run in worker threads (the sender's executor, the commit)
            _bucket_copy_kernel[(self.n.numel(),)](
                flat.view(self.int_dtype), anchor.view(-1).view(self.int_dtype), self.t_off, self.f_off, self.n,
                TO_FLAT=to_flat, CHUNK=self.chunk, VEC=self.vec)

    def pack(self, flat: torch.Tensor) -> torch.Tensor:
        self._launch(flat, True)
        return flat

    def unpack(self, flat: torch.Tensor) -> None:
        self._launch(flat, False)


# Plans by exact copy layout (addresses, sizes, offsets): a sync after the first finds its
# bucket's plan here. Entries hold no tensors, so gathered buffers are not kept alive; a
# launch passes the caller's current first tensor as the anchor (its address is in the key).
_plans: "collections.OrderedDict[tuple, BucketCopy]" = collections.OrderedDict()


def _launch(tensors, flat, offsets, to_flat: bool) -> None:
    if not tensors:
        return
    _check_copyable(tensors, flat.dtype)  # also on a cache hit: the plan was checked, these tensors not
    align = _alignment(flat.data_ptr())
    key = (flat.dtype, flat.device, align, tuple(t.data_ptr() for t in tensors),
           tuple(t.numel() for t in tensors), tuple(offsets))
    plan = _plans.get(key)
    if plan is None:
        plan = BucketCopy(tensors, offsets, flat.dtype, flat_align=align, keep_refs=False)
        _plans[key] = plan
        if len(_plans) > _CACHE_SIZE:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    plan._launch(flat, to_flat, anchor=tensors[0])


def _use_triton(flat: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is None:
        return HAVE_TRITON and flat.is_cuda
    if use_triton and not HAVE_TRITON:
        raise RuntimeError("use_triton=True but triton is not installed")
    if use_triton and not flat.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton bucket copy on CPU tensors needs TRITON_INTERPRET=1")
    return use_triton


def _check(tensors, flat, offsets):
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("the bucket buffer must be a contiguous 1-D tensor")
    if len(offsets) != len(tensors):
        raise ValueError(f"{len(tensors)} tensors but {len(offsets)} offsets")
    for t, o in zip(tensors, offsets):
        if o < 0 or o + t.numel() > flat.numel():
            raise ValueError(f"tensor of {t.numel()} elements at offset {o} overruns a bucket of {flat.numel()}")


# --- public API -------------------------------------------------------------------------
def pack(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    offsets: Sequence[int] | None = None,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Copies ``tensors`` into the flat buffer ``out`` at element ``offsets`` (default: back
    to back; ``out`` default: a new buffer of the first tensor's dtype and device)."""
    tensors = [t.detach() for t in tensors]
    if offsets is None:
        offsets = contiguous_offsets(tensors)
    if out is None:
        if not tensors:
            raise ValueError("pack of no tensors needs an output buffer")
        total = max((o + t.numel() for t, o in zip(tensors, offsets)), default=0)
        out = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
    _check(tensors, out, offsets)
    if _use_triton(out, use_triton):
        _launch(tensors, out, offsets, to_flat=True)
        return out
    in_order = all(t.dtype == out.dtype for t in tensors) and list(offsets) == contiguous_offsets(tensors)
    if in_order and sum(t.numel() for t in tensors) == out.numel() and tensors:
        torch.cat([t.reshape(-1) for t in tensors], out=out)
        return out
    return pack_reference(tensors, out, offsets)


def unpack(
    flat: torch.Tensor,
    outs: Sequence[torch.Tensor],
    offsets: Sequence[int] | None = None,
    *,
    use_triton: bool | None = None,
) -> None:
    """Copies slices of ``flat`` (at element ``offsets``, default back to back) into ``outs``."""
    outs = [t.detach() for t in outs]  # parameters are written in place
    if offsets is None:
        offsets = contiguous_offsets(outs)
    _check(outs, flat, offsets)
    if _use_triton(flat, use_triton):
        _launch(outs, flat, offsets, to_flat=False)
        return
    if outs and all(t.dtype == flat.dtype for t in outs):
        views = [flat[o : o + t.numel()].view(t.shape) for t, o in zip(outs, offsets)]
        torch._foreach_copy_(outs, views)
        return
    unpack_reference(flat, outs, offsets)

"""Pack many tensors into one flat buffer (and back) in a single launch.

Weight sync moves thousands of small tensors per bucket; a per-tensor copy loop costs one
kernel launch (or one Python-level op) per tensor. Here a bucket is described by element
offsets into a flat 1-D buffer of the bucket's dtype, and:

- on CUDA one Triton launch copies every tensor: the host builds a table of fixed-size
  chunks (source address, destination offset, length), one program per chunk. Copies are
  bitwise (elements are moved as same-width integers), so any dtype works, bf16 included.
- on CPU torch does it (``torch.cat(out=)`` when the tensors fill the buffer in order,
  otherwise one ``copy_`` per tensor).

``pack_reference`` / ``unpack_reference`` are the plain-torch definitions the tests compare
against. The Triton path also runs under ``TRITON_INTERPRET=1`` on CPU tensors (tests).
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

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
]

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHUNK = 4096  # elements per program


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
    def _gather_scatter_kernel(src_addr_ptr, dst_addr_ptr, n_ptr, anchor_ptr, CHUNK_SIZE: tl.constexpr):
        # One program copies one chunk: n elements from address src to address dst. The
        # element type is the anchor tensor's (an integer type of the right width).
        pid = tl.program_id(0)
        ptr_ty = tl.pointer_type(anchor_ptr.dtype.element_ty)
        src = tl.load(src_addr_ptr + pid).to(ptr_ty)
        dst = tl.load(dst_addr_ptr + pid).to(ptr_ty)
        n = tl.load(n_ptr + pid)
        r = tl.arange(0, CHUNK_SIZE)
        m = r < n
        tl.store(dst + r, tl.load(src + r, mask=m), mask=m)


def _chunk_table(tensors, flat, offsets, chunk, to_flat: bool, device):
    """Per-chunk (src address, dst address, length), built vectorised on the host."""
    es = flat.element_size()
    base = flat.data_ptr()
    addrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    offs = torch.as_tensor(list(offsets), dtype=torch.int64)
    nchunks = (numels + chunk - 1) // chunk
    tid = torch.repeat_interleave(torch.arange(len(tensors)), nchunks)
    first = torch.cumsum(nchunks, 0) - nchunks
    k = torch.arange(int(nchunks.sum())) - first[tid]  # chunk index within its tensor
    start = k * chunk
    length = torch.clamp(numels[tid] - start, max=chunk).to(torch.int32)
    t_addr = addrs[tid] + start * es
    f_addr = base + (offs[tid] + start) * es
    src, dst = (t_addr, f_addr) if to_flat else (f_addr, t_addr)
    return src.to(device), dst.to(device), length.to(device)


def _launch(tensors, flat, offsets, to_flat: bool, chunk: int = CHUNK) -> None:
    if not tensors:
        return
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("the Triton bucket copy needs contiguous tensors")
        if t.dtype != flat.dtype:
            raise TypeError(f"tensor of dtype {t.dtype} in a bucket of dtype {flat.dtype}")
    anchor = flat.view(_INT_OF_WIDTH[flat.element_size()])
    src, dst, n = _chunk_table(tensors, flat, offsets, chunk, to_flat, flat.device)
    _gather_scatter_kernel[(n.numel(),)](src, dst, n, anchor, CHUNK_SIZE=chunk)


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

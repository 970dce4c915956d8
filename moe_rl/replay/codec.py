"""Bit-packing codec for expert ids, and a vectorised numpy reference of the same format.

Format: ``bits = ceil(log2(num_experts))`` bits per id, ids laid out as one little-endian bit
stream (id ``i`` occupies bits ``[i*bits, (i+1)*bits)``, least significant bit first); the last
byte is zero-padded. ``pack``/``unpack`` run in C++ (``moe_rl._C``) with the GIL released;
``pack_numpy``/``unpack_numpy`` produce and read the identical bytes with numpy only. They are
the reference the tests compare against and the baseline the benchmark reports.
"""
from __future__ import annotations

import numpy as np

from moe_rl import _C

__all__ = ["bits_for", "packed_bytes", "pack", "unpack", "pack_numpy", "unpack_numpy"]


def bits_for(num_experts: int) -> int:
    """Bits per packed id: ``ceil(log2(num_experts))``, at least 1."""
    return _C.bits_for(int(num_experts))


def packed_bytes(n: int, num_experts: int) -> int:
    """Bytes taken by ``n`` packed ids."""
    return (int(n) * bits_for(num_experts) + 7) // 8


def pack(ids, num_experts: int) -> np.ndarray:
    """Packs integer ids (any shape, any integer dtype) into a flat ``uint8`` array.

    Raises ValueError if an id is outside ``[0, num_experts)``.
    """
    return _C.pack(np.ascontiguousarray(ids), int(num_experts))


def unpack(buf, n: int, num_experts: int, *, dtype=np.int64, first: int = 0,
           out: np.ndarray | None = None) -> np.ndarray:
    """Decodes ids ``[first, first+n)`` of a packed stream into a flat int32/int64 array (or
    into ``out``: C-contiguous int32/int64 with ``n`` elements)."""
    buf = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    return _C.unpack(np.ascontiguousarray(buf), int(n), int(num_experts),
                     np.dtype(dtype).name, int(first), out)


def _plan(bits: int):
    """For each id j of a group of 8: (word, shift, spill shift or None)."""
    plan = []
    for j in range(8):
        s = j * bits
        w, off = divmod(s, 64)
        spill = 64 - off if off + bits > 64 else None
        plan.append((w, np.uint64(off), None if spill is None else np.uint64(spill)))
    return plan


def pack_numpy(ids, num_experts: int) -> np.ndarray:
    """Vectorised numpy implementation of :func:`pack` (same bytes): each group of 8 ids is
    OR-ed into one (or two, above 8 bits) uint64 words with column-wise shifts, and the words'
    leading ``bits`` bytes are kept."""
    bits = bits_for(num_experts)
    flat = np.asarray(ids).reshape(-1)
    n = flat.size
    if n and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"ids out of range for num_experts={num_experts}")
    groups = -(-n // 8)
    g = np.zeros((groups, 8), dtype=np.uint64)
    g.reshape(-1)[:n] = flat
    nwords = 1 if bits <= 8 else 2
    words = np.zeros((groups, nwords), dtype=np.uint64)
    tmp = np.empty(groups, dtype=np.uint64)
    for j, (w, off, spill) in enumerate(_plan(bits)):
        col = g[:, j]
        np.left_shift(col, off, out=tmp)
        words[:, w] |= tmp
        if spill is not None:
            np.right_shift(col, spill, out=tmp)
            words[:, w + 1] |= tmp
    out = words.view(np.uint8).reshape(groups, 8 * nwords)[:, :bits]
    return np.ascontiguousarray(out).reshape(-1)[: (n * bits + 7) // 8]


def unpack_numpy(buf, n: int, num_experts: int, *, dtype=np.int64,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Vectorised numpy implementation of :func:`unpack` (whole stream, ``first=0``); decodes
    into ``out`` (flat, ``n`` elements, a multiple of 8) when given."""
    bits = bits_for(num_experts)
    buf = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    groups = -(-n // 8)
    nwords = 1 if bits <= 8 else 2
    raw = np.zeros((groups, 8 * nwords), dtype=np.uint8)
    need = (n * bits + 7) // 8
    padded = np.zeros(groups * bits, dtype=np.uint8)
    padded[:need] = buf[:need]
    raw[:, :bits] = padded.reshape(groups, bits)
    words = raw.view(np.uint64)  # [groups, nwords]
    mask = np.uint64((1 << bits) - 1)
    if out is not None and out.size == groups * 8:
        res = out
        out = out.reshape(groups, 8)
    else:
        res = None
        out = np.empty((groups, 8), dtype=dtype)
    tmp = np.empty(groups, dtype=np.uint64)
    for j, (w, off, spill) in enumerate(_plan(bits)):
        np.right_shift(words[:, w], off, out=tmp)
        if spill is not None:
            tmp |= words[:, w + 1] << spill
        tmp &= mask
        out[:, j] = tmp
    return res if res is not None else out.reshape(-1)[:n]

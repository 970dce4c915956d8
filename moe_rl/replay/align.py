"""Aligning routing records to the tokens a trainer rank sees.

A micro-batch is laid out as one flattened token stream: the row-major ``[B, T]`` input of
padded batches, or the packed ``[1, total]`` input described by ``cu_seqlens``. A
:class:`TokenLayout` says where each sample starts in that stream and how many of its tokens
are real; a rank holds some positions of the stream (all of them, a contiguous slice under
sequence parallelism, or any index list, e.g. context-parallel chunks or Megatron's
sequence-major ``[T, B]`` order). :func:`align_replay` returns what Megatron-core's
``RouterReplay.set_replay_data`` and the native model take: one LongTensor
``[local_tokens, top_k]`` per MoE layer, in layer order.

Token ``p`` of a sample takes row ``p`` of its record; a record has one row fewer than the
sample (the last token was never forwarded during generation). That last token and all padding
get *filler* ids, distinct within each row and spread over the experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported when align_replay runs, so the log loads without it
    import torch

__all__ = ["TokenLayout", "padded_layout", "packed_layout", "sequence_parallel_range",
           "sequence_major_positions", "filler_ids", "align_replay"]


@dataclass(frozen=True)
class TokenLayout:
    """Where samples sit in a micro-batch's flattened token stream.

    starts[i]: position of sample i's first token; lengths[i]: its tokens in the input
    (prompt + response); total: length of the stream (padding included).
    """

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    total: int

    def __post_init__(self):
        if len(self.starts) != len(self.lengths):
            raise ValueError("TokenLayout: starts and lengths differ in length")
        order = sorted(range(len(self.starts)), key=lambda i: self.starts[i])
        prev_end = 0
        for i in order:
            s, n = self.starts[i], self.lengths[i]
            if n < 0 or s < prev_end or s + n > self.total:
                raise ValueError(f"TokenLayout: sample {i} at [{s}, {s + n}) overlaps another "
                                 f"sample or runs past total={self.total}")
            prev_end = s + n


def padded_layout(lengths: Sequence[int], seq_len: int | None = None) -> TokenLayout:
    """Right-padded ``[B, T]`` batch (``T = seq_len`` or the longest sample), flattened
    row-major: sample i starts at ``i * T``."""
    lengths = [int(n) for n in lengths]
    T = max(lengths, default=0) if seq_len is None else int(seq_len)
    if any(n > T for n in lengths):
        raise ValueError(f"padded_layout: a sample is longer than seq_len={T}")
    return TokenLayout(tuple(i * T for i in range(len(lengths))), tuple(lengths),
                       T * len(lengths))


def packed_layout(lengths: Sequence[int], *, cu_seqlens: Sequence[int] | None = None,
                  pad_to_multiple: int = 1) -> TokenLayout:
    """Packed ``[1, total]`` batch. Samples back to back, or at ``cu_seqlens[:-1]`` when given
    (e.g. each sequence padded to a multiple of TP x CP x 2, with ``lengths`` the real token
    counts); the stream is padded at the end to a multiple of ``pad_to_multiple``."""
    lengths = [int(n) for n in lengths]
    if cu_seqlens is None:
        cu = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    else:
        cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
        if cu.size != len(lengths) + 1:
            raise ValueError(f"packed_layout: cu_seqlens has {cu.size} entries for "
                             f"{len(lengths)} samples")
        if np.any(np.diff(cu) < np.asarray(lengths, dtype=np.int64)):
            raise ValueError("packed_layout: a sample is longer than its cu_seqlens slot")
    m = int(pad_to_multiple)
    total = -(-int(cu[-1]) // m) * m
    return TokenLayout(tuple(int(s) for s in cu[:-1]), tuple(lengths), total)


def sequence_parallel_range(total: int, rank: int, world: int) -> tuple[int, int]:
    """The contiguous slice ``[lo, hi)`` of a stream of ``total`` tokens held by ``rank`` when it
    is split evenly over ``world`` ranks (sequence parallel scatter); ``total`` must divide."""
    if total % world:
        raise ValueError(f"{total} tokens do not split evenly over {world} ranks; pad the "
                         f"stream to a multiple of {world}")
    n = total // world
    return rank * n, (rank + 1) * n


def sequence_major_positions(batch: int, seq_len: int, seq_range: tuple[int, int] | None = None
                             ) -> np.ndarray:
    """Stream positions in sequence-major order, for models that flatten hidden states as
    ``[T, B]`` (Megatron's ``[s, b, h]`` with b > 1): local token ``r = (t - lo) * B + b`` is
    position ``b * T + t`` of the row-major padded stream; ``seq_range`` is this rank's slice
    of T under sequence parallelism."""
    lo, hi = (0, seq_len) if seq_range is None else seq_range
    t = np.arange(lo, hi, dtype=np.int64)[:, None]
    b = np.arange(batch, dtype=np.int64)[None, :]
    return (b * seq_len + t).reshape(-1)


def filler_ids(rows: int, top_k: int, num_experts: int, *, first_row: int = 0) -> np.ndarray:
    """``[rows, top_k]`` int64 filler: row r is ``(r*top_k + arange(top_k)) % num_experts``,
    distinct within the row (top_k <= num_experts) and cycling through all experts so padding
    load is spread evenly."""
    if top_k > num_experts:
        raise ValueError("top_k must be <= num_experts")
    r = np.arange(first_row, first_row + rows, dtype=np.int64)[:, None]
    return (r * top_k + np.arange(top_k, dtype=np.int64)[None, :]) % num_experts


def _runs(dst: np.ndarray, src: np.ndarray) -> list[tuple[int, int, int]]:
    """Splits paired index arrays into runs where both advance by 1: (dst0, src0, length)."""
    if dst.size == 0:
        return []
    brk = np.flatnonzero((np.diff(dst) != 1) | (np.diff(src) != 1)) + 1
    bounds = np.concatenate([[0], brk, [dst.size]])
    return [(int(dst[a]), int(src[a]), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]


def align_replay(records: Sequence, layout: TokenLayout, *, num_experts: int,
                 token_range: tuple[int, int] | None = None, positions=None, log=None,
                 num_layers: int | None = None, top_k: int | None = None, stacked: bool = False
                 ) -> "list[torch.Tensor] | torch.Tensor":
    """Per-layer replay tensors for this rank's tokens.

    Args:
        records: one per sample of ``layout``: an int array/tensor ``[lengths[i] - 1, layers,
            top_k]``, or (with ``log``) the sample's uid in that :class:`ReplayLog`, decoded
            straight into the output.
        layout: the micro-batch layout (:func:`padded_layout`, :func:`packed_layout`).
        num_experts: for the filler ids.
        token_range: this rank's contiguous slice ``[lo, hi)`` of the stream; or
        positions: the stream positions this rank holds, in its local token order.
            Neither: the whole stream.
        num_layers, top_k: needed only when no sample has a record to take them from.
        stacked: return the one ``[num_moe_layers, local_tokens, top_k]`` tensor the list
            is made of (moved to a device in one copy, then ``unbind(0)`` there).

    Returns ``num_moe_layers`` contiguous LongTensors ``[local_tokens, top_k]``.
    ValueError if a record's row count is not its sample's length - 1 or shapes disagree.
    """
    if len(records) != len(layout.lengths):
        raise ValueError(f"align_replay: {len(records)} records for {len(layout.lengths)} samples")
    if positions is not None and token_range is not None:
        raise ValueError("align_replay: give token_range or positions, not both")
    if positions is not None:
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    else:
        lo, hi = (0, layout.total) if token_range is None else map(int, token_range)
        pos = np.arange(lo, hi, dtype=np.int64)
    if pos.size and (pos.min() < 0 or pos.max() >= layout.total):
        raise ValueError(f"align_replay: positions outside the stream [0, {layout.total})")

    # Resolve each sample's record: rows and (layers, top_k).
    arrays: list[np.ndarray | None] = []
    rows = []
    for i, rec in enumerate(records):
        if log is not None:
            arrays.append(None)
            n, L, K = log.num_tokens(rec), log.num_layers, log.top_k
        else:
            a = rec.detach().cpu().numpy() if hasattr(rec, "detach") else np.asarray(rec)
            if a.ndim != 3 or a.dtype.kind not in "iu":
                raise ValueError(f"align_replay: record {i} must be an integer array "
                                 f"[tokens, layers, top_k], got {a.dtype} {a.shape}")
            arrays.append(a)
            n, L, K = a.shape
        if num_layers is None:
            num_layers, top_k = L, K
        elif (L, K) != (num_layers, top_k):
            raise ValueError(f"align_replay: record {i} has [*, {L}, {K}], expected "
                             f"[*, {num_layers}, {top_k}]")
        expect = max(layout.lengths[i] - 1, 0)
        if n != expect:
            name = f"uid {rec!r}" if log is not None else f"record {i}"
            raise ValueError(f"align_replay: {name} has {n} rows but its sample has "
                             f"{layout.lengths[i]} tokens (expected {expect} rows: all but the "
                             f"last token); were tokens truncated without their routing?")
        rows.append(n)
    if num_layers is None:
        raise ValueError("align_replay: no records; pass num_layers and top_k")

    N = pos.size
    out = np.empty((num_layers, N, top_k), dtype=np.int64)
    out[:] = filler_ids(N, top_k, num_experts)[None]

    # Map each local token to (sample, row) and copy the covered ones, run by run.
    if N and len(records):
        starts = np.asarray(layout.starts, dtype=np.int64)
        order = np.argsort(starts, kind="stable")
        idx = np.searchsorted(starts[order], pos, side="right") - 1
        ok = idx >= 0
        sample = np.where(ok, order[np.maximum(idx, 0)], 0)
        p = pos - starts[sample]
        ok &= p < np.asarray(rows, dtype=np.int64)[sample]
        local = np.flatnonzero(ok)
        for i in np.unique(sample[local]):
            i = int(i)
            sel = local[sample[local] == i]
            src = p[sel]
            runs = _runs(sel, src)
            if arrays[i] is None and len(runs) <= 8:
                for d0, s0, n in runs:
                    log.read_into(records[i], out, d0, s0, s0 + n)
                continue
            a = arrays[i] if arrays[i] is not None else log.get(records[i])
            if len(runs) <= 8:
                for d0, s0, n in runs:
                    out[:, d0:d0 + n, :] = a[s0:s0 + n].transpose(1, 0, 2)
            else:
                out[:, sel, :] = a[src].transpose(1, 0, 2)
    import torch

    routing = torch.from_numpy(out)
    return routing if stacked else list(routing.unbind(0))

"""The routing-replay log: routing records keyed by sample uid, stored compactly on disk.

    log = ReplayLog(path, num_layers=48, top_k=8, num_experts=128)      # the one writer
    log.append(uid, ids, versions=(3,))        # ids [tokens, layers, top_k], numpy or torch
    ids = log.get(uid)                         # np.int64 [tokens, layers, top_k]
    reader = ReplayLog(path, mode="r")         # any number of readers, other processes too

Records are bit-packed (``ceil(log2(num_experts))`` bits per id) and CRC32C-checked; the C++
store (``csrc/store.h``) documents the on-disk format and the crash semantics.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from moe_rl import _C, faults

__all__ = ["ReplayLog", "CorruptRecordError", "FORMAT_VERSION"]

CorruptRecordError = _C.CorruptRecordError
FORMAT_VERSION = 1
_META = "meta.json"


def _as_numpy(ids) -> np.ndarray:
    if hasattr(ids, "detach") and hasattr(ids, "cpu"):  # torch.Tensor, without importing torch
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"ids must be an integer array, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr)


def _versions(versions) -> list[int]:
    if versions is None:
        return []
    if isinstance(versions, (int, np.integer)):
        return [int(versions)]
    return [int(v) for v in versions]


class ReplayLog:
    """Routing records on disk: one writer (``mode="a"``), many readers (``mode="r"``).

    Args:
        path: directory of the log (created by a writer if missing).
        num_layers, top_k, num_experts: the record shape ``[tokens, num_layers, top_k]`` with
            ids in ``[0, num_experts)``. Stored in ``meta.json`` on creation; when reopening
            they may be left out, and if given must match.
        mode: ``"a"`` opens the single writer (an exclusive lock; reopening after a crash drops
            a torn last record), ``"r"`` a reader that sees records appended later after
            :meth:`refresh` (``get``/``in`` refresh by themselves on a miss).
        segment_bytes: a new segment file is started once the current one would exceed this.
        check_duplicates: reject a row that repeats an expert id (router top-k ids are distinct,
            and Megatron's all-to-all dispatcher breaks on duplicates).
    """

    def __init__(self, path: str | os.PathLike, num_layers: int | None = None,
                 top_k: int | None = None, num_experts: int | None = None, *, mode: str = "a",
                 segment_bytes: int = 1 << 30, check_duplicates: bool = True):
        if mode not in ("a", "r"):
            raise ValueError(f"mode must be 'a' (writer) or 'r' (reader), got {mode!r}")
        self.path = Path(path)
        self.mode = mode
        self.check_duplicates = check_duplicates
        given = {"num_layers": num_layers, "top_k": top_k, "num_experts": num_experts}
        meta_path = self.path / _META
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            if meta.get("format") != FORMAT_VERSION:
                raise ValueError(f"{meta_path}: unsupported replay-log format {meta.get('format')!r}")
            for k, v in given.items():
                if v is not None and int(v) != meta[k]:
                    raise ValueError(f"{meta_path}: log has {k}={meta[k]}, opened with {k}={v}")
        else:
            if mode == "r":
                raise FileNotFoundError(f"no replay log at {self.path} ({_META} missing)")
            missing = [k for k, v in given.items() if v is None]
            if missing:
                raise ValueError(f"creating a replay log at {self.path} needs {', '.join(missing)}")
            meta = {"format": FORMAT_VERSION, **{k: int(v) for k, v in given.items()},
                    "bits": _C.bits_for(int(num_experts))}
            self.path.mkdir(parents=True, exist_ok=True)
            tmp = meta_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(meta, indent=1) + "\n")
            os.replace(tmp, meta_path)
        self.num_layers = int(meta["num_layers"])
        self.top_k = int(meta["top_k"])
        self.num_experts = int(meta["num_experts"])
        self._store = _C.Store(str(self.path), self.num_layers, self.top_k, self.num_experts,
                               mode == "a", int(segment_bytes))
        if mode == "a" and faults.armed("routing.append"):  # a test run's crash between record and index
            self._store.set_after_record_hook(lambda: faults.point("routing.append"))

    # -- writing ---------------------------------------------------------------------------

    def append(self, uid: str, ids, versions: int | Sequence[int] | None = ()) -> None:
        """Adds the record of sample ``uid``: ``ids`` [tokens, num_layers, top_k] of integers
        in ``[0, num_experts)`` (numpy or torch, any int dtype), ``versions`` the weight
        versions that produced it (e.g. one per generation segment of a partial rollout).

        ValueError for a wrong shape or dtype, an out-of-range or repeated id (naming the
        position), or a uid that is already in the log.
        """
        arr = _as_numpy(ids)
        if arr.ndim != 3 or arr.shape[1:] != (self.num_layers, self.top_k):
            raise ValueError(f"record for uid {uid!r} has shape {tuple(arr.shape)}, expected "
                             f"[tokens, {self.num_layers}, {self.top_k}]")
        self._store.append(str(uid), arr, _versions(versions), self.check_duplicates)

    def flush(self, fsync: bool = True) -> None:
        """Makes appended records durable (fsync). Records are visible to readers and survive
        a killed process as soon as ``append`` returns; fsync guards against power loss."""
        if fsync:
            self._store.sync()

    # -- reading ---------------------------------------------------------------------------

    def refresh(self) -> int:
        """Picks up records appended by the writer since the last look; returns how many."""
        return self._store.refresh()

    def _known(self, uid: str) -> bool:
        if uid in self._store:
            return True
        return self.mode == "r" and self._store.refresh() > 0 and uid in self._store

    def _require(self, uid: str) -> str:
        uid = str(uid)
        if not self._known(uid):
            raise KeyError(f"uid {uid!r} is not in the replay log at {self.path}")
        return uid

    def get(self, uid: str, *, dtype=np.int64) -> np.ndarray:
        """The record of ``uid``: ids [tokens, num_layers, top_k] as int64 (or int32).

        KeyError if absent; CorruptRecordError (naming uid and segment) if it fails its check.
        """
        uid = self._require(uid)
        return self._store.read(uid, np.dtype(dtype).name)

    def get_tensor(self, uid: str):
        """The record of ``uid`` as a torch LongTensor [tokens, num_layers, top_k]."""
        import torch

        return torch.from_numpy(self.get(uid))

    def read_into(self, uid: str, out: np.ndarray, dst_row: int, start: int, stop: int) -> None:
        """Decodes tokens ``[start, stop)`` of ``uid`` into rows ``dst_row..`` of
        ``out`` [num_layers, rows, top_k] (int64 or int32, C-contiguous). The whole record's
        CRC is verified first."""
        uid = self._require(uid)
        self._store.read_into(uid, out, int(dst_row), int(start), int(stop))

    def num_tokens(self, uid: str) -> int:
        """Tokens (rows) in the record of ``uid``."""
        return int(self._store.num_tokens(self._require(uid)))

    def versions(self, uid: str) -> tuple[int, ...]:
        """The weight versions stored with the record of ``uid``."""
        return tuple(self._store.info(self._require(uid))["versions"])

    def info(self, uid: str) -> dict:
        """Where and what: seq, segment, offset, num_tokens, versions."""
        return self._store.info(self._require(uid))

    def __contains__(self, uid) -> bool:
        return self._known(str(uid))

    def __len__(self) -> int:
        return len(self._store)

    def __iter__(self) -> Iterator[str]:
        return iter(self.uids())

    def uids(self) -> list[str]:
        """All uids, in append order."""
        return self._store.uids()

    def items(self, uids: Iterable[str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
        for uid in (self.uids() if uids is None else uids):
            yield uid, self.get(uid)

    def stats(self) -> dict:
        """Records, tokens, payload bytes (packed bits), record bytes (+16 B header each),
        index bytes, segments, and ``disk_bytes`` (all files of the log)."""
        st = dict(self._store.stats())
        st["disk_bytes"] = sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())
        return st

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        self._store.close()

    @property
    def closed(self) -> bool:
        return self._store.closed

    def __enter__(self) -> "ReplayLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ReplayLog({str(self.path)!r}, num_layers={self.num_layers}, top_k={self.top_k}, "
                f"num_experts={self.num_experts}, mode={self.mode!r}, records={len(self)})")

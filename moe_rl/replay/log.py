"""The routing-replay log: routing records keyed by sample uid, stored compactly on disk.

    log = ReplayLog(path, num_layers=48, top_k=8, num_experts=128)      # the one writer
    log.append(uid, ids, versions=(3,))        # ids [tokens, layers, top_k], numpy or torch
    ids = log.get(uid)                         # np.int64 [tokens, layers, top_k]
    reader = ReplayLog(path, mode="r")         # any number of readers, other processes too

Records are bit-packed (``ceil(log2(num_experts))`` bits per id) and CRC32C-checked; the C++
store (``csrc/store.h``) documents the on-disk format and the crash semantics.

Generations and retention. The log is a directory of *generations*, each one C++ store in a
folder of its own: ``gen-NNNNNN/`` (records are appended to the newest; the trainer starts a new
one every step with :meth:`roll`) and ``pin-SSSSSSSS/`` (copies of the records a resume from the
checkpoint of step S needs). :meth:`drop_unused` deletes every older generation that holds no
record still in use, after copying the records the latest checkpoint's buffer needs into its pin
generation (:meth:`set_pinned`); so the disk and the indexes in memory hold a few steps' worth
however long the run (docs/run_safety.md says how many). A generation is deleted by renaming its
folder (``trash-...``, atomic: a reader never sees half of one) and then removing it; readers
drop the generations that disappeared on :meth:`refresh`. A log of format 1 (one store at the top
of the directory) is read as the oldest generation.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Collection, Iterable, Iterator, Sequence

import numpy as np

from moe_rl import _C, faults

__all__ = ["ReplayLog", "CorruptRecordError", "FORMAT_VERSION"]

CorruptRecordError = _C.CorruptRecordError
FORMAT_VERSION = 2  # 1: one store at the top of the directory; 2: generations (readable: 1 and 2)
_META = "meta.json"
_LEGACY = "."  # a format-1 log's one store, at the top of the directory
_GEN, _PIN, _TRASH = "gen-", "pin-", "trash-"


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


def _order(name: str) -> tuple:
    """Oldest first: the format-1 store, pin generations (copies of older records), generations."""
    if name == _LEGACY:
        return (0, 0)
    return (1, int(name[len(_PIN):])) if name.startswith(_PIN) else (2, int(name[len(_GEN):]))


def _is_generation(name: str) -> bool:
    prefix = _PIN if name.startswith(_PIN) else _GEN if name.startswith(_GEN) else None
    return prefix is not None and name[len(prefix):].isdigit()


class ReplayLog:
    """Routing records on disk: one writer (``mode="a"``), many readers (``mode="r"``).

    Args:
        path: directory of the log (created by a writer if missing).
        num_layers, top_k, num_experts: the record shape ``[tokens, num_layers, top_k]`` with
            ids in ``[0, num_experts)``. Stored in ``meta.json`` on creation; when reopening
            they may be left out, and if given must match.
        mode: ``"a"`` opens the single writer (an exclusive lock; it appends to the newest
            generation, and reopening after a crash drops its torn last record), ``"r"`` a reader
            that sees records appended later after :meth:`refresh` (``get``/``in`` refresh by
            themselves on a miss).
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
        self.segment_bytes = int(segment_bytes)
        given = {"num_layers": num_layers, "top_k": top_k, "num_experts": num_experts}
        meta_path = self.path / _META
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            if meta.get("format") not in (1, FORMAT_VERSION):
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
            _write_json(meta_path, meta)
        self.num_layers = int(meta["num_layers"])
        self.top_k = int(meta["top_k"])
        self.num_experts = int(meta["num_experts"])
        self._lock = threading.RLock()  # the generations: the rollout thread appends, the trainer rolls
        self._gens: dict[str, _C.Store] = {}
        self._current: str | None = None  # the generation appends go to (writer)
        self._pinned: frozenset[str] = frozenset()
        self._pin: str | None = None  # the pin generation of the latest checkpoint
        self._unsynced: set[str] = set()  # generations written since the last flush
        self._lock_fd: int | None = None
        if mode == "a":
            self._take_writer_lock()
            if meta.get("format") != FORMAT_VERSION:
                _write_json(meta_path, {**meta, "format": FORMAT_VERSION})
            for p in self.path.glob(_TRASH + "*"):  # left by a crash while deleting a generation
                shutil.rmtree(p, ignore_errors=True)
        self._scan()
        if mode == "a":
            newest = max((n for n in self._gens if n.startswith(_GEN)), key=_order, default=None)
            if newest is None:
                self._open_writer(f"{_GEN}{0:06d}")
            else:  # reopened after a crash: the torn tail of its last append is dropped
                self._gens.pop(newest).close()
                self._open_writer(newest)

    # -- generations -----------------------------------------------------------------------

    def _take_writer_lock(self) -> None:
        fd = os.open(self.path / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise RuntimeError(f"replay log {self.path} already has a writer (LOCK is held); open it read-only") from None
            raise
        self._lock_fd = fd

    def _dir(self, name: str) -> Path:
        return self.path if name == _LEGACY else self.path / name

    def _names_on_disk(self) -> list[str]:
        names = [p.name for p in self.path.iterdir() if p.is_dir() and _is_generation(p.name)]
        if (self.path / "index.bin").exists():
            names.append(_LEGACY)
        return sorted(names, key=_order)

    def _scan(self) -> int:
        """Opens the generations that appeared, closes those that disappeared; refreshes the
        others. Returns the records that became visible."""
        with self._lock:
            on_disk = set(self._names_on_disk())
            added = 0
            for name in [n for n in self._gens if n not in on_disk and n != self._current]:
                self._gens.pop(name).close()
            for name in sorted(on_disk, key=_order):
                store = self._gens.get(name)
                if store is not None:
                    added += store.refresh()
                    continue
                index = self._dir(name) / "index.bin"
                if not index.exists():  # being created right now
                    continue
                try:
                    store = _C.Store(str(self._dir(name)), self.num_layers, self.top_k, self.num_experts, False,
                                     self.segment_bytes)
                except CorruptRecordError:
                    raise
                except (OSError, RuntimeError):
                    if index.exists():
                        raise
                    continue  # deleted by the writer right now
                self._gens[name] = store
                added += len(store)
            self._gens = dict(sorted(self._gens.items(), key=lambda kv: _order(kv[0])))
            return added

    def _open_writer(self, name: str) -> _C.Store:
        d = self._dir(name)
        d.mkdir(exist_ok=True)
        store = _C.Store(str(d), self.num_layers, self.top_k, self.num_experts, True, self.segment_bytes)
        if faults.armed("routing.append") and name.startswith(_GEN):  # a test run's crash between record and index
            store.set_after_record_hook(lambda: faults.point("routing.append"))
        self._gens[name] = store
        self._gens = dict(sorted(self._gens.items(), key=lambda kv: _order(kv[0])))
        if name.startswith(_GEN):
            self._current = name
        return store

    def _writable(self) -> None:
        if self.mode != "a":
            raise RuntimeError(f"replay log {self.path} is open read-only")

    def generations(self) -> list[str]:
        """The generations, oldest first (``"."``: a format-1 log's store)."""
        with self._lock:
            return list(self._gens)

    def roll(self) -> str:
        """Writer: later appends go to a new generation (the trainer calls it every step).
        Returns its name."""
        self._writable()
        with self._lock:
            n = _order(self._current)[1] + 1
            self._open_writer(f"{_GEN}{n:06d}")
            return self._current

    def set_pinned(self, step: int, uids: Iterable[str]) -> None:
        """Writer: the latest durable checkpoint is the one of ``step``, and a resume from it
        needs the records of ``uids`` (the samples in its buffer). :meth:`drop_unused` keeps
        them, in the pin generation of ``step`` when their own generation goes."""
        self._writable()
        with self._lock:
            self._pinned = frozenset(uids)
            self._pin = f"{_PIN}{int(step):08d}"

    def drop_unused(self, live: Collection[str]) -> int:
        """Writer: deletes every generation (but the newest and the pin generation of the latest
        checkpoint) that holds no uid in ``live`` (the samples still in the buffer or in flight),
        copying the pinned records among them into the pin generation first. Returns the
        records deleted (copies not counted)."""
        self._writable()
        live = live if isinstance(live, (set, frozenset)) else set(live)
        dropped = 0
        with self._lock:
            for name in [n for n in self._gens if n not in (self._current, self._pin)]:
                store = self._gens[name]
                uids = store.uids()
                if not live.isdisjoint(uids):
                    continue
                keep = [u for u in uids if u in self._pinned]
                if keep:
                    pin = self._gens.get(self._pin)
                    if pin is None or not pin.writable:  # made before a crash: appended to again
                        if pin is not None:
                            self._gens.pop(self._pin).close()
                        pin = self._open_writer(self._pin)
                    for u in keep:
                        if u not in pin:
                            pin.append(u, store.read(u, "int64"), list(store.info(u)["versions"]), False)
                    pin.sync()  # the copies are durable before their originals go
                dropped += len(uids) - len(keep)
                self._delete(name)
        return dropped

    def _delete(self, name: str) -> None:
        self._gens.pop(name).close()
        self._unsynced.discard(name)
        if name == _LEGACY:  # the index first: without it the segments are no generation
            (self.path / "index.bin").unlink(missing_ok=True)
            for p in self.path.glob("segment-*.bin"):
                p.unlink(missing_ok=True)
            return
        trash = self.path / f"{_TRASH}{name}"
        os.replace(self.path / name, trash)
        shutil.rmtree(trash, ignore_errors=True)

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
        self._writable()
        uid = str(uid)
        with self._lock:
            if any(uid in s for n, s in self._gens.items() if n != self._current):
                raise ValueError(f"uid '{uid}' is already in the log")
            self._gens[self._current].append(uid, arr, _versions(versions), self.check_duplicates)
            self._unsynced.add(self._current)

    def flush(self, fsync: bool = True) -> None:
        """Makes appended records durable (fsync). Records are visible to readers and survive
        a killed process as soon as ``append`` returns; fsync guards against power loss."""
        if not fsync:
            return
        with self._lock:
            for name in list(self._unsynced):
                if name in self._gens:
                    self._gens[name].sync()
            self._unsynced.clear()

    # -- reading ---------------------------------------------------------------------------

    def refresh(self) -> int:
        """Picks up records appended by the writer since the last look, and generations it
        started or deleted; returns how many records became visible."""
        return 0 if self.mode == "a" else self._scan()

    def _store_of(self, uid: str):
        with self._lock:
            for store in reversed(self._gens.values()):  # newest first: where a live record is
                if uid in store:
                    return store
        return None

    def _require(self, uid: str):
        uid = str(uid)
        store = self._store_of(uid)
        if store is None and self.mode == "r" and self._scan() > 0:
            store = self._store_of(uid)
        if store is None:
            raise KeyError(f"uid {uid!r} is not in the replay log at {self.path}")
        return uid, store

    def get(self, uid: str, *, dtype=np.int64) -> np.ndarray:
        """The record of ``uid``: ids [tokens, num_layers, top_k] as int64 (or int32).

        KeyError if absent; CorruptRecordError (naming uid and segment) if it fails its check.
        """
        uid, store = self._require(uid)
        return store.read(uid, np.dtype(dtype).name)

    def get_tensor(self, uid: str):
        """The record of ``uid`` as a torch LongTensor [tokens, num_layers, top_k]."""
        import torch

        return torch.from_numpy(self.get(uid))

    def read_into(self, uid: str, out: np.ndarray, dst_row: int, start: int, stop: int) -> None:
        """Decodes tokens ``[start, stop)`` of ``uid`` into rows ``dst_row..`` of
        ``out`` [num_layers, rows, top_k] (int64 or int32, C-contiguous). The whole record's
        CRC is verified first."""
        uid, store = self._require(uid)
        store.read_into(uid, out, int(dst_row), int(start), int(stop))

    def num_tokens(self, uid: str) -> int:
        """Tokens (rows) in the record of ``uid``."""
        uid, store = self._require(uid)
        return int(store.num_tokens(uid))

    def versions(self, uid: str) -> tuple[int, ...]:
        """The weight versions stored with the record of ``uid``."""
        return tuple(self.info(uid)["versions"])

    def info(self, uid: str) -> dict:
        """Where and what: generation, seq, segment, offset, num_tokens, versions."""
        uid, store = self._require(uid)
        with self._lock:
            name = next(n for n, s in self._gens.items() if s is store)
        return {"generation": name, **store.info(uid)}

    def __contains__(self, uid) -> bool:
        uid = str(uid)
        return self._store_of(uid) is not None or (self.mode == "r" and self._scan() > 0
                                                   and self._store_of(uid) is not None)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._gens.values())

    def __iter__(self) -> Iterator[str]:
        return iter(self.uids())

    def uids(self) -> list[str]:
        """All uids, oldest generation first, in append order within one."""
        with self._lock:
            return [u for s in self._gens.values() for u in s.uids()]

    def items(self, uids: Iterable[str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
        for uid in (self.uids() if uids is None else uids):
            yield uid, self.get(uid)

    def stats(self) -> dict:
        """Records, tokens, payload bytes (packed bits), record bytes (+16 B header each),
        index bytes, segments, generations, and ``disk_bytes`` (all files of the log)."""
        with self._lock:
            per = [s.stats() for s in self._gens.values()]
            st = {k: sum(p[k] for p in per) for k in ("records", "tokens", "payload_bytes", "record_bytes",
                                                       "index_bytes", "segments")}
            st["generations"] = len(self._gens)
        st["disk_bytes"] = sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())
        return st

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            for store in self._gens.values():
                store.close()
            self._closed = True
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None

    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", False)

    def __enter__(self) -> "ReplayLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ReplayLog({str(self.path)!r}, num_layers={self.num_layers}, top_k={self.top_k}, "
                f"num_experts={self.num_experts}, mode={self.mode!r}, records={len(self)})")


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)

"""The run directory: one run writes into it at a time, and a new start never silently reuses it.

``claim_output_dir(cfg)`` is called by the run's owner (the ``moe-rl train`` launcher, or
global rank 0 of a world started by ``torchrun -m moe_rl.launch``) before any file of the run
is touched:

1. it takes ``<output_dir>/run.lock`` (``fcntl.flock``, exclusive, non-blocking) for the run's
   whole life and writes its pid, host and start time into it; a second run fails here, naming
   them. The OS drops the lock when the holder dies, however it dies.
2. it waits a few seconds for the processes of an earlier run to be gone: every process of a
   run holds ``<output_dir>/writers.lock`` shared (``hold_as_writer``) for its life, so an
   exclusive try on it fails while any of them lives (e.g. the workers of a launcher that was
   just SIGKILLed, in the moment before their parent-death signal takes them).
3. it refuses a fresh start into a directory that holds a run unless ``resume=true`` (continue
   from its latest checkpoint) or ``overwrite_output_dir=true`` (the run's files, ``RUN_FILES``,
   are deleted; other files in the directory are left alone).

The locks are advisory: they need a file system with ``flock`` (local disks, NFSv4, Lustre
mounted with ``-o flock``). docs/run_safety.md states the guarantees.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

LOCK = "run.lock"
WRITERS = "writers.lock"
# what a run writes into output_dir (moe_rl/train): overwrite_output_dir deletes exactly these
RUN_FILES = ("metrics.jsonl", "checkpoints", "routing", "tensorboard", "reward_curve.png", "lora_sync", "trackers.json",
             "wandb")
# env var the `moe-rl train` launcher sets for its workers: it holds the claim (and is their parent)
LAUNCHER_ENV = "MOE_RL_LAUNCHER_PID"


class RunDirError(RuntimeError):
    """The run may not start in this directory; the message says why and what to do."""


class RunLock:
    """``<dir>/run.lock`` held exclusively by this process until ``release`` or its death."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.path = self.dir / LOCK
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # never truncates on open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise RunDirError(f"output_dir {self.dir} is in use by another run: {describe_holder(self.path)} holds "
                              f"{self.path}. One run writes into a directory at a time (two would corrupt each "
                              f"other's checkpoints and routing log): wait for it to finish, stop it, or choose "
                              f"another output_dir.") from None
        self.fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}) + "\n").encode())

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None


def describe_holder(lock_path: Path) -> str:
    """``pid P on host H (since T)`` from a lock file's contents."""
    try:
        info = json.loads(lock_path.read_text())
        return f"pid {info['pid']} on host {info['host']} (since {info['started']})"
    except (OSError, ValueError, KeyError):
        return "a run that is starting (pid and host not yet written)"


def hold_as_writer(directory: str | os.PathLike) -> int:
    """A shared flock on ``<dir>/writers.lock`` for the rest of this process's life (the
    returned descriptor is never closed): the next run's ``claim_output_dir`` waits for it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / WRITERS, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)  # blocks only while an owner checks (claim_output_dir, 2.)
    return fd


def wait_for_writers(directory: Path, timeout_s: float = 10.0) -> None:
    """Returns once no process holds ``<dir>/writers.lock``; RunDirError after ``timeout_s``."""
    path = directory / WRITERS
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return  # closing fd below releases it again for this run's own processes
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
            if time.monotonic() > deadline:
                pids = lock_holder_pids(path)
                who = f"pids {', '.join(map(str, pids))}" if pids else "processes on another host"
                raise RunDirError(f"output_dir {directory}: processes of an earlier run are still alive ({who} hold "
                                  f"{path}) {timeout_s:.0f} s after its launcher let go of {LOCK}; stop them and "
                                  f"start again")
            time.sleep(0.2)
    finally:
        os.close(fd)


def lock_holder_pids(path: Path) -> list[int]:
    """Pids holding a flock on ``path``, from /proc/locks (this host only; [] elsewhere)."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in lines:
        f = line.split()
        # "1: FLOCK  ADVISORY  READ 1234 08:01:5678 0 EOF" (blocked waiters have "->" after the id)
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == dev:
            pids.append(int(f[4]))
    return sorted(set(pids))


def run_files(cfg) -> list[Path]:
    """The files of a run already in ``cfg.output_dir`` (and in ``cfg.replay.dir`` when that lies
    elsewhere: everything there but the lock)."""
    out = Path(cfg.output_dir)
    found = [out / name for name in RUN_FILES if (out / name).exists()]
    replay = Path(cfg.replay.dir) if cfg.replay.dir else None
    if replay is not None and replay.is_dir() and not _inside(replay, out):  # all but its lock is the log's
        found += sorted(p for p in replay.iterdir() if p.name != LOCK)
    return found


def latest_step(output_dir: str | os.PathLike) -> str | None:
    """The name of the checkpoint ``checkpoints/latest`` points to (moe_rl/train/checkpoint.py's
    layout), or None."""
    pointer = Path(output_dir) / "checkpoints" / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """The HF model directory ``path`` names: itself (it has config.json), a checkpoint step
    directory (its ``hf/``), a run directory or its ``checkpoints/`` (the latest checkpoint's
    ``hf/``). FileNotFoundError, one line naming what was looked for, otherwise."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such directory")
    if (p / "config.json").is_file():
        return p
    if (p / "hf" / "config.json").is_file():
        return p / "hf"
    run = p.parent if p.name == "checkpoints" else p
    name = latest_step(run)
    if name is not None:
        hf = run / "checkpoints" / name / "hf"
        if (hf / "config.json").is_file():
            return hf
        raise FileNotFoundError(f"{run / 'checkpoints' / 'latest'} names {name}, which holds no model ({hf}/config.json "
                                "is missing)")
    raise FileNotFoundError(f"{p} holds no model: no config.json (an HF model directory), no hf/config.json (a "
                            "checkpoint step directory) and no checkpoints/latest (a run directory)")


def claim_output_dir(cfg) -> list[RunLock]:
    """Steps 1-3 of the module docstring: ``lock_output_dir`` then ``prepare_output_dir``."""
    locks = lock_output_dir(cfg)
    try:
        prepare_output_dir(cfg)
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def lock_output_dir(cfg) -> list[RunLock]:
    """Step 1: the locks to hold for the run's life, one on output_dir and one on replay.dir
    when that lies elsewhere. RunDirError names the holder."""
    out = Path(cfg.output_dir)
    locks = [RunLock(out)]
    if cfg.replay.dir and not _inside(Path(cfg.replay.dir), out):
        try:
            locks.append(RunLock(cfg.replay.dir))
        except BaseException:
            locks[0].release()
            raise
    return locks


def prepare_output_dir(cfg) -> None:
    """Steps 2-3, under the lock: no process of an earlier run left, and a fresh start only into
    a directory without a run (or with overwrite_output_dir=true, which deletes it)."""
    out = Path(cfg.output_dir)
    wait_for_writers(out)
    found = run_files(cfg)
    if cfg.resume:
        if latest_step(out) is None:
            what = "holds a run without a checkpoint" if found else "holds no run"
            raise RunDirError(f"resume=true, but output_dir {out} {what} ({out}/checkpoints/latest is missing); "
                              f"overwrite_output_dir=true starts over")
    elif found:
        if not cfg.overwrite_output_dir:
            ckpt = latest_step(out)
            raise RunDirError(f"output_dir {out} already holds a run ({', '.join(p.name for p in found)}"
                              f"{'; latest checkpoint ' + ckpt if ckpt else ', no checkpoint'}): resume=true "
                              f"continues it from its latest checkpoint; overwrite_output_dir=true deletes it and "
                              f"starts over")
        for p in found:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _inside(path: Path, parent: Path) -> bool:
    return path.resolve().is_relative_to(parent.resolve())

"""Fault injection: named points in the code where a test run is made to crash.

The run-safety suite (tests/train/test_faults.py) arms one point per run through the config's
``fault`` section (``fault.point=sync.bucket fault.at=3``); real runs leave it off, and then a
point costs one global read. When a process reaches the armed point the ``at``-th time, the
action happens right there:

  kill_tree  SIGKILL the launcher and every process under it at once, as a scheduler or the OOM
             killer does
  kill       SIGKILL this process only (e.g. one engine rank)
  stop       SIGSTOP this process: it freezes (alive, holding its sockets, answering nothing),
             as a hung process or one stopped by a debugger does
  enospc     raise OSError(ENOSPC), a write that found the disk full

Points (``POINTS``), each where the crash hurts most:

  engine.generate   an engine rank receives a /generate request: rollouts are in flight
  sync.bucket       trainer rank 0 has posted a bucket's broadcast and the engines are taking it
  engine.update     an engine rank receives a bucket of a weight update (/update_weights_from_distributed)
  checkpoint.write  a checkpoint file is written, before it is renamed into place
  routing.append    the routing log has written a record but not yet its index entry
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

from .rundir import LAUNCHER_ENV

POINTS = ("engine.generate", "sync.bucket", "engine.update", "checkpoint.write", "routing.append")

_armed: tuple[str, int, str] | None = None  # (point, at, action) for this process
_hits = 0


def arm(fault, rank: int) -> None:
    """Arms ``fault`` (the config's FaultConfig) in this process, a rank of the world."""
    global _armed, _hits
    _armed, _hits = None, 0
    if fault.point is None or (fault.rank is not None and fault.rank != rank):
        return
    if fault.point not in POINTS:
        raise ValueError(f"fault.point={fault.point!r}: not one of {', '.join(POINTS)}")
    if fault.action == "kill_tree":
        _tree_root()  # fails now, not at the point, when there is no launcher to kill
    _armed = (fault.point, fault.at, fault.action)


def armed(name: str) -> bool:
    return _armed is not None and _armed[0] == name


def point(name: str) -> None:
    """The fault point ``name``: nothing unless it is armed and reached the ``at``-th time."""
    global _hits
    if _armed is None or _armed[0] != name:
        return
    _hits += 1
    if _hits != _armed[1]:
        return
    action = _armed[2]
    print(f"[fault injection] {action} at {name} (time {_hits}) in pid {os.getpid()} at unix time {time.time():.3f}",
          file=sys.stderr, flush=True)
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected at {name})")
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return  # continued (SIGCONT): the process goes on where it froze
    if action == "kill_tree":
        for pid in _tree(_tree_root()):  # the launcher first: it must not react to its workers' deaths
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    os.kill(os.getpid(), signal.SIGKILL)


def _tree_root() -> int:
    """The launcher of this world: ``moe-rl train`` (its pid in the environment) or torchrun's
    agent, this process's parent."""
    ppid = os.getppid()
    if os.environ.get(LAUNCHER_ENV) == str(ppid) or "TORCHELASTIC_RUN_ID" in os.environ:
        return ppid
    raise ValueError("fault.action=kill_tree needs a world started by `moe-rl train` or torchrun")


def _tree(root: int) -> list[int]:
    """``root`` and every process under it, parents first (from /proc)."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
        children.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += children.get(pid, [])
    return out

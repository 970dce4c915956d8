"""Heartbeats of the world's ranks, the watch for frozen peers, and the end of the run.

A rank that is stopped (SIGSTOP, a debugger) or hung is not dead: torchrun sees nothing wrong,
and its peers wait on it in a collective until the group timeout, or forever outside one. So
every rank of a ``moe-rl`` world writes a heartbeat into the world's TCPStore (torchrun's
rendezvous store, over a connection of its own) from a thread of its own, every ``interval``
seconds: ``moe_rl/alive/<rank>`` = ``"<beat> <host> <pid> <note>"`` (the note says where it is,
e.g. ``step 17``). A stopped or hung process stops beating.

Who watches whom (each rank reads one key per interval, so the load on the store grows with the
world, not with its square):

* trainer rank r watches trainer rank (r + 1) mod T: a frozen trainer (one EP rank, or the rank
  0 that drives the run) is found by exactly one peer;
* every engine host watches trainer rank 0, the rank its engine serves.

A watcher that sees no new beat from its peer for ``dist.peer_timeout_s`` ends the run: it logs an
error naming the rank, its host and pid and its last note, records it for the launcher
(torch elastic's error file), SIGKILLs the frozen process when it runs on the same host (a
stopped process would otherwise keep torchrun's teardown waiting 30 s for a SIGTERM it cannot
take), and exits with ``EXIT_FROZEN_PEER``. Engines are not watched this way while the run goes
on: a frozen engine is one that gives no answer within ``engine.request_timeout_s``, and the
rollout manager routes around it (moe_rl/rollout/manager.py).

The end of the run is not a collective (a collective has a timeout, and a run may last weeks):
every trainer rank adds 1 to ``moe_rl/trainers_done`` when it is done; engine hosts poll that
counter. Trainer rank 0 then waits (``dist.peer_timeout_s`` at most) for every engine host to
mark its heartbeat ``exited``; one that is frozen instead is named and, on this host, killed,
so the launcher never waits on it.
"""
from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import threading
import time

log = logging.getLogger(__name__)

EXIT_FROZEN_PEER = 3
_PREFIX = "moe_rl/"
_DONE = _PREFIX + "trainers_done"
_EXITED = "exited"


class FrozenPeerError(RuntimeError):
    """A rank of the world stopped beating: it is stopped or hung."""


def _key(rank: int) -> str:
    return f"{_PREFIX}alive/{rank}"


class Beat:
    """One heartbeat as read from the store."""

    def __init__(self, raw: str):
        beat, self.host, pid, self.note = (raw.split(" ", 3) + ["", "", ""])[:4]
        self.beat, self.pid = beat, int(pid) if pid.isdigit() else None
        self.exited = beat == _EXITED


class Liveness:
    """This rank's heartbeat thread and its watch (module docstring)."""

    def __init__(self, store, rank: int, layout, peer_timeout_s: float, interval_s: float | None = None):
        self.store, self.rank, self.layout = store, rank, layout
        self.peer_timeout_s = float(peer_timeout_s)
        self.interval_s = interval_s or min(1.0, self.peer_timeout_s / 10)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.note = "starting"
        self._beat = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.watched = self._watched_rank()

    @classmethod
    def from_env(cls, rank: int, layout, peer_timeout_s: float) -> "Liveness":
        """Connects to torchrun's store (MASTER_ADDR:MASTER_PORT) over a connection of its own:
        the process group's connection may block in a rendezvous, which must not stop the beats."""
        import torch.distributed as dist

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=max(30.0, peer_timeout_s)))
        return cls(store, rank, layout, peer_timeout_s)

    def _watched_rank(self) -> int | None:
        t = self.layout.trainer_ranks
        if self.rank in t:
            return t[(t.index(self.rank) + 1) % len(t)] if len(t) > 1 else None
        return t[0] if t else None

    # --- the thread ---------------------------------------------------------------------------
    def start(self) -> "Liveness":
        self._write()
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)
        self._thread.start()
        return self

    def _write(self) -> None:
        self._beat += 1
        self.store.set(_key(self.rank), f"{self._beat} {self.host} {self.pid} {self.note}")

    def _run(self) -> None:
        last_raw, changed, store_ok = None, time.monotonic(), time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self._write()
                raw = self._read(self.watched) if self.watched is not None else None
                store_ok = now
            except Exception as e:  # the store is torchrun's agent: gone only with the whole run
                if now - store_ok > self.peer_timeout_s:
                    self._fatal(f"rank {self.rank}: the world's store at {os.environ.get('MASTER_ADDR')}:"
                                f"{os.environ.get('MASTER_PORT')} has not answered for {now - store_ok:.0f} s ({e})")
                continue
            if raw is None or raw != last_raw:
                last_raw, changed = raw, now
                continue
            beat = Beat(raw)
            if beat.exited:
                continue
            if now - changed > self.peer_timeout_s:
                self._fatal(self.frozen_message(self.watched, beat, now - changed), beat)

    def _read(self, rank: int) -> str | None:
        key = _key(rank)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def frozen_message(self, rank: int, beat: Beat, silent_s: float) -> str:
        role = "trainer" if rank in self.layout.trainer_ranks else "engine host"
        ep = next((g for g in self.layout.ep_groups if rank in g), None) if role == "trainer" else None
        where = f", EP group of ranks {ep}" if ep and len(ep) > 1 else ""
        return (f"{role} rank {rank} (pid {beat.pid} on host {beat.host}{where}) has sent no heartbeat for "
                f"{silent_s:.1f} s (dist.peer_timeout_s={self.peer_timeout_s:g}); its last one said: {beat.note}. "
                f"It is frozen (stopped or hung), so rank {self.rank} ends the run; resume=true continues from "
                f"the latest checkpoint")

    def _fatal(self, message: str, beat: Beat | None = None) -> None:
        log.error("%s", message)
        record_failure(f"{FrozenPeerError.__name__}: {message}")
        if beat is not None:
            kill_if_local(beat)
        os._exit(EXIT_FROZEN_PEER)  # the log line is out: handlers flush on each record

    # --- what the roles call ------------------------------------------------------------------
    def set_note(self, note: str) -> None:
        """Where this rank is (``step 17``): its watcher names it if this rank freezes."""
        self.note = note

    def close(self) -> None:
        """This rank leaves normally: its watcher stops watching it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.store.set(_key(self.rank), f"{_EXITED} {self.host} {self.pid} {self.note}")
        except Exception as e:
            log.debug("liveness: could not mark rank %d exited: %s", self.rank, e)

    def trainer_done(self) -> None:
        """A trainer rank is done with the run (however it ended)."""
        self.store.add(_DONE, 1)

    def wait_for_trainers(self, poll_s: float = 0.2) -> None:
        """An engine host: returns once every trainer rank is done. No deadline: the run lasts as
        long as it lasts; a frozen trainer rank 0 is caught by this rank's watch. It polls for
        the whole run, every engine host of the world: a short poll would load the store."""
        n = len(self.layout.trainer_ranks)
        self.set_note("serving")
        while self.store.add(_DONE, 0) < n:
            time.sleep(poll_s)

    def release_engines(self, completed: bool = True) -> list[int]:
        """Trainer rank 0 at the end of the run (``completed``: every step done): waits
        (``peer_timeout_s`` at most) until every engine host has exited; one that stops beating
        for ``stale_s`` meanwhile is frozen: it is named, and killed when it is on this host.
        Returns the frozen ranks."""
        stale_s = max(3 * self.interval_s, 2.0)
        pending = {r: (None, time.monotonic()) for r in self.layout.rollout_ranks}
        frozen = []
        deadline = time.monotonic() + self.peer_timeout_s
        while pending and time.monotonic() < deadline:
            for r, (last, since) in list(pending.items()):
                raw = self._read(r)
                beat = Beat(raw) if raw is not None else None
                now = time.monotonic()
                if beat is not None and beat.exited:
                    del pending[r]
                elif raw != last:
                    pending[r] = (raw, now)
                elif now - since > stale_s and beat is not None:
                    log.error("engine host rank %d (pid %s on host %s) is frozen at the end of the run (no heartbeat "
                              "for %.1f s; its last one said: %s): %s%s", r, beat.pid, beat.host, now - since,
                              beat.note, "killing it" if beat.host == self.host else "stop it by hand",
                              "; the run's results are complete" if completed else "")
                    kill_if_local(beat)
                    frozen.append(r)
                    del pending[r]
            time.sleep(min(0.05, self.interval_s))  # at the end of the run only: a short poll is cheap
        if pending:
            log.warning("engine host ranks %s did not exit within %.0f s of the end of the run (dist.peer_timeout_s)",
                        sorted(pending), self.peer_timeout_s)
        return frozen


def describe(e: BaseException) -> str:
    """An exception in one line, with its notes (the trainer's says at which step the run stopped)."""
    return "; ".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", [])])


_recorded = threading.Lock()  # taken by the first failure this process records, never released


def record_failure(message: str) -> None:
    """Writes why this rank fails where torchrun's agent reads it (torch elastic's error file,
    ``TORCHELASTIC_ERROR_FILE``): the ``moe-rl train`` launcher prints it (moe_rl/cli.py).

    The first failure of the process is the one recorded: the watch thread that ends the run
    (``Liveness._fatal``) kills a frozen peer, and the main thread may then fail on that peer's
    death while the watch thread exits the process. The file appears whole (written aside,
    then renamed): the agent parses it, and a half-written one made its parse raise."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or not _recorded.acquire(blocking=False):
        return
    import json
    import traceback

    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}}}, f)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("could not record the failure in %s: %s", path, e)


def kill_if_local(beat: Beat) -> None:
    """SIGKILLs the process of ``beat`` if it runs on this host (a stopped process takes no SIGTERM)."""
    if beat.pid is None or beat.host != socket.gethostname() or beat.pid == os.getpid():
        return
    try:
        os.kill(beat.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

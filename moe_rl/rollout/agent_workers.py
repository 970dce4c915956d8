"""Agent worker processes (``env.agent_workers``): each runs an :class:`AgentPlayer` on its own
event loop, so that the agents' client work (the openai SDK's request and response models, its
HTTP stack, the agent's own code) is not done in the trainer's process, where it would take the
GIL from the rollout manager and the trainer.

The processes are spawned (never forked: the trainer holds threads and process groups) with the
trainer's ``sys.path``; a GroupJob goes to the worker with the fewest groups in flight and its
results come back, both pickled over a pipe. A thread per worker reads its pipe and hands each
result to the manager's loop. A worker that cannot build its player, or dies, fails the run
with its error or exit code (its agent is broken, not one episode).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import pickle
import threading
import traceback

from ..gc_control import freeze_gc
from .agent import AgentPlayer, EpisodeResult, GroupJob, PlayerSettings

log = logging.getLogger(__name__)


class AgentWorkers:
    def __init__(self, count: int, settings: PlayerSettings):
        ctx = multiprocessing.get_context("spawn")
        self.workers = [_Worker(ctx, settings, i) for i in range(count)]

    async def play_group(self, job: GroupJob) -> list[EpisodeResult]:
        return await min(self.workers, key=lambda w: len(w.pending)).play_group(job)

    async def close(self) -> None:
        for w in self.workers:
            w.close()


class _Worker:
    def __init__(self, ctx, settings: PlayerSettings, i: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, settings), name=f"agent-worker-{i}", daemon=True)
        self.proc.start()
        child.close()
        self.pending: dict[int, asyncio.Future] = {}
        self.keys = itertools.count()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: str | None = None
        self.reader: threading.Thread | None = None

    async def play_group(self, job: GroupJob) -> list[EpisodeResult]:
        if self.loop is None:  # the manager's loop: results are handed to it
            self.loop = asyncio.get_running_loop()
            self.reader = threading.Thread(target=self._read, name=f"{self.proc.name}-reader", daemon=True)
            self.reader.start()
        if self.error is not None:
            raise RuntimeError(self.error)
        key = next(self.keys)
        fut = self.pending[key] = self.loop.create_future()
        try:
            try:
                self.conn.send(("group", key, job))
            except (pickle.PicklingError, TypeError, AttributeError) as e:  # e.g. a Prompt.meta holding a lock
                raise RuntimeError(f"prompt {job.prompt.index} cannot be sent to an agent worker process: "
                                   f"{type(e).__name__}: {e} (env.agent_workers=0 plays the agents in the "
                                   "trainer's process, without pickling)") from e
            return await fut
        finally:
            self.pending.pop(key, None)

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            self._hand(self._deliver, msg)
        self.proc.join(5)
        self._hand(self._fail, f"agent worker {self.proc.name} (pid {self.proc.pid}) exited with code "
                               f"{self.proc.exitcode}")

    def _hand(self, fn, arg) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the manager's loop is closed: the run is over, nobody waits
            pass

    def _deliver(self, msg) -> None:
        kind, key, payload = msg
        if kind == "fatal":
            self._fail(payload)
            return
        fut = self.pending.get(key)
        if fut is not None and not fut.done():
            fut.set_result(payload)

    def _fail(self, why: str) -> None:
        self.error = self.error or why
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(RuntimeError(self.error))

    def close(self) -> None:
        self.error = self.error or "the agent workers were closed"
        try:
            self.conn.send(("stop", None, None))
        except (OSError, ValueError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        self.conn.close()


def _main(conn, settings: PlayerSettings) -> None:
    """A worker process: plays the groups it receives until told to stop (or the pipe closes)."""
    try:
        player = AgentPlayer(settings)
    except Exception as e:
        conn.send(("fatal", None, f"agent worker: {e}"))
        return
    # the openai SDK's ~90,000 objects stay out of every later collection: -10 ms of the worker's
    # CPU per step of the example (88 -> 78 ms, 2 cores; see moe_rl.gc_control)
    freeze_gc()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    stop = asyncio.Event()
    tasks: set[asyncio.Task] = set()

    async def play(key: int, job: GroupJob) -> None:
        try:
            out = ("done", key, await player.play_group(job))
        except Exception:  # a bug of the player, not of an episode: the run stops with it
            out = ("fatal", key, f"agent worker: {traceback.format_exc()}")
        conn.send(out)  # only this loop's thread sends

    def start(msg) -> None:
        kind, key, job = msg
        if kind == "stop":
            stop.set()
            return
        t = loop.create_task(play(key, job))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    def read() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = ("stop", None, None)
            loop.call_soon_threadsafe(start, msg)
            if msg[0] == "stop":
                return

    async def run() -> None:
        threading.Thread(target=read, name="agent-worker-reader", daemon=True).start()
        await stop.wait()
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await player.close()

    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
        conn.close()

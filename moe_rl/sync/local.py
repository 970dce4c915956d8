"""A receiver in another process, driven over a multiprocessing pipe instead of HTTP.

For tests and ``moe-rl bench sync``: the same ``WeightReceiver`` calls an engine's handlers
would make, with SGLang's request fields, minus the web server. ``LocalEngine`` is the trainer
side (an ``EngineAPI``); ``serve_receiver`` runs in the receiving process.
"""
from __future__ import annotations

import asyncio
import threading
import traceback
from typing import Callable

from moe_rl.gc_control import freeze_gc, paused_gc

from .engines import EngineCallError


class LocalEngine:
    def __init__(self, conn, name: str = "local-engine", num_ranks: int = 1, timeout_s: float = 300.0):
        self.conn, self.name, self.num_ranks, self.timeout_s = conn, name, num_ranks, timeout_s
        self._lock = threading.Lock()

    def call(self, cmd: str, **kw):
        with self._lock:
            try:
                self.conn.send((cmd, kw))
                if not self.conn.poll(self.timeout_s):
                    raise EngineCallError(f"{self.name} {cmd}: no reply within {self.timeout_s:.0f} s")
                reply = self.conn.recv()
            except (EOFError, OSError, BrokenPipeError) as e:
                raise EngineCallError(f"{self.name} {cmd}: the engine process is gone ({type(e).__name__})") from e
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineCallError(f"{self.name} {cmd}: {reply.get('message')}")
        return reply

    async def _acall(self, cmd: str, **kw):
        return await asyncio.get_running_loop().run_in_executor(None, lambda: self.call(cmd, **kw))

    async def init_weights_update_group(self, **body):
        return await self._acall("init_weights_update_group", **body)

    async def update_weights_from_distributed(self, **body):
        return await self._acall("update_weights_from_distributed", **body)

    async def pause_generation(self, mode: str = "abort"):
        return await self._acall("pause_generation", mode=mode)

    async def continue_generation(self):
        return await self._acall("continue_generation")

    async def destroy_weights_update_group(self, group_name: str):
        return await self._acall("destroy_weights_update_group", group_name=group_name)

    async def server_info(self):
        # the receiver checks bucket checksums (sync.verify), as ``moe-rl serve`` does
        return {"tp_size": self.num_ranks, "moe_rl_checksum": True}


def serve_receiver(conns, receiver, extra: dict[str, Callable] | None = None) -> None:
    """Answers LocalEngine calls on one pipe or several (one at a time) until ``stop`` or every
    pipe is closed. A complete update is committed at once (the engine would commit paused,
    under its lock)."""
    from multiprocessing.connection import wait

    extra = extra or {}
    freeze_gc()  # the receiver's model is built: an engine process does the same (see gc_control)
    live = list(conns) if isinstance(conns, (list, tuple)) else [conns]
    while live:
        for conn in wait(live):
            with paused_gc():  # a bucket's request: thousands of small lists, freed in the block
                try:
                    cmd, kw = conn.recv()
                except (EOFError, OSError):
                    live.remove(conn)
                    continue
                if cmd == "stop":
                    conn.send({"success": True})
                    return
                reply = _handle(receiver, extra, cmd, kw)
                del kw
            try:
                conn.send(reply)
            except (EOFError, OSError, BrokenPipeError):
                live.remove(conn)


def _handle(receiver, extra, cmd, kw) -> dict:
    try:
        if cmd == "init_weights_update_group":
            receiver.init_group(**kw)
            return {"success": True, "message": "ok"}
        if cmd == "update_weights_from_distributed":
            done = receiver.receive_bucket(
                kw["names"], kw["dtypes"], kw["shapes"], kw.get("group_name", "weight_update_group"),
                kw.get("load_format"), kw.get("weight_version"), kw.get("checksum"))
            if done:
                receiver.commit()
            return {"success": True, "message": "committed" if done else "staged"}
        if cmd == "destroy_weights_update_group":
            if kw["group_name"] not in receiver.groups:
                return {"success": False, "message": "The group to be destroyed does not exist."}
            receiver.destroy_group(kw["group_name"])
            return {"success": True, "message": "ok"}
        if cmd in ("pause_generation", "continue_generation"):
            return {"success": True, "message": "ok"}
        if cmd in extra:
            return {"success": True, "result": extra[cmd](**kw)}
        return {"success": False, "message": f"unknown command {cmd}"}
    except Exception as e:
        return {"success": False, "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}

"""LoRA serving for the embedded engine: adapter-only weight updates and SGLang's LoRA
endpoints (``/load_lora_adapter``, ``/unload_lora_adapter``, ``lora_path`` on ``/generate``).

The engine serves one adapter in its forward, unmerged (``moe_rl.model.lora.AdapterServing``:
y = x@W + s*(x@A)@B, experts through two more grouped GEMMs of rank r), so a weight update
writes only the adapter tensors and never touches the base weights. The server calls three
hooks: ``attach`` when the engine is built, ``commit`` around a weight update's commit, and
``register_routes`` when its application is made.
"""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from moe_rl.model.lora import AdapterServing, read_peft

from .protocol import RequestError, json_body

log = logging.getLogger(__name__)


def attach(engine, cfg) -> None:
    """lora.enabled with lora.sync=adapter: the engine's model carries the adapters and weight
    updates carry only the adapter tensors."""
    engine.adapter = None
    engine.adapter_name = None
    if cfg.lora.enabled and cfg.lora.sync == "adapter":
        lc = cfg.lora
        engine.adapter = AdapterServing(engine.model, lc.rank, lc.alpha, lc.targets, lc.layers,
                                        lc.experts_shared_outer)
        engine.adapter_name = "default"
        engine.retired_adapters = set()  # names a later load replaced (one adapter is served at a time)
        log.info("engine serves LoRA rank %d on %s (adapter-only weight updates)", lc.rank, lc.targets)


def receiver_params(engine):
    """The tensors a weight update writes: the adapter tensors when the engine serves one."""
    adapter = getattr(engine, "adapter", None)
    return None if adapter is None else adapter.named_tensors()


def commit(engine, receiver_commit):
    """The commit to run under the engine's model lock. The adapter is read by the forward
    itself, so writing the staged adapter tensors (the receiver's commit) is the whole update."""
    return receiver_commit


def register_routes(server, app: web.Application) -> None:
    r = app.router
    r.add_post("/load_lora_adapter", lambda req: _load(server, req))
    r.add_post("/unload_lora_adapter", lambda req: _unload(server, req))


def _body(request: web.Request) -> dict:
    body = json_body(request)  # parsed by the server's limits middleware
    if not isinstance(body, dict):
        raise RequestError("body", "expected a JSON object")
    return body


def _fail(msg: str, status: int = 400) -> web.Response:
    return web.json_response({"success": False, "error_message": msg}, status=status)


async def _load(server, request: web.Request) -> web.Response:
    """SGLang's LoadLoRAAdapterReqInput: {lora_name, lora_path, pinned?}; a PEFT directory."""
    engine = server.engine
    body = _body(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path:
        return _fail("lora_name and lora_path are required")
    if not isinstance(name, str) or not isinstance(path, str):
        return _fail("lora_name and lora_path must be strings")
    adapter = getattr(engine, "adapter", None)
    if adapter is None:
        return _fail("this engine was started without LoRA (lora.enabled=true, lora.sync=adapter)")
    try:
        read_peft(path)  # fail before pausing on a missing or malformed directory

        def load():
            with engine.model_lock:
                adapter.load_peft(path)
        await asyncio.to_thread(load)
    except Exception as e:  # noqa: BLE001 - reported to the client
        return _fail(f"{type(e).__name__}: {e}")
    if engine.adapter_name not in (None, name):
        engine.retired_adapters.add(engine.adapter_name)
    engine.adapter_name = name
    engine.retired_adapters.discard(name)
    return web.json_response({"success": True, "error_message": "", "loaded_adapters": {name: path}})


async def _unload(server, request: web.Request) -> web.Response:
    engine = server.engine
    name = _body(request).get("lora_name")
    if getattr(engine, "adapter", None) is not None and name in engine.retired_adapters:
        # replaced by a later load (the trainer's versioned swap: load new, then unload old):
        # nothing serves it any more, so there is nothing to undo
        engine.retired_adapters.discard(name)
        return web.json_response({"success": True, "error_message": "", "loaded_adapters": {engine.adapter_name: ""}})
    if getattr(engine, "adapter", None) is None or name != engine.adapter_name:
        return _fail(f"no LoRA adapter named {name!r} is loaded")

    def unload():
        with engine.model_lock:
            engine.adapter.unload()
    await asyncio.to_thread(unload)
    engine.adapter_name = None
    return web.json_response({"success": True, "error_message": "", "loaded_adapters": {}})

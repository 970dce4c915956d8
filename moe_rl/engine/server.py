"""``moe-rl serve``: the embedded engine behind SGLang's native HTTP API (aiohttp).

  moe-rl serve CONFIG [--host 127.0.0.1] [--port N] [--api-key K] [key=value ...]

``--port 0`` picks a free port. Once listening it prints one line
``moe-rl engine listening on http://HOST:PORT`` (stdout, flushed), which tests and launchers
parse. Endpoints and fields are SGLang's (see ``protocol``); errors are
``{"error": {"message": ...}}`` with 400 (malformed request, naming the field) or 401 (bad or
missing ``Authorization: Bearer K`` when an api key is set; every endpoint needs it); the
limits on size, time and queue (413, 408, 503) are ``limits``'.
Weight-sync endpoints answer ``{"success": bool, "message": str}`` like SGLang. The
OpenAI-compatible ``/v1`` endpoints and the per-episode recording: ``moe_rl.engine.openai_api``.
``CONFIG`` may also be a model, checkpoint step or run directory (``rundir.resolve_model_dir``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from moe_rl import faults
from moe_rl.gc_control import freeze_gc, paused_gc
from moe_rl.model.arch import FAMILIES
from moe_rl.model.ops import model_ops

from . import lora, openai_api
from . import protocol as P
from .engine import Engine
from .limits import ServerLimits
from .limits import error_response as _error
from .protocol import RequestError, json_body
from .text import TextCodec, load_tokenizer, model_eos_ids

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}  # SGLang's LoadSnapshot.VALID_SECTIONS


# --- building an engine from the config ------------------------------------------------------
def build_model(cfg):
    """The native model of ``cfg.model`` (HF directory, or the seeded random init) in
    ``cfg.engine.dtype``."""
    from ..model import MoEForCausalLM, load_hf

    if cfg.model.path:
        model = load_hf(cfg.model.path)
    else:
        model = MoEForCausalLM(cfg.model.arch()).init_weights(cfg.model.init_seed, std=cfg.model.init_std)
    return model.to(_DTYPES[cfg.engine.dtype])


def build_engine(cfg, model=None, device: str | torch.device | None = None, *,
                 cuda_graph: bool | None = None, static_decode: bool | None = None,
                 compile: bool | None = None) -> Engine:
    """``device``: where the model and KV cache live (default: where ``model`` is, CPU for a
    new one). On a GPU the KV cache holds as many requests as placement.mem_fraction_static
    of its memory leaves after the weights (at most engine.max_running_requests).
    ``cuda_graph`` / ``static_decode`` / ``compile``: override engine.cuda_graph /
    engine.static_decode / engine.compile (``moe-rl bench engine`` measures each setting)."""
    e = cfg.engine
    model = model if model is not None else build_model(cfg)
    model.use_ops(model_ops(cfg))  # true_on_policy: the exact kernels (moe_rl.model.ops)
    if device is not None:
        model = model.to(device)
    max_running = e.max_running_requests
    p = next(model.parameters())
    if p.device.type == "cuda":
        from ..placement import kv_cache_slots

        max_running = kv_cache_slots(
            model.arch, max_context=min(e.max_context, model.arch.max_position_embeddings),
            max_running_requests=e.max_running_requests, element_size=p.element_size(),
            weight_bytes=sum(t.numel() * t.element_size() for t in model.parameters()),
            gpu_bytes=torch.cuda.get_device_properties(p.device).total_memory,
            mem_fraction=cfg.placement.mem_fraction_static)
        log.info("embedded engine on %s: KV cache for %d requests (placement.mem_fraction_static=%s)",
                 p.device, max_running, cfg.placement.mem_fraction_static)
    engine = Engine(
        model,
        max_running_requests=max_running,
        max_context=e.max_context,
        weight_version=e.weight_version,
        threads=e.threads,
        model_path=cfg.model.path,
        static_decode=e.static_decode if static_decode is None else static_decode,
        cuda_graph=e.cuda_graph if cuda_graph is None else cuda_graph,
        cuda_graph_max_bs=e.cuda_graph_max_bs,
        max_waiting_requests=e.max_waiting_requests,
        compile=e.compile if compile is None else compile,
    )
    lora.attach(engine, cfg)  # LoRA serving: moe_rl.engine.lora
    engine.tokenizer_path = cfg.model.tokenizer_path  # the server's tokenizer when set (else model.path's)
    return engine


# --- the HTTP application --------------------------------------------------------------------
async def _json(request: web.Request, *, optional: bool = False) -> Any:
    return json_body(request, optional=optional)  # parsed by the limits middleware


class EngineServer:
    """Handlers of one engine. ``app()`` returns the aiohttp application."""

    def __init__(self, engine: Engine, api_key: str | None = None, limits: ServerLimits | None = None):
        self.engine = engine
        self.api_key = api_key
        self.limits = limits if limits is not None else ServerLimits.for_engine(engine)
        self.receiver = None  # moe_rl.sync.receiver.WeightReceiver, made on the first init
        self._update_lock = asyncio.Lock()
        self.session_open = False  # between /begin_weight_update and /end_weight_update
        tokenizer_path = getattr(engine, "tokenizer_path", None) or engine.model_path  # model.tokenizer_path first
        self.eos_token_ids = model_eos_ids(engine.model_path) | model_eos_ids(tokenizer_path)
        tokenizer = load_tokenizer(tokenizer_path)
        # None: answers as SGLang with --skip-tokenizer-init (no "text"; a text prompt is a 400)
        self.text = TextCodec(tokenizer) if tokenizer is not None else None
        if self.text is not None:
            engine.decode = self.text.decode  # stop strings

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware, self.limits.middleware()], **self.limits.app_kwargs())
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_route("*", "/start_profile", self.start_profile)
        r.add_route("*", "/stop_profile", self.stop_profile)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_get("/weight_version", self.get_weight_version)
        r.add_get("/get_server_info", self.get_server_info)
        r.add_get("/server_info", self.get_server_info)
        r.add_get("/v1/loads", self.loads)
        for ep in ("/update_weights_from_tensor", "/release_memory_occupation", "/resume_memory_occupation"):
            r.add_route("*", ep, self.not_supported)
        r.add_get("/get_model_info", self.get_model_info)
        r.add_get("/model_info", self.get_model_info)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        lora.register_routes(self, app)
        openai_api.register_routes(self, app)  # /v1/chat/completions, /v1/completions, /v1/models, /episodes
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _on_shutdown(self, app) -> None:
        self.engine.abort(abort_all=True, message="server shutting down")

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return _error(401, "missing or wrong api key (send 'Authorization: Bearer <key>')")
        try:
            return await handler(request)
        except RequestError as e:
            return _error(400, str(e))

    # --- generation ------------------------------------------------------------------------
    def _tokenize(self, body: Any) -> Any:
        """A ``text`` prompt (one string, or a list: the batch form) -> ``input_ids``, when the
        engine has a tokenizer and the body has no input_ids (SGLang uses input_ids first)."""
        if self.text is None or not isinstance(body, dict) or body.get("input_ids") is not None:
            return body
        text = body.get("text")
        if isinstance(text, str):
            return {**body, "input_ids": self.text.encode(text)}
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return {**body, "input_ids": [self.text.encode(t) for t in text]}
        if text is not None:
            raise RequestError("text", "expected a string or a list of strings")
        return body

    def _finish(self, out: dict, req: P.GenerateRequest) -> dict:
        return self.text.add_text(out, req) if self.text is not None else out

    async def generate(self, request: web.Request) -> web.StreamResponse:
        faults.point("engine.generate")  # a test run's crash with rollouts in flight
        body = self._tokenize(await _json(request))
        limits = dict(vocab_size=self.engine.arch.vocab_size, max_context=self.engine.max_context,
                      eos_token_ids=self.eos_token_ids, adapter=getattr(self.engine, "adapter_name", None),
                      token_count=self.text.token_count if self.text is not None else None)
        if P.is_batch(body):  # SGLang's batch form: a list in, a list out
            reqs = P.parse_batch(body, **limits)
            if not self.engine.alive:
                return _error(503, f"engine is not running: {self.engine.error}")
            tasks = [asyncio.ensure_future(self.engine.generate(r)) for r in reqs]
            try:
                outs = await asyncio.gather(*tasks)
            except BaseException:  # e.g. one refused (queue full): the others are aborted, not left running
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            return web.json_response([self._finish(o, r) for o, r in zip(outs, reqs)])
        req = P.GenerateRequest.parse(body, **limits)
        if not self.engine.alive:
            return _error(503, f"engine is not running: {self.engine.error}")
        if req.stream:
            return await self._generate_stream(request, req)
        out = await self.engine.generate(req)
        reason = out["meta_info"]["finish_reason"]
        if reason["type"] == "abort" and (reason.get("status_code") or 0) >= 400:
            return _error(reason["status_code"], reason["message"])
        return web.json_response(self._finish(out, req))

    async def _generate_stream(self, request: web.Request, req: P.GenerateRequest) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def push(item, final=False):
            loop.call_soon_threadsafe(queue.put_nowait, (item, final))

        rid = self.engine.submit(req, lambda res: push(res, True), on_update=push)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await resp.prepare(request)
            while True:
                item, final = await queue.get()
                await resp.write(b"data: " + json.dumps(self._finish(item, req)).encode() + b"\n\n")
                if final:
                    break
            await resp.write(b"data: [DONE]\n\n")
        except BaseException:  # the client went away (from the first byte on): free its KV slot
            self.engine.abort(rid, "client disconnected")
            raise
        return resp

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _json(request, optional=True)
        mode = body.get("mode", "abort") if isinstance(body, dict) else None
        if mode not in P.PAUSE_MODES:
            raise RequestError("mode", f"must be one of {', '.join(P.PAUSE_MODES)}, got {mode!r}")
        await asyncio.to_thread(self.engine.pause, mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await _json(request, optional=True)
        self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json(request, optional=True)
        if not isinstance(body, dict):
            raise RequestError("body", "expected a JSON object")
        rid = P._str(body, "rid", "", numbers=True)
        abort_all = P._bool(body, "abort_all")
        if not rid and not abort_all:
            raise RequestError("rid", "give a rid or abort_all: true")
        n = self.engine.abort(rid, abort_all=abort_all)
        return web.json_response({"success": True, "aborted": n})

    async def flush_cache(self, request: web.Request) -> web.Response:
        # No prefix cache to flush: KV slots are freed when a request finishes.
        return web.Response(text="Cache flushed.\n")

    # --- profiling (SGLang's endpoints; moe_rl.engine.step_profiler) -------------------------
    async def start_profile(self, request: web.Request) -> web.Response:
        body = await _json(request, optional=True) or {}
        if not isinstance(body, dict):
            raise RequestError("body", "expected a JSON object")
        num_steps, activities = body.get("num_steps"), body.get("activities") or ["CPU", "GPU"]
        if num_steps is not None and (not isinstance(num_steps, int) or isinstance(num_steps, bool)):
            raise RequestError("num_steps", f"expected an integer, got {num_steps!r}")
        if not isinstance(activities, list):
            raise RequestError("activities", f"expected a list, got {activities!r}")
        try:
            await asyncio.to_thread(self.engine.start_profile, body.get("output_dir"), num_steps, activities)
        except ValueError as e:
            raise RequestError("start_profile", str(e)) from None
        except (RuntimeError, TimeoutError) as e:
            return _error(500, str(e))
        return web.Response(text="Start profiling.\n")

    async def stop_profile(self, request: web.Request) -> web.Response:
        try:
            files = await asyncio.to_thread(self.engine.stop_profile)
        except ValueError as e:
            raise RequestError("stop_profile", str(e)) from None
        except (RuntimeError, TimeoutError) as e:
            return _error(500, str(e))
        return web.Response(text="Stop profiling. This will take some time.\n" + "".join(f"{f}\n" for f in files))

    # --- weights ---------------------------------------------------------------------------
    def _weight_receiver(self):
        if self.receiver is None:
            from ..model import bind_hf_views, iter_local_hf_tensors
            from ..sync.receiver import WeightReceiver

            model = self.engine.model
            adapter_params = lora.receiver_params(self.engine)
            if adapter_params is not None:  # LoRA serving: updates carry the adapter tensors only
                self.receiver = WeightReceiver(adapter_params)
            else:
                # a zero-copy commit moves the weights to the received buckets; captured decode
                # graphs read them where they were, so with graphs the update copies in place
                rebind = None if self.engine.cuda_graph else (lambda staged: bind_hf_views(model, staged))
                self.receiver = WeightReceiver(dict(iter_local_hf_tensors(model)), rebind=rebind)
        return self.receiver

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        req = P.InitGroupRequest.parse(await _json(request))
        if req.backend == "nccl" and not torch.cuda.is_available():
            return web.json_response({"success": False, "message": "backend: nccl needs CUDA; use backend gloo on CPU"}, status=400)
        try:
            receiver = self._weight_receiver()
            await asyncio.to_thread(
                receiver.init_group, req.master_address, req.master_port, req.rank_offset,
                req.world_size, req.group_name, req.backend,
            )
        except Exception as e:
            log.exception("init_weights_update_group failed")
            return web.json_response({"success": False, "message": f"Failed to init group: {type(e).__name__}: {e}"}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await _json(request, optional=True)
        if self.session_open:
            return web.json_response({"success": False, "message": "a weight-update session is already open; "
                                      "call end_weight_update() first"}, status=400)
        self.session_open = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        """Closes the session. An update left incomplete (some tensors never sent) is dropped
        and reported: the engine never answers success to weights it did not apply."""
        await _json(request, optional=True)
        if not self.session_open:
            return web.json_response({"success": False, "message": "no weight-update session is open; "
                                      "call begin_weight_update() first"}, status=400)
        self.session_open = False
        async with self._update_lock:
            rx = self.receiver
            if rx is not None and rx._received_buckets:
                missing = len(rx.params) - len(rx._staged)
                version = rx.pending_version
                rx.abort()
                msg = (f"weight update {version} was incomplete: {missing} of {len(rx.params)} tensors never arrived; "
                       f"discarded, the engine keeps serving weight_version {self.engine.weight_version}")
                self.engine.last_update_error = msg
                return web.json_response({"success": False, "message": msg}, status=400)
        return web.json_response({"success": True, "message": "Success"})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json(request, optional=True)
        name = P._str(body if isinstance(body, dict) else {}, "group_name", "weight_update_group")
        if self.receiver is None or name not in self.receiver.groups:
            return web.json_response({"success": False, "message": "The group to be destroyed does not exist."}, status=400)
        await asyncio.to_thread(self.receiver.destroy_group, name)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if not isinstance(body, dict) or body.get("new_version") is None:
            raise RequestError("new_version", "required")
        new = P._str(body, "new_version", numbers=True)
        if P._bool(body, "abort_all_requests", True):
            self.engine.abort(abort_all=True, message="Aborted for a weight version update")
        self.engine.weight_version = new
        return web.json_response({"success": True, "message": f"Weight version updated to {new}", "new_version": new})

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def get_server_info(self, request: web.Request) -> web.Response:
        """The fields of SGLang's /get_server_info that RL clients read, plus
        ``moe_rl_checksum`` (this engine checks the ``checksum`` of a weight bucket)."""
        info = self.engine.info()
        return web.json_response({
            "model_path": self.engine.model_path, "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1,
            "skip_tokenizer_init": self.text is None, "enable_return_routed_experts": True,
            "context_length": self.engine.max_context, "weight_version": self.engine.weight_version,
            "version": "moe-rl-embedded", "moe_rl_checksum": True, "internal_states": [info],
        })

    async def loads(self, request: web.Request) -> web.Response:
        """SGLang's /v1/loads: one load (this engine is DP rank 0) with its core keys, the
        ``memory`` and ``queues`` sections, and ours: ``kv_slots_free``/``kv_slots`` (a request
        holds one KV slot while it runs; all free when nothing runs) and ``paused``."""
        q = request.query
        include = {s.strip() for s in q.get("include", "all").split(",")}
        if not include <= LOAD_SECTIONS:
            raise RequestError("include", f"sections are {', '.join(sorted(LOAD_SECTIONS))}, got {q['include']!r}")
        if q.get("dp_rank") not in (None, "0"):
            return web.json_response(self._loads_envelope([]))
        info, e = self.engine.info(), self.engine
        capacity = e.max_running * e.max_context
        used, pending = info["kv_tokens_used"], info["waiting_tokens"]
        load = {
            "timestamp": time.time(), "dp_rank": 0,
            "num_running_reqs": info["running_requests"], "num_waiting_reqs": info["waiting_requests"],
            "num_waiting_uncached_tokens": pending,  # no prefix cache: every waiting token is uncached
            "num_used_tokens": used, "num_total_tokens": used + pending, "num_active_tokens": used + pending,
            "num_prealloc_ready_tokens": 0, "max_total_num_tokens": capacity,
            "max_running_requests": e.max_running, "token_usage": round(used / capacity, 4),
            # not measured by the embedded engine
            "gen_throughput": 0.0, "cache_hit_rate": 0.0, "utilization": 0.0,
            "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0, "decode_moments": None,
            "kv_slots_free": info["kv_slots_free"], "kv_slots": e.max_running, "paused": info["paused"],
        }
        if include & {"all", "memory"}:
            nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts) / 2**30  # noqa: E731
            load["memory"] = {"weight_gb": round(nbytes(e.model.parameters()), 3),
                              "kv_cache_gb": round(e.state_bytes / 2**30, 3),
                              "graph_gb": 0.0, "token_capacity": capacity}
        if include & {"all", "queues"}:
            load["queues"] = {"waiting": info["waiting_requests"], "grammar": 0,
                              "paused": info["waiting_requests"] if info["paused"] else 0,
                              "retracted": 0, "prealloc_ready": 0}
        return web.json_response(self._loads_envelope([load]))

    def _loads_envelope(self, loads: list) -> dict:
        dev = self.engine.device
        return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": "moe-rl-embedded",
                "accelerator": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
                "num_accelerators": 1, "loads": loads}

    async def not_supported(self, request: web.Request) -> web.Response:
        # these act on GPU memory (CUDA IPC tensors, memory saver): nothing to honour on the
        # embedded engine; SGLang answers a failure as {"success": false, "message"} with 400
        return web.json_response({"success": False, "message": f"{request.path} is not supported by the embedded "
                                  "engine (moe-rl serve); use engine.kind: sglang"}, status=400)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """SGLang's update from an HF checkpoint directory: read into a staging copy (a missing
        directory, tensor or a wrong shape is a 400 and the engine keeps its weights), then
        copied into the live weights between two steps, like a distributed update."""
        from ..model import MoEArch, MoEForCausalLM, hf_param_specs, iter_local_hf_tensors, load_hf_weights

        req = P.UpdateFromDiskRequest.parse(await _json(request))
        if req.abort_all_requests:
            self.engine.abort(abort_all=True, message="Aborted for a weight update")
        engine = self.engine

        def load_and_commit():
            if (Path(req.model_path) / "config.json").is_file():  # of another model: say which tensor differs
                theirs, ours = hf_param_specs(MoEArch.from_hf_dir(req.model_path)), hf_param_specs(engine.arch)
                if theirs != ours:
                    a, b = next(((a, b) for a, b in zip(theirs + [None], ours + [None]) if a != b))
                    raise ValueError(f"its config.json is of another model (tensor {a} where this engine has {b})")
            staged = load_hf_weights(MoEForCausalLM(engine.arch).to(engine.dtype), req.model_path)

            @torch.no_grad()
            def commit():
                live = dict(iter_local_hf_tensors(engine.model))
                for name, t in iter_local_hf_tensors(staged):
                    live[name].copy_(t)
            engine.commit_weights(commit, req.weight_version)

        async with self._update_lock:
            try:
                await asyncio.to_thread(load_and_commit)
            except Exception as e:  # the checkpoint is missing, unreadable or of another model
                log.warning("update_weights_from_disk failed: %s: %s", type(e).__name__, e)
                msg = (f"Failed to update weights from {req.model_path}: {type(e).__name__}: {e}; "
                       f"the engine keeps serving weight_version {self.engine.weight_version}")
                return web.json_response({"success": False, "message": msg, "num_paused_requests": 0}, status=400)
        self.engine.model_path = req.model_path
        msg = "Succeeded to update model weights."
        if req.weight_version is not None:
            msg += f" Weight version updated to {req.weight_version}."
        return web.json_response({"success": True, "message": msg, "num_paused_requests": 0})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        faults.point("engine.update")  # a test run's engine stuck in a weight sync
        with paused_gc():  # the request's thousands of lists are freed before it ends: see moe_rl.gc_control
            return await self._update_weights(request)

    async def _update_weights(self, request: web.Request) -> web.Response:
        req = P.UpdateWeightsRequest.parse(await _json(request))
        if self.receiver is None:
            return web.json_response({"success": False, "message": "no weight update group: call /init_weights_update_group first"}, status=400)
        if req.abort_all_requests:
            self.engine.abort(abort_all=True, message="Aborted for a weight update")
        # shielded: a sender that disconnects cannot leave a received update half-handled
        complete, msg = await asyncio.shield(asyncio.ensure_future(self._receive_and_commit(req)))
        if msg is not None:
            return web.json_response({"success": False, "message": msg}, status=400)
        if complete:
            return web.json_response({"success": True, "message": f"Succeeded to update parameter online (weight_version {self.engine.weight_version})."})
        return web.json_response({"success": True, "message": "Bucket received; the update completes with its last bucket."})

    async def _receive_and_commit(self, req: P.UpdateWeightsRequest) -> tuple[bool, str | None]:
        """Receives one bucket; commits when it completes the update. (complete, error message)."""
        async with self._update_lock:
            try:
                complete = await asyncio.to_thread(
                    self.receiver.receive_bucket, req.names, req.dtypes, req.shapes, req.group_name,
                    req.load_format, req.weight_version, req.checksum,
                )
                if complete:
                    await asyncio.to_thread(self.engine.commit_weights, lora.commit(self.engine, self.receiver.commit),
                                            req.weight_version)
                return complete, None
            except Exception as e:
                log.exception("update_weights_from_distributed failed")
                try:
                    self.receiver.abort()
                except Exception:
                    log.exception("receiver.abort failed")
                msg = (f"Failed to update weights: {type(e).__name__}: {e}; the partial update was discarded "
                       f"and the engine keeps serving weight_version {self.engine.weight_version}")
                self.engine.last_update_error = msg
                return False, msg

    # --- info ------------------------------------------------------------------------------
    async def get_model_info(self, request: web.Request) -> web.Response:
        info = self.engine.info()
        return web.json_response({
            "model_path": self.engine.model_path,
            "tokenizer_path": self.engine.model_path if self.text is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.engine.weight_version,
            "model_type": self.engine.arch.model_type,
            "architectures": [FAMILIES[self.engine.arch.model_type].architecture],
            "engine": "moe-rl-embedded",
            **info,
        })

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.alive:
            return _error(503, f"engine is not running: {self.engine.error}")
        return web.Response(status=200)


# --- running it ------------------------------------------------------------------------------
async def start_server(engine: Engine, host: str, port: int, api_key: str | None = None,
                       limits: ServerLimits | None = None):
    """Starts the engine thread and the HTTP site; returns (runner, url)."""
    engine.start()
    server = EngineServer(engine, api_key, limits)
    return await server.limits.serve(server.app(), host, port)  # a client gone aborts its request (frees its KV slot)


async def _serve(cfg, host: str, port: int, api_key: str | None) -> None:
    engine = build_engine(cfg)
    freeze_gc()  # weight updates decode thousands of small lists: see moe_rl.gc_control
    runner, url = await start_server(engine, host, port, api_key, ServerLimits.for_engine(engine, cfg.engine))
    print(f"moe-rl engine listening on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        engine.stop()


def serve_main(argv: list[str]) -> int:
    from ..config import ConfigError

    ap = argparse.ArgumentParser(prog="moe-rl serve", description="Serve an embedded engine over SGLang's HTTP API.")
    ap.add_argument("config", help="experiment YAML (its model and engine sections are used), or a model directory: "
                    "an HF model, a checkpoint step directory (its hf/) or a run directory (its latest checkpoint)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    ap.add_argument("--host", default=None, help="bind address (default engine.host, 127.0.0.1)")
    ap.add_argument("--port", type=int, default=None, help="port (default engine.port; 0 = a free port)")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default engine.api_key)")
    ap.add_argument("--dry-run", action="store_true", help="engine.kind=sglang: print the SGLang command, do not run it")
    args = ap.parse_intermixed_args(argv)
    try:
        cfg = _serve_config(args.config, args.overrides, resolve=not args.dry_run)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    e = cfg.engine
    if e.kind == "sglang":
        return _exec_sglang(cfg, args)
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host = args.host or e.host
    port = e.port if args.port is None else args.port
    api_key = args.api_key if args.api_key is not None else e.api_key
    try:
        asyncio.run(_serve(cfg, host, port, api_key))
    except KeyboardInterrupt:
        pass
    return 0


def _serve_config(config: str, overrides: list[str], resolve: bool = True):
    """The config of ``moe-rl serve CONFIG``: a YAML file, or a directory holding a model (the
    defaults with model.path set to it); a model.path naming a checkpoint or run directory is
    resolved to its model (``rundir.resolve_model_dir``). ``resolve=False`` (``--dry-run``, which
    prints the command for the machine that has the model) leaves a YAML's model.path as written."""
    from ..config import load_config
    from ..rundir import resolve_model_dir

    if Path(config).is_dir():
        return load_config(None, [f"model.path={resolve_model_dir(config)}", *overrides])
    cfg = load_config(config, overrides)
    if cfg.model.path and resolve:
        cfg.model.path = str(resolve_model_dir(cfg.model.path))
    return cfg


def _exec_sglang(cfg, args) -> int:
    """engine.kind=sglang: replace this process by SGLang's server (or print its command)."""
    import importlib.util
    import os

    from .sglang import format_command, sglang_command

    if args.api_key is not None:
        cfg.engine.api_key = args.api_key
    try:
        cmd = sglang_command(cfg, host=args.host, port=args.port)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(format_command(cmd))
        return 0
    if importlib.util.find_spec("sglang") is None:
        print("error: engine.kind=sglang but the sglang package is not installed here "
              f"(the command would be: {format_command(cmd)})", file=sys.stderr)
        return 2
    print(f"moe-rl serve: exec {format_command(cmd)}", file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))

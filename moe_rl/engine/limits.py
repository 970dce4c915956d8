"""Limits of the embedded engine's HTTP server (``moe-rl serve``). They hold for every route,
those registered later included: one middleware, and the connection settings of the runner.

* size: a body above ``engine.max_request_bytes`` gets 413 (a declared Content-Length above it
  before a byte is read; a chunked body once it passes it: aiohttp's ``client_max_size``);
* time: aiohttp's keep-alive timer closes a connection that has not sent a whole request's
  headers ``engine.read_timeout_s`` after it connected or got its last answer, which also bounds
  idle keep-alive connections; the body then has ``read_timeout_s`` more, or the answer is 408
  and the connection is closed;
* content: the body is parsed here, once, into one JSON value (``protocol.json_body`` hands it
  to the handlers): not JSON, a number past Python's digit limit or nesting past its recursion limit
  is a 400 naming ``body``;
* load: an engine whose queue is full raises ``QueueFull``: 503 with ``Retry-After``;
* a client's mistake that a handler finds (``RequestError``, a pydantic ``ValidationError``, a
  ``RecursionError`` from a deeply nested value) is a 400: a 5xx means the server's own fault.

Errors are SGLang's ``{"error": {"message": ...}}`` (its ``_create_error_response``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import dataclass

import pydantic
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .protocol import BODY, QueueFull

if sys.version_info >= (3, 11):
    from asyncio import timeout as _deadline
else:  # aiohttp depends on async-timeout before 3.11
    from async_timeout import timeout as _deadline

log = logging.getLogger(__name__)

MIB = 1 << 20
# a prompt token in a /generate body: an id is at most 8 bytes of JSON ("151935, "); a text
# prompt's token is a few characters, each up to 6 bytes escaped ("\u00e9")
BYTES_PER_TOKEN = 32
RETRY_AFTER_S = 1  # what a 503 asks the client to wait (SGLang sends no Retry-After): a few engine steps
LINGER_S = 10.0  # aiohttp's default: how long a refused body is still read (so its sender sees the answer)


def error_response(status: int, message: str, **kw) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status, **kw)


def weight_update_bytes(names_shapes: list[tuple[str, list[int]]]) -> int:
    """The body of one /update_weights_from_distributed listing every given tensor."""
    names = [n for n, _ in names_shapes]
    return len(json.dumps({"names": names, "dtypes": ["bfloat16"] * len(names), "shapes": [s for _, s in names_shapes]}))


def default_max_request_bytes(engine) -> int:
    """1 MiB (sampling params, flags, headroom) plus the larger of the largest legitimate bodies:
    a /generate batch of max_running_requests prompts of max_context tokens (32 bytes a token),
    and twice a weight update carrying every tensor the engine can receive in one bucket."""
    from ..model import iter_local_hf_tensors
    from . import lora

    tensors = [(n, list(t.shape)) for n, t in iter_local_hf_tensors(engine.model)]
    adapter = lora.receiver_params(engine)
    if adapter is not None:
        tensors += [(n, list(t.shape)) for n, t in adapter.items()]
    generate = BYTES_PER_TOKEN * engine.max_context * engine.max_running
    return MIB + max(generate, 2 * weight_update_bytes(tensors))


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int
    read_timeout_s: float = 30.0

    @classmethod
    def for_engine(cls, engine, engine_cfg=None) -> "ServerLimits":
        """The config's ``engine.max_request_bytes`` and ``engine.read_timeout_s`` (defaults
        without a config); an unset size is ``default_max_request_bytes``."""
        size = getattr(engine_cfg, "max_request_bytes", None)
        timeout = getattr(engine_cfg, "read_timeout_s", cls.read_timeout_s)
        return cls(size if size is not None else default_max_request_bytes(engine), timeout)

    def app_kwargs(self) -> dict:
        return {"client_max_size": self.max_request_bytes}

    def runner_kwargs(self) -> dict:
        return {"keepalive_timeout": self.read_timeout_s, "lingering_time": min(LINGER_S, self.read_timeout_s)}

    async def serve(self, app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
        """Serves ``app`` (made with ``middleware()`` and ``app_kwargs()``) on host:port (0: a free
        port) with these connection settings; returns (its runner, its URL). A client that
        disconnects cancels its handler (handler_cancellation), which aborts its request."""
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, **self.runner_kwargs())
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1] if port == 0 else port
        shown = f"[{host}]" if ":" in host else host
        return runner, f"http://{shown}:{bound}"

    def _too_large(self, size: int | None) -> web.Response:
        got = f"{size} bytes" if size is not None else "a body"
        resp = error_response(413, f"body: {got} is more than engine.max_request_bytes={self.max_request_bytes} "
                                   "(raise engine.max_request_bytes in the server's config)")
        resp.force_close()  # what is left of the body is not read as a next request
        return resp

    async def _read_json(self, request: web.Request) -> web.Response | None:
        """Reads and parses the body into ``request[BODY]``; the refusal when it cannot."""
        if request.content_length is not None and request.content_length > self.max_request_bytes:
            return self._too_large(request.content_length)
        try:
            # not asyncio.wait_for: it drops a cancellation (the client hung up) that arrives as
            # the body is read, and the request would then run for no one
            async with _deadline(self.read_timeout_s):
                raw = await request.read()
        except asyncio.TimeoutError:
            # a half-sent body: answer, then close at once instead of waiting for the rest
            resp = error_response(408, f"body: not received in full within engine.read_timeout_s="
                                       f"{self.read_timeout_s:g} s")
            resp.force_close()
            await resp.prepare(request)
            await resp.write_eof()
            request.protocol.force_close()
            return resp
        except web.HTTPRequestEntityTooLarge:
            return self._too_large(None)
        except (HttpProcessingError, web.RequestPayloadError) as e:  # a bad chunked encoding or compression
            resp = error_response(400, f"body: {' '.join(str(e).split())}")
            resp.force_close()
            return resp
        try:
            request[BODY] = json.loads(raw)
        except RecursionError:
            return error_response(400, "body: JSON nested too deeply")
        except ValueError as e:  # not JSON, not UTF-8, or a number past Python's digit limit
            return error_response(400, f"body: not valid JSON ({str(e).split(';')[0]})")
        return None

    def middleware(self):
        @web.middleware
        async def limits(request: web.Request, handler):
            if request.body_exists and request.match_info.http_exception is None:
                refused = await self._read_json(request)
                if refused is not None:
                    return refused
            try:
                return await handler(request)
            except QueueFull as e:
                return error_response(503, str(e), headers={"Retry-After": str(RETRY_AFTER_S)})
            except pydantic.ValidationError as e:
                return error_response(400, "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}"
                                                     for err in e.errors()[:5]))
            except RecursionError:  # a handler walked (or printed) a deeply nested value of the body
                log.info("%s %s: RecursionError on the request's body", request.method, request.path)
                return error_response(400, "body: JSON nested too deeply")
        return limits

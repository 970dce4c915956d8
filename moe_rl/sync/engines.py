"""The engine calls the weight sync needs, behind one small async interface.

``EngineAPI`` is the subset of SGLang's HTTP API used here (same endpoint and field names).
``as_engine`` accepts a URL (a minimal aiohttp client below), an object with these methods
(``moe_rl.engine.client`` or the in-process ``LocalEngine`` of ``moe_rl.sync.local``).
Every method returns SGLang's JSON reply; a reply with ``success: false`` becomes
``EngineCallError`` so callers never miss a failure.
"""
from __future__ import annotations

import asyncio
import inspect
from typing import Any, Protocol, runtime_checkable


class EngineCallError(RuntimeError):
    """An engine refused or failed a call (its message is included)."""


@runtime_checkable
class EngineAPI(Protocol):
    name: str
    num_ranks: int  # ranks this engine contributes to the weight-sync group (SGLang: tp size)

    async def init_weights_update_group(self, **body: Any) -> dict: ...
    async def update_weights_from_distributed(self, **body: Any) -> dict: ...
    async def pause_generation(self, mode: str = "abort") -> dict: ...
    async def continue_generation(self) -> dict: ...


def check_reply(engine: str, endpoint: str, reply: Any) -> Any:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineCallError(f"{engine} {endpoint}: {reply.get('message', 'failed')}")
    if isinstance(reply, (tuple, list)) and len(reply) == 2 and isinstance(reply[0], bool) and not reply[0]:
        raise EngineCallError(f"{engine} {endpoint}: {reply[1]}")
    return reply


class HttpEngine:
    """Minimal aiohttp client for the four endpoints (used until/unless a client object is given)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0, num_ranks: int = 1):
        self.url = url.rstrip("/")
        self.name = self.url
        self.num_ranks = num_ranks
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._session = None

    async def _post(self, endpoint: str, body: dict | None = None) -> dict:
        import aiohttp

        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        try:
            async with self._session.post(f"{self.url}/{endpoint}", json=body or {}) as resp:
                text = await resp.text()
                try:
                    import json

                    reply = json.loads(text) if text else {}
                except ValueError:
                    reply = {"success": resp.status < 400, "message": text}
                if resp.status >= 400:
                    msg = reply.get("message") if isinstance(reply, dict) else None
                    raise EngineCallError(f"{self.name} /{endpoint}: HTTP {resp.status}: {msg or text}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise EngineCallError(f"{self.name} /{endpoint}: {type(e).__name__}: {e}") from e
        return check_reply(self.name, "/" + endpoint, reply)

    async def init_weights_update_group(self, **body) -> dict:
        return await self._post("init_weights_update_group", body)

    async def update_weights_from_distributed(self, **body) -> dict:
        return await self._post("update_weights_from_distributed", body)

    async def pause_generation(self, mode: str = "abort") -> dict:
        return await self._post("pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self._post("continue_generation", {})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class _Adapter:
    """Wraps an engine-client object: awaits its methods (sync or async) and checks replies."""

    def __init__(self, client: Any):
        self.client = client
        self.name = str(getattr(client, "name", None) or getattr(client, "url", None) or type(client).__name__)
        self.num_ranks = int(getattr(client, "num_ranks", 1))

    async def _call(self, method: str, **kw) -> Any:
        fn = getattr(self.client, method)
        out = fn(**kw)
        if inspect.isawaitable(out):
            out = await out
        return check_reply(self.name, method, out)

    async def init_weights_update_group(self, **body):
        return await self._call("init_weights_update_group", **body)

    async def update_weights_from_distributed(self, **body):
        return await self._call("update_weights_from_distributed", **body)

    async def pause_generation(self, mode: str = "abort"):
        return await self._call("pause_generation", mode=mode)

    async def continue_generation(self):
        return await self._call("continue_generation")


def as_engine(e: Any, api_key: str | None = None, timeout_s: float = 600.0):
    if isinstance(e, str):
        return HttpEngine(e, api_key=api_key, timeout_s=timeout_s)
    if isinstance(e, (HttpEngine, _Adapter)):
        return e
    return _Adapter(e)

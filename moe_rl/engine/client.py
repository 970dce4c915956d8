"""The async HTTP client for SGLang servers and embedded engines: the only way the rest of the
stack talks to rollout engines.

* one pooled ``aiohttp`` session per client (``max_connections`` sockets in all, idle ones kept
  ``KEEPALIVE_S``, less than SGLang's server keeps them);
* a total timeout per request (``timeout_s``, default ``engine.request_timeout_s``) and a
  connect timeout;
* retries only when the TCP connection could not be made (``connect_retries``, with backoff):
  an HTTP answer, even 4xx/5xx, is never retried, and neither is a connection lost
  mid-request (the engine may have run part of it);
* ``generate`` spreads requests over the URLs: the one with the fewest outstanding requests,
  ties broken round-robin, skipping engines marked down (``mark_down``, after a failure; they
  are tried again after a backoff, and an answer clears the mark), engines a weight sync
  missed (``set_stale``) and, while another serves, engines that gave no answer in time
  (``frozen``: stopped or hung; an answer or a sync that reaches them clears it); control calls
  (pause, continue, abort, flush) go to every URL;
* every failure raises ``EngineError`` naming the URL and endpoint (``EngineHTTPError`` for an
  HTTP error answer, with its status and body), never hangs past the timeout.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any, Iterable

import aiohttp

from .protocol import decode_routed_experts, dumps_body, output_logprobs, token_weight_versions

__all__ = ["EngineClient", "EngineHandle", "EngineError", "EngineHTTPError", "EngineTimeoutError", "decode_routed_experts",
           "output_logprobs", "token_weight_versions"]


_JSON = {"Content-Type": "application/json"}
# Seconds an idle pooled connection is kept for reuse: below the servers' own idle keep-alive
# (SGLang's uvicorn: SGLANG_TIMEOUT_KEEP_ALIVE, 5 s; the embedded server: engine.read_timeout_s),
# so that a request never goes out on a connection the server is closing. aiohttp's default is 15 s.
KEEPALIVE_S = 4.0


class EngineError(RuntimeError):
    """A request to an engine failed; ``url`` and ``endpoint`` say which."""

    def __init__(self, url: str, endpoint: str, message: str):
        super().__init__(f"engine {url}{endpoint}: {message}")
        self.url, self.endpoint = url, endpoint


class EngineTimeoutError(EngineError):
    """The engine gave no answer in time: it is frozen (stopped, hung) or overloaded, not dead."""


class EngineHTTPError(EngineError):
    """The engine answered with an HTTP error status (never retried)."""

    def __init__(self, url: str, endpoint: str, status: int, body: Any):
        msg = body.get("error", body) if isinstance(body, dict) else body
        if isinstance(msg, dict):
            msg = msg.get("message", msg)
        super().__init__(url, endpoint, f"HTTP {status}: {msg}")
        self.status, self.body = status, body


class EngineClient:
    def __init__(
        self,
        urls: str | Iterable[str],
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        connect_retries: int = 3,
        retry_backoff_s: float = 0.25,
        max_connections: int = 512,
    ):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("EngineClient needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.api_key = api_key
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.connect_retries, self.retry_backoff_s = connect_retries, retry_backoff_s
        self.max_connections = max_connections
        self.outstanding = {u: 0 for u in self.urls}
        self._rr = itertools.count()
        self._rid_url: dict[str, str] = {}
        self._session: aiohttp.ClientSession | None = None
        self._down_until: dict[str, float] = {}  # url -> monotonic time it may be tried again
        self._failures: dict[str, int] = {}  # url -> failures in a row
        self.stale: frozenset[str] = frozenset()  # engines behind the trainer's weights: never picked
        self.frozen: set[str] = set()  # engines whose last request got no answer in time: picked last
        self.lora_path: str | None = None  # LoRA adapter every /generate names (lora.sync=adapter on SGLang)

    @classmethod
    def from_config(cls, engine_cfg, urls: Iterable[str] | None = None, **kw) -> "EngineClient":
        """A client for ``engine_cfg`` (the config's ``engine`` section); ``urls`` defaults to
        ``engine.urls``."""
        kw.setdefault("api_key", engine_cfg.api_key)
        kw.setdefault("timeout_s", engine_cfg.request_timeout_s)
        kw.setdefault("connect_retries", engine_cfg.connect_retries)
        return cls(list(urls) if urls is not None else engine_cfg.urls, **kw)

    # --- plumbing --------------------------------------------------------------------------
    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=KEEPALIVE_S),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s),
            )
        return self._session

    def pick(self) -> str:
        """The URL with the fewest outstanding requests (round-robin among ties) among those not
        marked down or stale; if every fresh one is down, the one due back first."""
        fresh = [u for u in self.urls if u not in self.stale]
        if not fresh:
            raise EngineError(self.urls[0], "/generate", "every engine is behind the trainer's weights (missed a sync)")
        fresh = [u for u in fresh if u not in self.frozen] or fresh
        now = time.monotonic()
        live = [u for u in fresh if self._down_until.get(u, 0.0) <= now]
        if not live:
            return min(fresh, key=lambda u: self._down_until[u])
        low = min(self.outstanding[u] for u in live)
        ties = [u for u in live if self.outstanding[u] == low]
        return ties[next(self._rr) % len(ties)]

    def mark_down(self, url: str) -> float:
        """Keeps ``generate`` off an engine that failed (refused, dropped or did not answer a
        request) for a backoff that doubles with each failure in a row, 1 s up to 60 s; then
        the next request tries it again. Returns the backoff in seconds."""
        url = url.rstrip("/")
        n = self._failures.get(url, 0) + 1
        self._failures[url] = n
        backoff = min(60.0, 2.0 ** (n - 1))
        self._down_until[url] = time.monotonic() + backoff
        return backoff

    def live_urls(self) -> list[str]:
        now = time.monotonic()
        return [u for u in self.urls if self._down_until.get(u, 0.0) <= now and u not in self.stale]

    def serving_urls(self) -> list[str]:
        """Engines that may still serve: neither behind the weights nor frozen (they may be down
        for a backoff: a dead engine can be restarted at its address)."""
        return [u for u in self.urls if u not in self.stale and u not in self.frozen]

    def set_stale(self, urls: Iterable[str]) -> None:
        """Engines the last weight sync could not reach: ``generate`` keeps off them until a
        later sync updates them (then call again without them). The engines it reached answered
        it: none of them is frozen."""
        self.stale = frozenset(u.rstrip("/") for u in urls)
        self.frozen &= self.stale

    async def request(self, method: str, endpoint: str, url: str | None = None, payload: Any = None,
                      timeout_s: float | None = None) -> Any:
        """One call; returns the parsed JSON body (or text, or None when empty)."""
        url = (url or self.urls[0]).rstrip("/")
        session = self._get_session()
        # always a ClientTimeout: aiohttp reads timeout=None as "no timeout at all"
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s, sock_connect=self.connect_timeout_s)
        data = None if payload is None else dumps_body(payload) if isinstance(payload, dict) else json.dumps(payload)
        for attempt in range(self.connect_retries + 1):
            try:
                async with session.request(method, url + endpoint, data=data, headers=_JSON if data is not None else None,
                                           timeout=timeout) as resp:
                    raw = await resp.read()
                    body = _parse(raw, resp.content_type)
                    if resp.status >= 400:
                        raise EngineHTTPError(url, endpoint, resp.status, body)
                    if url in self._failures:  # it answers again
                        del self._failures[url]
                        self._down_until.pop(url, None)
                    self.frozen.discard(url)
                    return body
            except aiohttp.ClientConnectorError as e:  # never connected: safe to retry
                if attempt >= self.connect_retries:
                    raise EngineError(url, endpoint, f"cannot connect after {attempt + 1} attempts: {e}") from e
                await asyncio.sleep(self.retry_backoff_s * 2**attempt)
            except asyncio.TimeoutError as e:
                self.frozen.add(url)
                raise EngineTimeoutError(url, endpoint, f"no answer within {timeout_s or self.timeout_s:g} s") from e
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as e:
                raise EngineError(url, endpoint, f"connection lost mid-request (engine died?): {type(e).__name__}: {e}") from e
            except aiohttp.ClientError as e:
                raise EngineError(url, endpoint, f"{type(e).__name__}: {e}") from e

    async def stream(self, endpoint: str, url: str, payload: dict):
        """POST a streaming request (``"stream": true``); yields each server-sent event's JSON
        (SGLang's ``data: {...}`` lines, up to ``data: [DONE]``). Errors as ``request``'s; a
        stream cut before ``[DONE]`` is an ``EngineError``."""
        url = url.rstrip("/")
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
        try:
            async with self._get_session().post(url + endpoint, data=dumps_body(payload), headers=_JSON,
                                                timeout=timeout) as resp:
                if resp.status >= 400:
                    raise EngineHTTPError(url, endpoint, resp.status, _parse(await resp.read(), resp.content_type))
                buf = bytearray()
                async for chunk in resp.content.iter_any():  # not by line: an event (routing) can be MBs
                    seen = max(0, len(buf) - 1)  # where a separator can start that is not yet looked at
                    buf += chunk
                    while (end := buf.find(b"\n\n", seen)) >= 0:
                        event, seen = bytes(buf[:end]), 0
                        del buf[: end + 2]
                        if not event.startswith(b"data:"):
                            continue  # comments
                        data = event[5:].strip()
                        if data == b"[DONE]":
                            return
                        yield json.loads(data)
        except asyncio.TimeoutError as e:
            raise EngineTimeoutError(url, endpoint, f"no answer within {self.timeout_s:g} s") from e
        except aiohttp.ClientError as e:
            raise EngineError(url, endpoint, f"{type(e).__name__}: {e}") from e
        raise EngineError(url, endpoint, "the stream ended without [DONE] (engine died?)")

    async def _broadcast(self, method: str, endpoint: str, payload: Any, urls: Iterable[str] | None) -> list:
        urls = list(urls) if urls is not None else self.urls
        return list(await asyncio.gather(*(self.request(method, endpoint, u, payload) for u in urls)))

    # --- generation --------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict | None = None,
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        rid: str | None = None,
        routed_experts_start_len: int = 0,
        url: str | None = None,
        **fields: Any,
    ) -> dict:
        """POST /generate for one prompt; returns SGLang's ``{"output_ids", "meta_info"}``.
        ``url`` pins an engine; otherwise the least-loaded one serves it."""
        payload = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
                   "return_logprob": return_logprob, **fields}
        if return_routed_experts:
            payload["return_routed_experts"] = True
            if routed_experts_start_len:
                payload["routed_experts_start_len"] = routed_experts_start_len
        if rid is not None:
            payload["rid"] = rid
        return await self._post_generate(payload, [rid] if rid is not None else [], 1, url)

    async def generate_batch(
        self,
        input_ids: list[list[int]],
        sampling_params: list[dict],
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        rids: list[str] | None = None,
        url: str | None = None,
    ) -> list[dict]:
        """POST /generate with SGLang's batch form (a list of prompts, one sampling-params
        dict each): one HTTP round trip for many prompts; returns one response per prompt."""
        if len(sampling_params) != len(input_ids) or (rids is not None and len(rids) != len(input_ids)):
            raise ValueError("generate_batch: one sampling_params (and rid) per prompt")
        payload = {"input_ids": [list(p) for p in input_ids], "sampling_params": [dict(sp) for sp in sampling_params],
                   "return_logprob": return_logprob}
        if return_routed_experts:
            payload["return_routed_experts"] = True
        if rids is not None:
            payload["rid"] = list(rids)
        out = await self._post_generate(payload, list(rids or []), len(input_ids), url)
        if not isinstance(out, list) or len(out) != len(input_ids):
            raise EngineError(url or "?", "/generate", f"expected {len(input_ids)} responses to a batch")
        return out

    async def _post_generate(self, payload: dict, rids: list[str], n: int, url: str | None) -> Any:
        url = (url or self.pick()).rstrip("/")
        if self.lora_path is not None and "lora_path" not in payload:
            batch = any(isinstance(p, list) for p in payload["input_ids"])
            payload["lora_path"] = [self.lora_path] * n if batch else self.lora_path
        self.outstanding[url] = self.outstanding.get(url, 0) + n
        for rid in rids:
            self._rid_url[rid] = url
        try:
            return await self.request("POST", "/generate", url, payload)
        finally:
            self.outstanding[url] -= n
            for rid in rids:
                self._rid_url.pop(rid, None)

    async def pause_generation(self, mode: str = "abort", urls: Iterable[str] | None = None) -> list:
        """Pauses every engine (or ``urls``); returns once each has paused."""
        return await self._broadcast("POST", "/pause_generation", {"mode": mode}, urls)

    async def continue_generation(self, urls: Iterable[str] | None = None) -> list:
        return await self._broadcast("POST", "/continue_generation", {}, urls)

    async def abort_request(self, rid: str | None = None, abort_all: bool = False,
                            urls: Iterable[str] | None = None) -> list:
        """Aborts one request (on the engine serving it, when this client sent it) or all."""
        if rid is not None and urls is None and rid in self._rid_url:
            urls = [self._rid_url[rid]]
        return await self._broadcast("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all}, urls)

    async def flush_cache(self, urls: Iterable[str] | None = None) -> list:
        return await self._broadcast("POST", "/flush_cache", None, urls)

    # --- weights -------------------------------------------------------------------------------
    async def init_weights_update_group(self, url: str, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict:
        """Joins engine ``url`` to the weight-sync group (blocks until every rank has joined)."""
        return await self.request("POST", "/init_weights_update_group", url, {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, url: str, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str = "weight_update_group",
                                              weight_version: str | int | None = None,
                                              load_format: str | None = "flattened_bucket",
                                              flush_cache: bool = True, abort_all_requests: bool = False,
                                              **fields: Any) -> dict:
        """Announces one bucket to engine ``url``; the answer comes once the broadcast landed."""
        payload = {"names": names, "dtypes": dtypes, "shapes": [list(s) for s in shapes], "group_name": group_name,
                   "flush_cache": flush_cache, "abort_all_requests": abort_all_requests,
                   "load_format": load_format, **fields}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self.request("POST", "/update_weights_from_distributed", url, payload)

    def engine(self, url: str, num_ranks: int = 1) -> "EngineHandle":
        """One engine of this client, with the per-engine calls ``moe_rl.sync`` makes
        (``name``, ``num_ranks``, and the endpoints taking SGLang's fields as keywords)."""
        return EngineHandle(self, url, num_ranks)

    # --- info ----------------------------------------------------------------------------------
    async def get_model_info(self, url: str | None = None) -> dict:
        return await self.request("GET", "/get_model_info", url)

    async def health(self, url: str | None = None, timeout_s: float = 5.0) -> bool:
        """True when the engine answers /health with 200 (no retries)."""
        url = (url or self.urls[0]).rstrip("/")
        try:
            async with self._get_session().get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def wait_healthy(self, timeout_s: float = 60.0, urls: Iterable[str] | None = None) -> None:
        """Waits until every engine answers /health; EngineError naming the first that did not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for url in list(urls) if urls is not None else self.urls:
            while not await self.health(url):
                if loop.time() > deadline:
                    raise EngineError(url, "/health", f"not healthy within {timeout_s:g} s")
                await asyncio.sleep(0.2)


class EngineHandle:
    """A single engine behind an ``EngineClient`` (shares its session)."""

    def __init__(self, client: EngineClient, url: str, num_ranks: int = 1):
        self.client, self.url, self.name, self.num_ranks = client, url.rstrip("/"), url.rstrip("/"), num_ranks

    async def generate(self, input_ids: list[int], sampling_params: dict | None = None, **kw) -> dict:
        return await self.client.generate(input_ids, sampling_params, url=self.url, **kw)

    async def init_weights_update_group(self, **body: Any) -> dict:
        return await self.client.request("POST", "/init_weights_update_group", self.url, body)

    async def update_weights_from_distributed(self, **body: Any) -> dict:
        return await self.client.request("POST", "/update_weights_from_distributed", self.url, body)

    async def pause_generation(self, mode: str = "abort") -> dict:
        return (await self.client.pause_generation(mode, urls=[self.url]))[0]

    async def continue_generation(self) -> dict:
        return (await self.client.continue_generation(urls=[self.url]))[0]

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> dict:
        return (await self.client.abort_request(rid, abort_all, urls=[self.url]))[0]

    async def flush_cache(self) -> Any:
        return (await self.client.flush_cache(urls=[self.url]))[0]

    async def begin_weight_update(self) -> dict:
        return await self.client.request("POST", "/begin_weight_update", self.url, {})

    async def end_weight_update(self) -> dict:
        return await self.client.request("POST", "/end_weight_update", self.url, {})

    async def destroy_weights_update_group(self, group_name: str) -> dict:
        return await self.client.request("POST", "/destroy_weights_update_group", self.url, {"group_name": group_name})

    async def server_info(self) -> dict:
        return await self.client.request("GET", "/get_server_info", self.url)

    async def get_model_info(self) -> dict:
        return await self.client.get_model_info(self.url)

    async def health(self, timeout_s: float = 5.0) -> bool:
        return await self.client.health(self.url, timeout_s)


def _parse(raw: bytes, content_type: str) -> Any:
    if not raw:
        return None
    if content_type == "application/json" or raw[:1] in (b"{", b"["):
        try:
            return json.loads(raw)
        except ValueError:
            pass
    return raw.decode("utf-8", "replace")

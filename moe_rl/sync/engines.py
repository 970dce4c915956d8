"""The engine calls the weight sync needs, behind one small async interface.

``EngineAPI`` is the subset of SGLang's HTTP API used here (same endpoint and field names).
``as_engine`` accepts a URL (then ``moe_rl.engine.client.EngineClient`` makes the calls), an
``EngineHandle`` of that client, or any object with these methods (the in-process
``LocalEngine`` of ``moe_rl.sync.local``). A reply with ``success: false`` becomes
``EngineCallError``, so callers never miss a failure; HTTP errors raise the client's
``EngineError``.
"""
from __future__ import annotations

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
    # optional (an object without them is taken to need no session / hold no group):
    # begin_weight_update(), end_weight_update(), destroy_weights_update_group(group_name=...),
    # server_info() -> dict (``tp_size``: ranks it joins the group with; ``moe_rl_checksum``)


def check_reply(engine: str, endpoint: str, reply: Any) -> Any:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineCallError(f"{engine} {endpoint}: {reply.get('message', 'failed')}")
    if isinstance(reply, (tuple, list)) and len(reply) == 2 and isinstance(reply[0], bool) and not reply[0]:
        raise EngineCallError(f"{engine} {endpoint}: {reply[1]}")
    return reply


class _Adapter:
    """Wraps an engine-client object: awaits its methods (sync or async) and checks replies."""

    def __init__(self, client: Any):
        self.client = client
        self.name = str(getattr(client, "name", None) or getattr(client, "url", None) or type(client).__name__)
        self.num_ranks = int(getattr(client, "num_ranks", 1))
        self.owned_client = None

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

    def has(self, method: str) -> bool:
        return callable(getattr(self.client, method, None))

    async def begin_weight_update(self):
        """SGLang >= 0.5.23 refuses /update_weights_from_distributed outside a begin/end weight-update pair."""
        if self.has("begin_weight_update"):
            return await self._call("begin_weight_update")

    async def end_weight_update(self):
        if self.has("end_weight_update"):
            return await self._call("end_weight_update")

    async def destroy_weights_update_group(self, group_name: str):
        if self.has("destroy_weights_update_group"):
            return await self._call("destroy_weights_update_group", group_name=group_name)

    async def server_info(self) -> dict:
        """The engine's /get_server_info (``{}`` when it has none); sets ``num_ranks`` from its
        ``tp_size``: an SGLang server joins the weight-sync group with every TP rank."""
        if not self.has("server_info"):
            return {}
        info = await self._call("server_info")
        info = info if isinstance(info, dict) else {}
        if "tp_size" in info:
            self.num_ranks = int(info["tp_size"])
        return info


def as_engine(e: Any, api_key: str | None = None, timeout_s: float = 600.0):
    """An ``EngineAPI`` for a URL, an engine-client handle or an object with the methods. For a
    URL the adapter owns its client (``owned_client``, to be closed by whoever made it)."""
    if isinstance(e, _Adapter):
        return e
    if isinstance(e, str):
        from moe_rl.engine.client import EngineClient

        client = EngineClient(e, api_key=api_key, timeout_s=timeout_s)
        a = _Adapter(client.engine(e))
        a.owned_client = client
        return a
    return _Adapter(e)

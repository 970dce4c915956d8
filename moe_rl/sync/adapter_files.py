"""``lora.sync=adapter`` against SGLang servers (``engine.kind=sglang``): the adapter goes as a
PEFT directory through SGLang's LoRA endpoints, not through the bucketed broadcast.

After each optimizer step the trainer's lead writes the adapter in the per-expert layout SGLang's
loader reads (``save_peft(layout="per_expert")``: ``...mlp.experts.{e}.{gate,up,down}_proj``,
attention ``...self_attn.{q,k,v,o}_proj``; with ``lora.experts_shared_outer`` SGLang's 3-D
shared-outer form, ``save_peft(layout="shared_outer")``) to ``<dir>/moe-rl-v<version>``, then on
every engine:

1. ``/pause_generation`` (abort): in-flight requests stop; the rollout manager resubmits them
   after the update (its gate is closed meanwhile, so no request names an adapter mid-switch);
2. ``/load_lora_adapter`` ``{lora_name: moe-rl-v<version>, lora_path}``: a new name per version
   (SGLang binds a request to its adapter by name, so the old one stays intact until unloaded);
3. ``/update_weight_version`` ``{new_version, abort_all_requests: false}``: tokens are tagged with
   the version the adapter was trained to (the trainer's staleness bookkeeping reads it);
4. ``/continue_generation``; the rollouts' ``lora_path`` becomes the new name (``lora_name``);
5. ``/unload_lora_adapter`` of the previous name (SGLang waits for requests still using it:
   none, they were aborted in 1), and its directory is deleted.

A failure in 2 or 3 leaves every engine on the previous adapter: the new name is unloaded where
it was loaded, ``lora_name`` does not change, and the error is raised (the same all-or-nothing
rule as a weight sync). Only the lead trainer rank writes and calls; the adapters are the same
on every DP rank.
"""
from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

from moe_rl.engine.client import EngineClient
from moe_rl.model.lora import LoraAdapters, save_peft

from .receiver import WeightSyncError
from .sender import SyncStats

log = logging.getLogger(__name__)

NAME_PREFIX = "moe-rl-v"


class AdapterFileSync:
    """The weight sender of ``lora.sync=adapter`` with SGLang engines (same ``sync``/``close``
    interface as ``WeightSender``). ``lora_name`` is the adapter the rollouts must name."""

    def __init__(self, adapters: LoraAdapters, urls, out_dir: str | Path, *, is_source: bool = True,
                 api_key: str | None = None, timeout_s: float = 600.0):
        self.adapters, self.urls, self.dir = adapters, list(urls), Path(out_dir)
        self.is_source, self.api_key, self.timeout_s = is_source, api_key, timeout_s
        self.lora_name: str | None = None  # None: the base model (the adapter's B = 0 at init)

    def sync(self, version) -> SyncStats | None:
        if not self.is_source:
            return None
        return asyncio.run(self.sync_async(version))

    async def sync_async(self, version) -> SyncStats:
        t0 = time.perf_counter()
        name = f"{NAME_PREFIX}{version}"
        # SGLang's shared-outer form keeps the shared factors once (a server started with
        # --experts-shared-outer-loras); otherwise one module per expert
        layout = "shared_outer" if self.adapters.shared_outer else "per_expert"
        path = save_peft(self.adapters, self.dir / name, layout=layout)
        async with EngineClient(self.urls, api_key=self.api_key, timeout_s=self.timeout_s) as c:
            await self._each(c, "/pause_generation", {"mode": "abort"})
            loaded: list[str] = []
            try:
                for url in self.urls:  # one by one, so a failure knows where the new name is
                    await self._call(c, url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
                    loaded.append(url)
                await self._each(c, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
            except BaseException:
                await asyncio.gather(*(self._call(c, u, "/unload_lora_adapter", {"lora_name": name}) for u in loaded),
                                     return_exceptions=True)
                shutil.rmtree(path, ignore_errors=True)
                raise
            finally:
                await self._each(c, "/continue_generation", {})
            old, self.lora_name = self.lora_name, name
            if old is not None:
                await self._each(c, "/unload_lora_adapter", {"lora_name": old})
                shutil.rmtree(self.dir / old, ignore_errors=True)
        nbytes = sum(f.stat().st_size for f in path.iterdir())
        return SyncStats(version=str(version), buckets=0, bytes=nbytes, seconds=time.perf_counter() - t0)

    async def _each(self, c: EngineClient, endpoint: str, body: dict) -> None:
        await asyncio.gather(*(self._call(c, u, endpoint, body) for u in self.urls))

    @staticmethod
    async def _call(c: EngineClient, url: str, endpoint: str, body: dict):
        reply = await c.request("POST", endpoint, url, body)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise WeightSyncError(f"{url}{endpoint}: {reply.get('error_message') or reply.get('message') or reply}")
        return reply

    def close(self) -> None:
        pass

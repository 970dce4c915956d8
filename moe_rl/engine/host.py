"""An engine rank of the torchrun world: serves an embedded engine until the trainers finish.

Its URL reaches the trainers through one all_gather_object over the world (the default group,
with dist.wait_timeout_s: the trainers may take long to load their models); it stops when every trainer rank has
counted itself done in the world's store (moe_rl.liveness: no collective, so no timeout however
long the run).
"""
from __future__ import annotations

import asyncio
import logging
import threading

import torch
import torch.distributed as dist

from moe_rl.dist import set_default_timeout
from moe_rl.gc_control import freeze_gc

log = logging.getLogger(__name__)


def exchange_urls(my_url: str | None, timeout_s: float | None = None) -> list[str]:
    """Collective over the whole world (its default group, whose timeout is dist.wait_timeout_s
    while the ranks start: moe_rl.dist): every engine rank's URL, in rank order. The start is
    over then: the default group's timeout becomes ``timeout_s`` (dist.timeout_s), so no wait on
    the world can outlast it from here (the end of the run is a store key: moe_rl.liveness)."""
    urls: list = [None] * dist.get_world_size()
    dist.all_gather_object(urls, my_url)
    if timeout_s is not None:
        set_default_timeout(timeout_s)
    return [u for u in urls if u]


def run_engine_host(cfg, groups) -> None:
    # here, not at the top: the trainer ranks import this module for exchange_urls alone
    from .limits import ServerLimits
    from .server import build_engine, start_server

    e = cfg.engine
    index = groups.layout.rollout_ranks.index(groups.rank)
    port = 0 if e.port == 0 else e.port + index
    loop = asyncio.new_event_loop()
    # the launcher set this rank's GPU from the placement (moe_rl.placement)
    engine = build_engine(cfg, device=f"cuda:{torch.cuda.current_device()}" if cfg.train.device == "cuda" else None)
    freeze_gc()  # weight updates decode thousands of small lists: see moe_rl.gc_control
    runner, url = loop.run_until_complete(start_server(engine, e.host, port, e.api_key, ServerLimits.for_engine(engine, e)))
    thread = threading.Thread(target=loop.run_forever, name="engine-http", daemon=True)
    thread.start()
    log.info("embedded engine %d listening on %s", index, url)
    try:
        exchange_urls(url, cfg.dist.timeout_s)
        groups.liveness.wait_for_trainers()
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        engine.stop()

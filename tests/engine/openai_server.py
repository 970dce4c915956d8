"""An embedded engine behind ``moe-rl serve``'s application, in this process (its own event
loop thread), with the OpenAI-agent example's tokenizer and chat template."""
from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

from moe_rl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "openai_agent"
CONFIG = str(ROOT / "configs" / "openai_agent.yaml")
OVERRIDES = ["engine.threads=1", f"model.tokenizer_path={EXAMPLE / 'tokenizer'}"]
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))


class InProcessServer:
    def __init__(self, overrides=(), cfg=None):
        from moe_rl.engine.server import build_engine, start_server

        self.cfg = cfg if cfg is not None else load_config(CONFIG, [*OVERRIDES, *overrides])
        self.engine = build_engine(self.cfg)
        self.loop = asyncio.new_event_loop()
        ready, box = threading.Event(), {}

        def run():
            asyncio.set_event_loop(self.loop)
            box["runner"], box["url"] = self.loop.run_until_complete(start_server(self.engine, "127.0.0.1", 0))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(60), "server did not start"
        self.runner, self.url = box["runner"], box["url"]

    def call(self, coro, timeout: float = 120):
        """Runs ``coro`` on the server's loop (e.g. an agent runner sharing it)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.engine.stop()


async def serve(app):
    """Serves an aiohttp app on a free loopback port as the engine's servers do: (runner, URL)."""
    from moe_rl.engine.limits import MIB, ServerLimits

    return await ServerLimits(MIB).serve(app, "127.0.0.1", 0)

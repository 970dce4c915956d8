"""An HTTP stand-in for an SGLang server with tp_size 2, for a whole ``moe-rl train`` run:
generation is the embedded engine's (``moe_rl.engine.server``), the weight sync is SGLang's own
code in two TP-rank processes (``standin.TPRanks``: ``init_custom_process_group`` at
rank_offset + tp_rank, ``FlattenedTensorBucket``), with SGLang's rules (session required,
destroy before re-forming, no ``checksum`` support) and every request body checked against
SGLang's io_struct field lists. At ``/end_weight_update`` it checks that both TP ranks got the
same bits, loads them into the engine (so rollouts use them) and saves TP rank 0's tensors to
``OUT/received.pt`` with the version; ``OUT/log.jsonl`` records every request.

    python -m tests.sglang.standin_server CONFIG OUT [key=value ...]
"""
from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import torch
from aiohttp import web

from moe_rl.config import load_config
from moe_rl.engine.protocol import json_body
from moe_rl.engine.server import EngineServer, build_engine
from moe_rl.model import iter_local_hf_tensors

from .conftest import check_request
from .standin import TPRanks


class StandInServer(EngineServer):
    def __init__(self, engine, ranks: TPRanks, out: Path):
        super().__init__(engine)
        self.ranks, self.out, self.version = ranks, out, None
        self.log = open(out / "log.jsonl", "a")

    def _record(self, kind: str, body: dict) -> None:
        small = {k: v for k, v in body.items() if k not in ("names", "dtypes", "shapes", "input_ids")}
        self.log.write(json.dumps({"kind": kind, **small}) + "\n")
        self.log.flush()

    async def _body(self, request, cls: str) -> dict:
        body = json_body(request, optional=True)  # as the server's middleware parsed it
        check_request(cls, body or {})
        return body or {}

    async def _ranks(self, cmd: str, body: dict) -> web.Response:
        replies = await asyncio.to_thread(self.ranks.all, cmd, body)
        bad = [m for ok, m in replies if not ok]
        ok = not bad
        return web.json_response({"success": ok, "message": bad[0] if bad else replies[0][1]}, status=200 if ok else 400)

    async def generate(self, request):
        body = await request.json()
        check_request("GenerateReqInput", body)
        return await super().generate(request)

    async def get_server_info(self, request):
        return web.json_response({"tp_size": self.ranks.tp_size, "dp_size": 1, "weight_version": self.engine.weight_version,
                                  "version": "sglang-standin"})

    async def init_weights_update_group(self, request):
        body = await self._body(request, "InitWeightsUpdateGroupReqInput")
        self._record("init", body)
        return await self._ranks("init", body)

    async def destroy_weights_update_group(self, request):
        body = await self._body(request, "DestroyWeightsUpdateGroupReqInput")
        self._record("destroy", body)
        return await self._ranks("destroy", body)

    async def begin_weight_update(self, request):
        await self._body(request, "BeginWeightUpdateReqInput")
        self._record("begin", {})
        if self.session_open:
            return web.json_response({"success": False, "message": "a weight-update session is already open"}, status=400)
        self.session_open = True
        return web.json_response({"success": True, "message": "Success"})

    async def update_weights_from_distributed(self, request):
        body = await self._body(request, "UpdateWeightsFromDistributedReqInput")
        self._record("update", body)
        if not self.session_open:
            return web.json_response({"success": False, "message": "update_weights_from_distributed must run between "
                                      "begin_weight_update() and end_weight_update()"}, status=400)
        self.version = body.get("weight_version")
        return await self._ranks("update", body)

    async def end_weight_update(self, request):
        await self._body(request, "EndWeightUpdateReqInput")
        self._record("end", {})
        if not self.session_open:
            return web.json_response({"success": False, "message": "no weight-update session is open"}, status=400)
        self.session_open = False
        got = [w for _, w in await asyncio.to_thread(self.ranks.all, "get", {})]
        same = all(a.keys() == got[0].keys() and all(torch.equal(a[n].view(torch.uint8), got[0][n].view(torch.uint8))
                                                    for n in a) for a in got)
        params = dict(iter_local_hf_tensors(self.engine.model))
        if not same or got[0].keys() != params.keys():
            return web.json_response({"success": False, "message": "TP ranks disagree or miss tensors"}, status=400)

        def load():
            with torch.no_grad():
                for n, t in got[0].items():
                    params[n].copy_(t)

        await asyncio.to_thread(self.engine.commit_weights, load, self.version)
        torch.save({"version": self.version, "tensors": got[0]}, self.out / "received.tmp")
        (self.out / "received.tmp").replace(self.out / "received.pt")
        self._record("loaded", {"version": self.version, "tp_ranks_equal": same})
        return web.json_response({"success": True, "message": "Success"})


async def main(argv: list[str]) -> None:
    cfg = load_config(argv[0], argv[2:])
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    ranks = TPRanks(2)
    engine = build_engine(cfg)
    engine.start()
    runner = web.AppRunner(StandInServer(engine, ranks, out).app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"moe-rl engine listening on http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)  # run the cleanup below
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        engine.stop()
        ranks.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))

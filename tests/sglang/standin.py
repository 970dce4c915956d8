"""A stand-in for one SGLang server with tp_size 2, built on SGLang's own code: each TP rank is
a process that joins the weight-sync group with ``sglang.srt.utils.common.init_custom_process_group``
(rank = rank_offset + tp_rank, inside a default TP process group, as SGLang's model runner)
and receives buckets into ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket``.
``SGLangStandIn`` is the trainer-side ``EngineAPI``: it keeps SGLang's rules (a session is
needed around updates, a group name cannot be re-formed before it is destroyed) and checks
every request body against SGLang's io_struct field lists (``check_request``)."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading

from .conftest import check_request


def _tp_rank(conn, tp_rank: int, tp_size: int, tp_port: int) -> None:
    import torch
    import torch.distributed as dist
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=tp_rank, world_size=tp_size)
    import os

    parent = os.getppid()
    groups, weights = {}, {}
    conn.send("ready")
    while True:
        # a sibling inherited this pipe's other end, so the parent's death is no EOF here:
        # poll, and leave once the parent is gone
        if not conn.poll(1.0):
            if os.getppid() != parent:
                return
            continue
        cmd, kw = conn.recv()
        try:
            if cmd == "stop":
                conn.send((True, "bye"))
                return
            if cmd == "init":
                groups[kw["group_name"]] = init_custom_process_group(
                    backend=kw["backend"], init_method=f"tcp://{kw['master_address']}:{kw['master_port']}",
                    world_size=kw["world_size"], rank=kw["rank_offset"] + tp_rank, group_name=kw["group_name"])
                conn.send((True, "Succeeded to initialize custom process group."))
            elif cmd == "destroy":
                if kw["group_name"] not in groups:
                    conn.send((False, "The group to be destroyed does not exist."))
                else:
                    dist.destroy_process_group(groups.pop(kw["group_name"]))
                    conn.send((True, "Succeeded to destroy custom process group."))
            elif cmd == "update":
                pg = groups[kw["group_name"]]
                if kw.get("load_format") == "flattened_bucket":
                    bucket = FlattenedTensorBucket.empty(kw["names"], kw["dtypes"], kw["shapes"], "cpu")
                    dist.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
                    got = bucket.reconstruct_tensors()
                else:
                    got = [(n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in
                           zip(kw["names"], kw["dtypes"], kw["shapes"])]
                    for h in [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in got]:
                        h.wait()
                weights.update((n, t.clone()) for n, t in got)
                conn.send((True, "Succeeded to update parameter online."))
            elif cmd == "get":
                conn.send((True, weights))
        except Exception as e:  # SGLang answers {"success": false, "message"}
            conn.send((False, f"{type(e).__name__}: {e}"))


class TPRanks:
    """The ``tp_size`` rank processes of one stand-in server; ``all(cmd, kw)`` runs a command on
    every rank and returns their (ok, result) replies."""

    def __init__(self, tp_size: int = 2):
        from moe_rl.sync.group import free_port

        # fork: the TP ranks start with sglang already imported (a spawn re-imports it: ~20 s
        # per process on 2 busy cores); no process group exists in the parent at this point
        import sglang.srt.utils.common  # noqa: F401
        import sglang.srt.weight_sync.tensor_bucket  # noqa: F401

        ctx = mp.get_context("fork")
        self.tp_size = tp_size
        self.pipes, self.procs = [], []
        port = free_port()
        for r in range(tp_size):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_tp_rank, args=(b, r, tp_size, port), daemon=True)
            p.start()
            self.pipes.append(a)
            self.procs.append(p)
        for a in self.pipes:
            if not a.poll(120):
                raise RuntimeError("SGLang TP rank did not start")
            assert a.recv() == "ready"
        self._lock = threading.Lock()

    def all(self, cmd: str, kw: dict) -> list:
        with self._lock:
            for a in self.pipes:
                a.send((cmd, kw))
            return [a.recv() for a in self.pipes]

    def close(self) -> None:
        try:
            self.all("stop", {})
        except Exception:
            pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


class SGLangStandIn:
    """One SGLang server (``tp_size`` ranks) as an ``EngineAPI`` object."""

    def __init__(self, name: str = "sglang-standin", tp_size: int = 2):
        self.name, self.tp_size, self.num_ranks = name, tp_size, 1  # num_ranks: learnt from server_info
        self.ranks = TPRanks(tp_size)
        self.session = False
        self.requests: list[tuple[str, dict]] = []

    def _all(self, cmd: str, kw: dict) -> list:
        return self.ranks.all(cmd, kw)

    async def _call(self, cmd: str, kw: dict) -> dict:
        replies = await asyncio.get_running_loop().run_in_executor(None, self._all, cmd, kw)
        bad = [m for ok, m in replies if not ok]
        return {"success": not bad, "message": bad[0] if bad else replies[0][1]}

    async def server_info(self):
        return {"tp_size": self.tp_size, "version": "sglang-standin"}

    async def init_weights_update_group(self, **body):
        check_request("InitWeightsUpdateGroupReqInput", body)
        self.requests.append(("init", body))
        return await self._call("init", body)

    async def destroy_weights_update_group(self, **body):
        check_request("DestroyWeightsUpdateGroupReqInput", body)
        self.requests.append(("destroy", body))
        return await self._call("destroy", body)

    async def begin_weight_update(self):
        if self.session:
            return {"success": False, "message": "a weight-update session is already open"}
        self.session = True
        self.requests.append(("begin", {}))
        return {"success": True, "message": "Success"}

    async def end_weight_update(self):
        if not self.session:
            return {"success": False, "message": "no weight-update session is open"}
        self.session = False
        self.requests.append(("end", {}))
        return {"success": True, "message": "Success"}

    async def update_weights_from_distributed(self, **body):
        check_request("UpdateWeightsFromDistributedReqInput", body)
        self.requests.append(("update", {k: v for k, v in body.items() if k not in ("names", "shapes", "dtypes")}))
        if not self.session:  # SGLang 0.5.23: fails without a session (the sender then times out)
            return {"success": False, "message": "update_weights_from_distributed must run between "
                    "begin_weight_update() and end_weight_update()"}
        return await self._call("update", body)

    async def pause_generation(self, mode: str = "abort"):
        check_request("PauseGenerationReqInput", {"mode": mode})
        return {"success": True}

    async def continue_generation(self):
        return {"success": True}

    def received(self) -> list[dict]:
        """Every TP rank's received tensors, by name."""
        return [w for _, w in self._all("get", {})]

    def close(self) -> None:
        self.ranks.close()

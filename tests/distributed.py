"""Runs a test function in N gloo processes (spawned, free port) and re-raises failures."""
from __future__ import annotations

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def process_context():
    """The multiprocessing context of the tests' rank and server processes: a fork server that
    imported torch and the model once, so each process starts without importing them again (a
    spawned one spent seconds of CPU on it). The server is started by the first process, with the
    environment of that moment; pass what a process needs through its arguments."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.distributed", "moe_rl.model", "moe_rl.sync"])
    return ctx


def run_distributed(fn, world: int, *args, timeout: float = 120) -> None:
    """fn(rank, world, *args) must be a module-level function (it is pickled)."""
    ctx = process_context()
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if alive:
        raise AssertionError(f"{len(alive)} ranks did not finish within {timeout}s")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with codes {bad}")

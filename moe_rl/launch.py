"""torchrun entry point: ``torchrun --nproc-per-node N -m moe_rl.launch CONFIG [key=value ...]``.

Initialises torch.distributed, builds the process groups and runs this rank's role.
``moe-rl train CONFIG`` starts the local world through torchrun's launcher itself.

Run safety (docs/run_safety.md): a worker dies with its launcher (moe_rl.lifetime); the run's
owner claims output_dir before any rank touches it (moe_rl.rundir: the ``moe-rl train``
launcher, or global rank 0 of a bare torchrun world); every rank then holds the directory's
writers lock for its life, so the next run waits for the last of them.

Long runs (docs/run_safety.md): every rank beats a heartbeat that a peer watches, so a frozen
rank ends the run with an error naming it (moe_rl.liveness); collectives have two timeouts
(``dist.timeout_s``, ``dist.wait_timeout_s``: moe_rl.dist), and the end of the run is a store key.
"""
from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist

from . import faults
from .config import ConfigError, load_config
from .dist import Layout, build_groups, init_distributed
from .lifetime import die_with_parent, exit_without_teardown
from .liveness import Liveness, describe, record_failure
from .placement import resolve_placement
from .rundir import LAUNCHER_ENV, RunDirError, claim_output_dir, hold_as_writer

log = logging.getLogger("moe_rl")
_held: list = []  # the run's locks, held until this process exits


def run_role(cfg, groups) -> None:
    """Runs the trainer or the engine host, as the layout says for this rank."""
    if groups.is_trainer:
        from .train.loop import run_trainer

        run_trainer(cfg, groups)
    else:
        from .engine.host import run_engine_host

        run_engine_host(cfg, groups)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher = os.environ.get(LAUNCHER_ENV)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: gone as soon as its agent is
        die_with_parent(int(launcher) if launcher else None)
    if not argv:
        print("usage: python -m moe_rl.launch CONFIG [key.sub=value ...]", file=sys.stderr)
        return 2
    try:
        cfg = load_config(argv[0], argv[1:])
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.logging.level,
        format=f"[%(asctime)s rank{os.environ.get('RANK', '0')} %(name)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        placement = resolve_placement(cfg, torch.cuda.device_count() if cfg.train.device == "cuda" else 0)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", 0))
    if rank == 0 and launcher != str(os.getppid()):  # no `moe-rl train` launcher claimed output_dir for us
        try:
            _held.extend(claim_output_dir(cfg))
        except RunDirError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    faults.arm(cfg.fault, rank)
    init_distributed(cfg.train.device, timeout_s=cfg.dist.wait_timeout_s, gpu=placement.gpu(rank))
    _held.append(hold_as_writer(cfg.output_dir))  # after the rendezvous: rank 0 has claimed the directory
    live = Liveness.from_env(rank, Layout.from_config(cfg), cfg.dist.peer_timeout_s).start()
    if rank == 0:
        log.info("collectives time out after %g s (dist.timeout_s), long waits after %g s (dist.wait_timeout_s); "
                 "a rank silent for %g s is frozen (dist.peer_timeout_s)", cfg.dist.timeout_s,
                 cfg.dist.wait_timeout_s, cfg.dist.peer_timeout_s)
    if placement.device == "cuda":
        log.info("rank %d on GPU %d%s; weight sync over %s", rank, placement.gpu(rank),
                 " (shared with another rank)" if placement.shares_gpu(rank) else "", placement.sync_backend)
    try:
        groups = build_groups(cfg)
        groups.liveness = live
        log.info("role=%s rank=%d/%d", groups.role, groups.rank, groups.layout.world_size)
        run_role(cfg, groups)
    except Exception as e:  # the launcher prints why this rank failed (moe_rl/cli.py)
        record_failure(describe(e))
        raise
    finally:
        live.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # a rank that is done ends without the interpreter's teardown (1.3 s of a trainer's exit)
    exit_without_teardown(main())

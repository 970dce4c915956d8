"""torchrun entry point: ``torchrun --nproc-per-node N -m moe_rl.launch CONFIG [key=value ...]``.

Initialises torch.distributed, builds the process groups and runs this rank's role.
``moe-rl train CONFIG`` starts the local world through torchrun's launcher itself.
"""
from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist

from .config import ConfigError, load_config
from .dist import build_groups, init_distributed
from .placement import resolve_placement

log = logging.getLogger("moe_rl")


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
    init_distributed(cfg.train.device, gpu=placement.gpu(rank))
    if placement.device == "cuda":
        log.info("rank %d on GPU %d%s; weight sync over %s", rank, placement.gpu(rank),
                 " (shared with another rank)" if placement.shares_gpu(rank) else "", placement.sync_backend)
    try:
        groups = build_groups(cfg)
        log.info("role=%s rank=%d/%d", groups.role, groups.rank, groups.layout.world_size)
        run_role(cfg, groups)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

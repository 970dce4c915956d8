"""Roles and process groups of the torchrun world.

Ranks [0, pools.trainer) are trainers, the next pools.rollout ranks host embedded engines.
Inside the trainer pool, expert parallelism shards experts over contiguous blocks of
``train.ep_size`` ranks (the EP group); ranks at the same position of every block form the
expert-data-parallel group, over which expert gradients are all-reduced. Dense gradients are
all-reduced over the whole trainer pool. The weight-sync group (trainer rank 0 + engines) is
made by ``moe_rl.sync`` through the engines' ``/init_weights_update_group``, as with SGLang.

Two timeouts (``cfg.dist``, docs/run_safety.md "Long runs"): the groups above carry
``dist.timeout_s``, for collectives whose ranks arrive together. A collective where ranks wait
long for one of them runs on a group whose timeout is ``dist.wait_timeout_s``: the world's
default group while the ranks start (they meet there, and exchange the engines' URLs, while the
models load; then it takes ``dist.timeout_s``: ``set_default_timeout``) and the *wait* groups
of the trainer pool and of each EP group (the trainers wait for rank 0's rollouts, checkpoint
writes and weight syncs). A frozen rank is caught sooner by moe_rl.liveness. The end of the run
is no collective at all (a store key, moe_rl.liveness).
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """Who is who, computable without any communication (tests use it directly)."""

    world_size: int
    trainer_ranks: list[int]
    rollout_ranks: list[int]
    ep_size: int

    @classmethod
    def from_config(cls, cfg) -> "Layout":
        T = cfg.pools.trainer
        R = cfg.world_size - T
        return cls(T + R, list(range(T)), list(range(T, T + R)), cfg.train.ep_size)

    def role(self, rank: int) -> str:
        return "trainer" if rank in self.trainer_ranks else "rollout"

    @property
    def ep_groups(self) -> list[list[int]]:
        t, e = self.trainer_ranks, self.ep_size
        return [t[i : i + e] for i in range(0, len(t), e)]

    @property
    def expert_dp_groups(self) -> list[list[int]]:
        blocks = self.ep_groups
        return [[b[j] for b in blocks] for j in range(self.ep_size)]


@dataclass
class Groups:
    layout: Layout
    rank: int
    role: str
    trainer: object | None = None  # ProcessGroup over the trainer pool
    rollout: object | None = None
    ep: object | None = None  # this trainer's EP group
    expert_dp: object | None = None  # this trainer's expert-data-parallel group
    ep_rank: int = 0
    dp_rank: int = 0  # index of this trainer's EP block (= rank in expert_dp)
    # the same ranks as trainer / ep, with dist.wait_timeout_s: for the long waits
    trainer_wait: object | None = None
    ep_wait: object | None = None
    liveness: object | None = None  # this rank's moe_rl.liveness.Liveness (heartbeats), when running in a world
    extra: dict = field(default_factory=dict)

    @property
    def is_trainer(self) -> bool:
        return self.role == "trainer"

    @property
    def dp_size(self) -> int:
        return len(self.layout.ep_groups)


def backend_for(device: str) -> str:
    """CUDA: NCCL for CUDA tensors (the trainers' gradients) and gloo for CPU objects (URL
    exchange, barriers), so ranks sharing a GPU (moe_rl.placement) never form an NCCL
    communicator unless they exchange CUDA tensors. CPU: gloo. No silent fallback."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def init_distributed(device: str = "cpu", timeout_s: float = 1800, gpu: int | None = None) -> tuple[int, int]:
    """Initialises the default group from torchrun's environment; returns (rank, world_size).
    ``timeout_s``: its timeout (a run passes ``dist.wait_timeout_s``: the ranks meet on it while
    they start and load models); ``gpu``: this rank's GPU (moe_rl.placement); default LOCAL_RANK."""
    if not dist.is_initialized():
        backend = backend_for(device)
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) if gpu is None else gpu)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def set_default_timeout(timeout_s: float) -> None:
    """The default group's timeout from now on (torch sets it only when the group is made; its
    setter is private: without it the group keeps the timeout it was made with, logged)."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        log.warning("this torch cannot change a group's timeout: the world's default group keeps dist.wait_timeout_s")
        return
    setter(datetime.timedelta(seconds=timeout_s))


def build_groups(cfg) -> Groups:
    """Creates every group on every rank (collective: all ranks call new_group in one order)."""
    timeout, wait = (datetime.timedelta(seconds=t) for t in (cfg.dist.timeout_s, cfg.dist.wait_timeout_s))
    layout = Layout.from_config(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != layout.world_size:
        raise RuntimeError(
            f"the config implies {layout.world_size} ranks (pools.trainer={cfg.pools.trainer}"
            f" + pools.rollout={layout.world_size - cfg.pools.trainer}), but the world has {world}"
        )
    g = Groups(layout=layout, rank=rank, role=layout.role(rank))
    g.trainer = dist.new_group(layout.trainer_ranks, timeout=timeout)
    g.rollout = dist.new_group(layout.rollout_ranks, timeout=timeout) if layout.rollout_ranks else None
    g.trainer_wait = dist.new_group(layout.trainer_ranks, timeout=wait)
    for i, ranks in enumerate(layout.ep_groups):
        pg = dist.new_group(ranks, timeout=timeout)
        pg_wait = dist.new_group(ranks, timeout=wait)
        if rank in ranks:
            g.ep, g.ep_rank, g.dp_rank, g.ep_wait = pg, ranks.index(rank), i, pg_wait
    for ranks in layout.expert_dp_groups:
        pg = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            g.expert_dp = pg
    return g

"""Role assignment and process groups of the torchrun world, and their timeouts."""
import time

import pytest
import torch
import torch.distributed as dist

from moe_rl.config import load_config
from moe_rl.dist import Layout, build_groups, set_default_timeout
from tests.distributed import run_distributed


def test_layout_groups():
    cfg = load_config("configs/tiny.yaml", ["pools.trainer=4", "pools.rollout=2", "train.ep_size=2"])
    lay = Layout.from_config(cfg)
    assert lay.world_size == 6
    assert lay.trainer_ranks == [0, 1, 2, 3] and lay.rollout_ranks == [4, 5]
    assert lay.ep_groups == [[0, 1], [2, 3]]
    assert lay.expert_dp_groups == [[0, 2], [1, 3]]
    assert [lay.role(r) for r in range(6)] == ["trainer"] * 4 + ["rollout"] * 2


def test_sglang_engines_take_no_ranks():
    cfg = load_config("configs/tiny.yaml", ["engine.kind=sglang", "engine.urls=[http://127.0.0.1:30000]",
                                             "pools.trainer=2"])
    assert cfg.world_size == 2


def _check_groups(rank, world):
    cfg = load_config("configs/tiny.yaml", ["pools.trainer=4", "pools.rollout=1", "train.ep_size=2",
                                             "dist.timeout_s=1", "dist.wait_timeout_s=60"])
    g = build_groups(cfg)
    assert g.role == ("trainer" if rank < 4 else "rollout")
    if g.is_trainer:
        # membership checked by communication, not by reading our own bookkeeping back
        members = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(members, torch.tensor([float(rank)]), group=g.ep)
        assert sorted(int(m) for m in members) == [rank - rank % 2, rank - rank % 2 + 1]
        dist.all_gather(members, torch.tensor([float(rank)]), group=g.expert_dp)
        assert sorted(int(m) for m in members) == [rank % 2, rank % 2 + 2]
        t = torch.ones(1)
        dist.all_reduce(t, group=g.trainer)
        assert t.item() == 4
        assert g.ep_rank == rank % 2 and g.dp_rank == rank // 2
    else:
        assert g.ep is None and g.expert_dp is None
    dist.barrier()
    # the timeouts: a wait group waits out a late rank; after the start (moe_rl.engine.host.
    # exchange_urls) the default group fails a wait longer than dist.timeout_s
    set_default_timeout(cfg.dist.timeout_s)
    if g.is_trainer:
        if rank == 3:
            time.sleep(2)
        dist.barrier(group=g.trainer_wait)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as failed:
            dist.barrier()  # the engine rank never comes
        assert time.monotonic() - t0 < 2 * cfg.dist.timeout_s + 1
        # gloo closes a pair when its wait times out, so a trainer that a loaded machine let in
        # late hears of its peers' timeouts as a closed connection; at least one times out itself
        message = str(failed.value)
        timed_out = "imed out" in message
        assert timed_out or "Connection closed by peer" in message, message
        seen = [torch.zeros(1) for _ in range(4)]
        dist.all_gather(seen, torch.tensor([float(timed_out)]), group=g.trainer_wait)
        assert any(s.item() for s in seen)
    else:  # stays up (its exit would close the trainers' connections) until they have timed out:
        time.sleep(2 + 2 * cfg.dist.timeout_s + 3)  # rank 3's lateness, their bound, a loaded machine's margin


def test_groups_over_five_ranks():
    run_distributed(_check_groups, 5)


"""The algorithm family end to end: a `moe-rl train` world with GSPO, RLOO, token_sum_norm,
overlong shaping, two optimizer updates per batch and dynamic sampling on (at the start of the
echo task most groups score all zeros, so groups are dropped and replaced)."""
import pytest
import torch

from moe_rl.train.tracking import read_metrics
from tests.train.test_main_job import train


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
def test_gspo_rloo_dynamic_sampling_world_accounts_for_every_prompt(tmp_path):
    out, _ = train(tmp_path, "train.steps=4", "algo.policy_loss=gspo", "algo.advantage=rloo",
                   "algo.loss_agg=token_sum_norm", "algo.overlong_buffer=4", "rollout.dynamic_sampling=true",
                   "rollout.max_sampling_rounds=2", "rollout.max_staleness=1", "train.minibatches=2")
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 1 <= r["dyn_rounds"] <= 2 and 0 <= r["dyn_shortfall"] <= 8
        assert len(r["groups"]) == max(8 - r["dyn_shortfall"], 1)
        assert r["samples"] == 4 * (len(r["groups"]) + r["dyn_dropped_groups"])
        assert r["staleness_max"] <= 1 and torch.isfinite(torch.tensor(r["loss"]))
        # dynamic sampling trains on groups with signal only, unless none had any (then on one)
        assert r["constant_reward_groups"] <= (0 if r["dyn_shortfall"] < 8 else 1)
    assert sum(r["dyn_dropped_groups"] for r in rows) > 0
    consumed = [g for r in rows for g in r["groups"]] + [g for r in rows for g in r["dyn_dropped_ids"]]
    assert len(consumed) == len(set(consumed)), "a prompt group was taken twice"
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    rollout = torch.load(ckpt / "rollout.pt", weights_only=False)
    buffered = [g["group_id"] for g in rollout["buffer"]["groups"]]
    accounted = consumed + buffered + rollout["pending"] + rollout["buffer"]["dropped_ids"]
    assert sorted(accounted) == list(range(rollout["next_index"]))

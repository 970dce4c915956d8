"""DAPO dynamic sampling with the asynchronous buffer: groups without reward signal are dropped
and replaced, the staleness bound holds, nothing is trained on twice, shortfalls are counted."""
import random

import pytest

from moe_rl.train.loop import take_groups
from tests.rollout.test_manager import CountingTask, make, update_weights


class SomeFlatTask(CountingTask):
    """Prompts whose index is in ``flat`` (a callable) give every sample the same reward; the
    others a random one (a group with signal)."""

    def __init__(self, flat):
        super().__init__()
        self.flat = flat

    def reward(self, prompt, response_ids):
        return 1.0 if self.flat(prompt.index) else random.random()


def flat_of(groups):
    return [g for g in groups if len({s.reward for s in g.samples}) == 1]


@pytest.mark.parametrize("eta", [0, 2])
def test_dropped_groups_are_replaced_within_the_staleness_bound(eta):
    B = 4
    cfg, engines, buffer, m = make(eta, SomeFlatTask(lambda i: i % 3 == 0), B=B, n=3,
                                   overrides=["rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=10"])
    m.start()
    seen, dropped = [], 0
    try:
        for v in range(6):
            kept, taken, dyn = take_groups(cfg, buffer, m, v, timeout=30)
            assert len(kept) == B and not flat_of(kept)  # a third of the prompts are flat
            assert all(g.min_version >= v - eta for g in taken)
            assert dyn["dyn_dropped_groups"] == len(flat_of(taken)) == len(taken) - B
            assert sorted(dyn["dyn_dropped_ids"]) == sorted(g.group_id for g in flat_of(taken))
            assert dyn["dyn_shortfall"] == 0
            seen += [g.group_id for g in taken]
            dropped += dyn["dyn_dropped_groups"]
            update_weights(m, engines, v + 1)
    finally:
        m.stop()
    assert dropped > 0
    assert len(seen) == len(set(seen)), "a group was taken twice"
    assert buffer.dropped_stale == 0
    # the gate counts only groups trained on: (v + eta + 1) * B of them at most
    assert m.submitted <= (6 + eta + 1) * B


def test_rounds_run_out_train_on_what_there_is():
    cfg, engines, buffer, m = make(1, SomeFlatTask(lambda i: True), B=3, n=2,
                                   overrides=["rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=2"])
    m.start()
    try:
        for v in range(3):
            kept, taken, dyn = take_groups(cfg, buffer, m, v, timeout=30)
            # every group is flat: two rounds (3 groups, then 3 more), then one group is trained on
            assert len(taken) == 6 and kept == taken[:1]
            assert dyn == {"dyn_rounds": 2, "dyn_dropped_groups": 5, "dyn_shortfall": 3,
                           "dyn_dropped_ids": [g.group_id for g in taken[1:]]}
            update_weights(m, engines, v + 1)
    finally:
        m.stop()


def test_off_takes_exactly_one_batch():
    cfg, engines, buffer, m = make(0, SomeFlatTask(lambda i: True), B=2, n=2)
    m.start()
    try:
        kept, taken, dyn = take_groups(cfg, buffer, m, 0, timeout=30)
        assert len(kept) == 2 and kept == taken and dyn == {}
    finally:
        m.stop()

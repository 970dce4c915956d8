import numpy as np
import pytest

from moe_rl.config import ConfigError, DataConfig
from moe_rl.tasks import PatternTask, Prompt, Task, get_task, long_tail_length, task_names
from moe_rl.tasks.synthetic import BOS, EOS, FIRST_SYMBOL, SEP


def test_registry_and_protocol():
    assert {"echo", "copy", "reverse", "jsonl", "arith"} <= set(task_names())
    for name in ("echo", "copy", "reverse", "arith"):
        t = get_task(DataConfig(task=name))
        assert isinstance(t, Task) and t.name == name
        p = t.prompt(0)
        assert isinstance(p, Prompt) and p.index == 0 and max(p.input_ids) < t.vocab_size_needed


def test_prompts_are_deterministic_in_seed_and_index():
    a = get_task(DataConfig(task="reverse", seed=3, task_args={"length": 4}))
    b = get_task(DataConfig(task="reverse", seed=3, task_args={"length": 4}))
    c = get_task(DataConfig(task="reverse", seed=4, task_args={"length": 4}))
    # any access order gives the same prompt for an index (resume from a data position)
    fwd = [a.prompt(i) for i in range(50)]
    back = [b.prompt(i) for i in reversed(range(50))][::-1]
    assert fwd == back
    assert [p.input_ids for p in fwd] != [c.prompt(i).input_ids for i in range(50)]
    assert len({tuple(p.input_ids) for p in fwd}) > 30  # varied
    p = fwd[7]
    assert p.input_ids[0] == BOS and p.input_ids[-1] == SEP and len(p.input_ids) == 6
    assert p.meta["pattern"] == p.input_ids[1:-1][::-1]
    assert all(FIRST_SYMBOL <= s < FIRST_SYMBOL + 4 for s in p.input_ids[1:-1])


def test_echo_reward_partial_credit_and_stop():
    t = PatternTask("echo", max_new_tokens=8)
    p = Prompt(0, [BOS, 5, SEP], 8, {"pattern": [5]})
    assert t.reward(p, [5] * 8) == 1.0
    assert t.reward(p, [5, 6, 5, 6, 5, 6, 5, 6]) == 0.5
    assert t.reward(p, [5, 5, EOS]) == 2 / 8  # stopping early forfeits the rest
    assert t.reward(p, [5, 5, EOS, 5, 5]) == 2 / 8  # nothing after the stop token counts
    assert t.reward(p, [5] * 20) == 1.0  # tokens beyond the budget do not count
    assert t.reward(p, []) == 0.0
    assert t.stop_token_ids == [EOS] and t.vocab_size_needed == FIRST_SYMBOL + 4


def test_copy_and_reverse_targets_repeat_cyclically():
    cp = PatternTask("copy", length=3)
    rv = PatternTask("reverse", length=3)
    pc = Prompt(0, [BOS, 4, 5, 6, SEP], 6, {"pattern": [4, 5, 6]})
    pr = Prompt(0, [BOS, 4, 5, 6, SEP], 6, {"pattern": [6, 5, 4]})
    assert cp.reward(pc, [4, 5, 6, 4, 5, 6]) == 1.0
    assert rv.reward(pr, [6, 5, 4, 6, 5, 4]) == 1.0
    assert rv.reward(pr, [4, 5, 6, 4, 5, 6]) == pytest.approx(2 / 6)  # middle symbol matches
    assert rv.reward(pr, [6, 5, 9]) == pytest.approx(2 / 6)
    # the built prompts agree with these layouts
    q = rv.prompt(11)
    assert rv.reward(q, rv.target(q, q.max_new_tokens)) == 1.0


def test_random_policy_gets_low_nonzero_reward_with_group_variance():
    t = get_task(DataConfig(task="echo"), max_new_tokens=16)
    rng = np.random.default_rng(0)
    rewards = np.array([[t.reward(t.prompt(i), rng.integers(0, 64, 16).tolist()) for _ in range(4)]
                        for i in range(200)])
    assert 0.005 < rewards.mean() < 0.05
    assert (rewards.std(1) > 0).mean() > 0.3  # many groups carry a GRPO signal


def test_long_tail_budget_distribution():
    t = get_task(DataConfig(task="echo", seed=1, task_args={"long_tail": True}))
    L = np.array([t.prompt(i).max_new_tokens for i in range(4000)])
    assert L.min() >= 4 and L.max() == 64
    assert [t.prompt(i).max_new_tokens for i in range(20)] == L[:20].tolist()  # seeded
    assert np.median(L) <= 8  # most responses short ...
    assert L.mean() > 1.6 * np.median(L)  # ... mean pulled up by the tail
    assert 0.03 < (L == 64).mean() < 0.10  # a heavy tail: some hit the cap
    assert 0.08 < (L >= 32).mean() < 0.2
    # without long_tail the budget is the configured default
    assert get_task(DataConfig(task="echo"), max_new_tokens=12).prompt(0).max_new_tokens == 12
    assert long_tail_length(0, 5, 4, 64, 1.0) == long_tail_length(0, 5, 4, 64, 1.0)


def test_bad_task_and_args_name_the_key():
    with pytest.raises(ConfigError, match="did you mean 'echo'"):
        get_task(DataConfig(task="ecko"))
    with pytest.raises(ConfigError, match=r"data\.task_args\.num_symbol.*num_symbols"):
        get_task(DataConfig(task="echo", task_args={"num_symbol": 3}))
    with pytest.raises(ConfigError, match="num_symbols"):
        get_task(DataConfig(task="copy", task_args={"num_symbols": 1}))
    with pytest.raises(ConfigError, match="data.path"):
        get_task(DataConfig(task="jsonl"))

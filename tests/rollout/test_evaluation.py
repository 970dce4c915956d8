"""Evaluation's figures (moe_rl/rollout/evaluation.py): pass@k against a count over every
k-subset, and the eval/* metrics against plain numpy. Evaluation during training, end to end:
tests/train/test_main_job.py (the resume test)."""
import itertools
import math

import numpy as np
import pytest

from moe_rl.rollout.evaluation import eval_metrics, pass_at_k


def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass():
    for n, k in ((5, 1), (5, 2), (5, 5), (7, 3)):
        for c in range(n + 1):
            subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.5, 1.0, 1.0, 1.0]])
    m = eval_metrics(rewards, np.full((3, 4), 8), np.zeros((3, 4), bool), pass_threshold=1.0)
    assert m["eval/pass@1"] == pytest.approx((2 / 4 + 0 + 3 / 4) / 3) and m["eval/pass@4"] == pytest.approx(2 / 3)
    assert m["eval/reward_mean"] == pytest.approx(rewards.mean())
    assert m["eval/reward_se"] == pytest.approx(rewards.mean(1).std(ddof=1) / math.sqrt(3))
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_eval_keys_are_checked():
    from moe_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"sweep.eval_prompts and sweep.eval_samples are now the eval section's: "
                                          r"set sweep.final_eval=true with eval.prompts and eval.samples"):
        load_config(None, ["sweep.eval_prompts=64"])
    with pytest.raises(ConfigError, match=r"eval.every with env.factory: evaluation runs single-turn prompts"):
        load_config(None, ["eval.every=5", "env.factory=moe_rl.tasks.guess:GuessEnv"])
    with pytest.raises(ConfigError, match=r"eval.samples: Input should be greater than or equal to 1"):
        load_config(None, ["eval.samples=0"])
    cfg = load_config(None, ["eval.every=5", "eval.temperature=0"])
    assert cfg.eval.every == 5 and cfg.eval.temperature == 0

"""Evaluation on held-out prompts: which prompts, how they are sampled, what is reported.

One definition (the config's ``eval`` section) serves both callers: the trainer between steps,
on the rollout engines at the current weights (``RolloutManager.evaluate``, moe_rl/train/loop.py),
and the sweeps' final-checkpoint evaluation (moe_rl/experiments/evaluate.py, an embedded engine
on the checkpoint's weights).

* Prompts: ``eval.data`` (a held-out dataset, read like ``data.path``), else the training task
  rebuilt with ``data.seed = EVAL_DATA_SEED``, a seed no training run draws with; prompt indices
  0..n-1 with n = ``eval.prompts`` (or all of a smaller file's).
* Sampling: ``eval.samples`` responses per prompt at ``eval.temperature`` (default the
  rollout's), with the rollout's top_p / top_k / max_new_tokens, and a fixed sampling seed per
  (prompt, sample): every evaluation of every run samples the same prompts with the same seeds.
* Metrics (:func:`eval_metrics`): ``eval/reward_mean`` (mean over prompts of the mean reward of
  their samples) and its standard error over prompts ``eval/reward_se``; ``eval/pass@1`` and
  ``eval/pass@{k}``, k = ``eval.samples``, by the unbiased estimator of Chen et al. (2021),
  1 - C(n - c, k) / C(n, k) averaged over prompts, a sample passing when its reward is at least
  ``eval.pass_threshold``; ``eval/response_len_mean`` (tokens); ``eval/failed_samples`` (a
  reward that raised counts 0, as in training).
"""
from __future__ import annotations

import math

import numpy as np

from moe_rl.tasks import task_from_config
from moe_rl.tasks.base import Prompt, Task
from moe_rl.tasks.plugins import reward_value

EVAL_DATA_SEED = 1_000_003  # no sweep seed (0..seeds-1) draws the training prompts from it


def eval_task(cfg) -> Task:
    """The task the evaluation draws from: ``eval.data`` in place of ``data.path``, or the
    training task with ``data.seed = EVAL_DATA_SEED``."""
    data = cfg.data.model_copy(update={"seed": EVAL_DATA_SEED, **({"path": cfg.eval.data} if cfg.eval.data else {})})
    return task_from_config(cfg.model_copy(update={"data": data}))


def eval_prompts(cfg, task: Task) -> list[Prompt]:
    n = cfg.eval.prompts if task.num_prompts is None else min(cfg.eval.prompts, task.num_prompts)
    return [task.prompt(i) for i in range(n)]


def eval_requests(cfg, task: Task, prompts: list[Prompt]) -> list[list[dict]]:
    """Per prompt, its ``eval.samples`` /generate requests (SGLang's fields: input_ids,
    sampling_params, rid)."""
    ro, ev = cfg.rollout, cfg.eval
    temp = ro.temperature if ev.temperature is None else ev.temperature
    out = []
    for i, p in enumerate(prompts):
        out.append([{
            "input_ids": list(p.input_ids),
            "sampling_params": {"temperature": temp, "top_p": ro.top_p, "top_k": ro.top_k,
                                "max_new_tokens": p.max_new_tokens or ro.max_new_tokens,
                                "stop_token_ids": list(task.stop_token_ids),
                                "sampling_seed": int(np.random.SeedSequence([EVAL_DATA_SEED, i, j]).generate_state(1)[0]
                                                     & 0x7FFFFFFF)},
            "rid": f"eval-p{i}-s{j}",
        } for j in range(ev.samples)])
    return out


def score(task: Task, prompt: Prompt, response_ids: list[int]) -> tuple[float, bool]:
    """(reward, failed) of one evaluation response; a reward that raises scores 0, failed."""
    try:
        return reward_value(task.reward(prompt, list(response_ids)), "reward")[0], False
    except Exception:  # noqa: BLE001  (counted in eval/failed_samples, as training counts failed samples)
        return 0.0, True


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k samples drawn without replacement from n, c of them
    passing, passes: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, unbiased)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(rewards: np.ndarray, lengths: np.ndarray, failed: np.ndarray, pass_threshold: float) -> dict:
    """The ``eval/*`` metrics from [prompts, samples] arrays of rewards, response lengths and
    failed flags."""
    P, n = rewards.shape
    per_prompt = rewards.mean(axis=1)
    passed = (rewards >= pass_threshold).sum(axis=1)
    out = {
        "eval/reward_mean": float(per_prompt.mean()),
        "eval/reward_se": float(per_prompt.std(ddof=1) / math.sqrt(P)) if P > 1 else 0.0,
        "eval/pass@1": float(np.mean([pass_at_k(n, int(c), 1) for c in passed])),
        f"eval/pass@{n}": float(np.mean([pass_at_k(n, int(c), n) for c in passed])),
        "eval/response_len_mean": float(lengths.mean()),
        "eval/failed_samples": int(failed.sum()),
        "eval/prompts": P,
        "eval/samples": n,
    }
    return out

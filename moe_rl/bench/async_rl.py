"""``moe-rl bench async``: asynchronous (eta=2) vs synchronous (eta=0) training, side by side.

The same task, model and sample budget, on a long-tailed response-length distribution
(the task's ``long_tail`` option draws each prompt's max_new_tokens from a heavy-tailed law),
each run as a real ``moe-rl train`` world (1 trainer rank + 1 embedded-engine rank). Reports
samples/s, the busy fraction of each pool, the mean token staleness (the lag of the per-step
reward) and the final reward (mean of the last quarter of steps) of each run, and the final
policy's reward on a fixed prompt set (``final_eval_reward``,
moe_rl/experiments/evaluate.py: the per-step reward of an asynchronous run is earned by policies
up to eta versions older than the one it trained, this is the trained policy itself), and the
final reward by sampling version (``final_reward_by_version``: both runs' batches sampled by
the same window of policy versions, the last quarter that both reached; the lag removed).

``--multi-turn``: the same comparison on multi-turn episodes (configs/guess_number.yaml) whose
environment steps take a long-tailed time (``GuessEnv``'s Pareto latency, ``--env-latency``
seconds at least, up to ``--env-latency-max``), the straggler pattern of agentic RL.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moe_rl.config import load_config
from moe_rl.experiments.evaluate import evaluate_run
from moe_rl.experiments.sweep import reward_in_versions, version_window
from moe_rl.train.tracking import read_metrics



def run_once(config: str, eta: int, steps: int, out_dir: Path, overrides: list[str],
             workload: tuple[str, ...] = ("data.task_args.long_tail=true",)) -> tuple[dict, list[dict]]:
    """The run's summary figures, and its per-step metrics rows."""
    args = [sys.executable, "-m", "moe_rl.cli", "train", config, f"rollout.max_staleness={eta}",
            f"train.steps={steps}", f"output_dir={out_dir}", "logging.progress=false", "logging.tensorboard=false",
            *workload, "checkpoint.every=0", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"moe-rl train (eta={eta}) failed with code {r.returncode}:\n{r.stderr[-4000:]}")
    rows = read_metrics(out_dir / "metrics.jsonl")
    samples = sum(row["samples"] for row in rows)
    train_wall = rows[-1]["wall_s"]  # from the first batch request to the last step, excludes start-up
    q = max(1, len(rows) // 4)
    cfg = load_config(config, args[args.index(config) + 1:])
    # single-turn tasks only: a multi-turn episode's reward needs its environment
    ev = None if cfg.env.factory else evaluate_run(out_dir, cfg)  # eval.prompts x eval.samples (64 x 4)
    return {
        "eta": eta,
        "steps": len(rows),
        "samples": samples,
        "wall_s": train_wall,
        "process_wall_s": wall,
        "samples_per_s": samples / train_wall,
        "busy_trainer": rows[-1]["busy_trainer"],
        "busy_rollout": rows[-1]["busy_rollout"],
        "reward_first": float(np.mean([row["reward_mean"] for row in rows[:q]])),
        "final_reward": float(np.mean([row["reward_mean"] for row in rows[-q:]])),
        "final_eval_reward": ev["eval/reward_mean"] if ev else None,
        "eval_set": f"{cfg.eval.prompts} fixed prompts x {cfg.eval.samples}",
        "staleness_max": max(row["staleness_max"] for row in rows),
        "staleness_mean": float(np.mean([row["staleness_mean"] for row in rows])),
        "dropped_stale_groups": rows[-1]["dropped_stale_groups"],
        "mean_response_len": float(np.mean([row["response_len_mean"] for row in rows])),
    }, rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="moe-rl bench async", description=__doc__)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eta", type=int, default=2, help="staleness bound of the asynchronous run")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--multi-turn", action="store_true", help="multi-turn episodes with slow environment steps")
    ap.add_argument("--env-latency", type=float, default=0.02, help="--multi-turn: least env step time (s)")
    ap.add_argument("--env-latency-max", type=float, default=2.0, help="--multi-turn: most env step time (s)")
    ap.add_argument("overrides", nargs="*", help="config overrides for both runs")
    a = ap.parse_args(argv)
    workload: tuple[str, ...] = ("data.task_args.long_tail=true",)
    if a.multi_turn:
        if a.config == ap.get_default("config"):
            a.config = "configs/guess_number.yaml"
        workload = (f"env.args.latency_s={a.env_latency}", f"env.args.latency_max_s={a.env_latency_max}")
    with tempfile.TemporaryDirectory(prefix="moe-rl-bench-async-") as tmp:
        runs, rows = {}, {}
        for name, eta in (("async", a.eta), ("sync", 0)):
            if not a.json:
                print(f"running eta={eta} ({a.steps} steps) ...", file=sys.stderr, flush=True)
            runs[name], rows[name] = run_once(a.config, eta, a.steps, Path(tmp) / name, a.overrides, workload)
    # by sampling version: both runs over the same window of the policy versions that sampled
    lo, hi = version_window(list(rows.values()))
    for name, r in runs.items():
        r["final_reward_by_version"] = reward_in_versions(rows[name], lo, hi)
    A, S = runs["async"], runs["sync"]
    summary = {
        "samples_per_s_async": A["samples_per_s"], "samples_per_s_sync": S["samples_per_s"],
        "speedup": A["samples_per_s"] / S["samples_per_s"],
        "busy_trainer_async": A["busy_trainer"], "busy_rollout_async": A["busy_rollout"],
        "busy_trainer_sync": S["busy_trainer"], "busy_rollout_sync": S["busy_rollout"],
        "final_reward_async": A["final_reward"], "final_reward_sync": S["final_reward"],
        "final_reward_by_version_async": A["final_reward_by_version"],
        "final_reward_by_version_sync": S["final_reward_by_version"],
        "final_eval_reward_async": A["final_eval_reward"], "final_eval_reward_sync": S["final_eval_reward"],
        "device": "cpu", "workload": "multi-turn" if a.multi_turn else "long-tail single-turn",
    }
    if a.json:
        print(json.dumps({"runs": runs, "summary": summary}))
    else:
        print(f"{'':6s} {'samples/s':>10s} {'busy train':>11s} {'busy rollout':>13s} {'reward first->final':>20s} {'stale mean/max':>14s}")
        for name, r in runs.items():
            print(f"{name:6s} {r['samples_per_s']:10.2f} {r['busy_trainer']:11.2f} {r['busy_rollout']:13.2f} "
                  f"{r['reward_first']:9.3f}->{r['final_reward']:.3f} {r['staleness_mean']:9.2f}/{r['staleness_max']:d}")
        print(f"speedup async/sync: {summary['speedup']:.2f}x")
        if A["final_reward_by_version"] is not None and S["final_reward_by_version"] is not None:
            print(f"final reward by sampling version (versions {lo:.0f}-{hi:.0f}; the async run's per-step reward "
                  f"lags by its staleness): async {A['final_reward_by_version']:.3f}, "
                  f"sync {S['final_reward_by_version']:.3f}")
        if A["final_eval_reward"] is not None:
            print(f"final policy on {A['eval_set']}: async {A['final_eval_reward']:.3f}, "
                  f"sync {S['final_eval_reward']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

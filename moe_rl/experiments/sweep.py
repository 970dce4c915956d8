"""``moe-rl sweep``: run the arms of an experiment over seeds and summarise them.

An arm is one point of the cross product of the grid (``--grid KEY=V1,V2`` on the command line
and/or the config's ``sweep.grid``); each arm runs once per seed as a separate ``moe-rl train``
process (the CLI path: this module never imports train/) in ``<sweep dir>/<arm>/seed<k>``. A run
whose directory holds ``done.json`` is not run again, so an interrupted sweep resumes by
re-running the same command (a run cut short is continued from its checkpoint, or started over
without one: docs/run_safety.md). The summary is read back from each run's ``metrics.jsonl``:
``summary.md``, ``summary.csv``, ``summary.json``, ``reward.png`` (reward against samples
trained, mean and min-max band over seeds per arm) and ``mismatch_kl.png``. With
``sweep.final_eval`` each run's final checkpoint is also scored as the ``eval`` section says
(moe_rl/experiments/evaluate.py; cached in the run's ``eval.json``), and arms are compared
seed by seed against the first arm.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from ..config import ConfigError, ExperimentConfig, load_config
from ..lifetime import PARENT_ENV
from ..rundir import RUN_FILES, latest_step

# every run: quiet, no TensorBoard, one checkpoint at the end only
RUN_DEFAULTS = ["logging.progress=false", "logging.tensorboard=false", "checkpoint.every=0"]
SEED_KEYS = ("seed", "train.seed", "data.seed", "model.init_seed")


@dataclass(frozen=True)
class Run:
    arm: str  # directory-safe arm name
    values: tuple[tuple[str, object], ...]  # the arm's grid point
    seed: int
    dir: Path
    overrides: tuple[str, ...]  # everything passed to `moe-rl train` after CONFIG


def parse_grid(items: list[str]) -> dict[str, list]:
    """``["a.b=1,2", "c=x"]`` -> ``{"a.b": [1, 2], "c": ["x"]}`` (values parsed as YAML scalars);
    ``"k="`` maps k to [] (removes k from the config's sweep.grid)."""
    grid: dict[str, list] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--grid {item!r} is not of the form key.sub=V1,V2")
        key, raw = item.split("=", 1)
        grid[key.strip()] = [yaml.safe_load(v) for v in raw.split(",") if v.strip() != ""]
    return grid


def _fmt(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _overrides(key: str, value) -> list[str]:
    """A grid value that is a mapping sets several keys of the section ``key`` together
    (``algo: [{policy_loss: ppo}, {policy_loss: gspo, loss_agg: sequence}]``)."""
    if isinstance(value, dict):
        return [f"{key}.{k}={_fmt(v)}" for k, v in value.items()]
    return [f"{key}={_fmt(value)}"]


def _label(key: str, value) -> str:
    if isinstance(value, dict):  # named by its first entry
        k, v = next(iter(value.items()))
        return f"{k}={_fmt(v)}"
    return f"{key.split('.')[-1]}={_fmt(value)}"


def arm_name(values: tuple[tuple[str, object], ...]) -> str:
    if not values:
        return "base"
    name = "__".join(_label(k, v) for k, v in values)
    return re.sub(r"[^A-Za-z0-9_.=+-]", "-", name)


def plan(config: str, cfg: ExperimentConfig, grid: dict[str, list], seeds: int, steps: int | None,
         out: Path, extra: list[str]) -> list[Run]:
    """Every (arm, seed) run; each run's config is validated here, before anything starts, so a
    bad grid key or value fails naming it."""
    keys = list(grid)
    runs = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        values = tuple(zip(keys, combo))
        arm = arm_name(values)
        for seed in range(seeds):
            d = out / arm / f"seed{seed}"
            ov = [*RUN_DEFAULTS, *extra, *(o for k, v in values for o in _overrides(k, v)),
                  *(f"{k}={seed}" for k in SEED_KEYS), f"output_dir={d}"]
            if steps:
                ov.append(f"train.steps={steps}")
            try:
                load_config(config, ov)
            except ConfigError as e:
                raise ConfigError(f"sweep arm {arm!r} (seed {seed}): {e}") from None
            runs.append(Run(arm, values, seed, d, tuple(ov)))
    if len({r.arm for r in runs}) != len(runs) // seeds:
        raise ConfigError("two grid points give the same arm name; use distinct values")
    return runs


def is_done(run: Run) -> bool:
    return (run.dir / "done.json").exists()


def execute(config: str, run: Run, log=print) -> None:
    """One ``moe-rl train`` process; ``done.json`` marks success (its output is in train.log).
    A run the sweep started before and that did not finish is its own: continued from its
    latest checkpoint (resume=true), or started over (overwrite_output_dir=true) if it has none.
    The run ends with this process (moe_rl.lifetime)."""
    run.dir.mkdir(parents=True, exist_ok=True)
    again = []
    if latest_step(run.dir) is not None:
        again = ["resume=true"]
    elif any((run.dir / name).exists() for name in RUN_FILES):
        again = ["overwrite_output_dir=true"]
    (run.dir / "eval.json").unlink(missing_ok=True)  # scored a checkpoint that is being replaced
    args = [sys.executable, "-m", "moe_rl.cli", "train", config, *run.overrides, *again]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{PARENT_ENV: str(os.getpid())})
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    with open(run.dir / "train.log", "a" if again else "w") as f:
        if again:
            f.write(f"\n--- moe-rl sweep: {again[0]} ---\n")
            f.flush()
        rc = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"run {run.arm}/seed{run.seed} failed (exit code {rc}); see {run.dir / 'train.log'}")
    (run.dir / "done.json").write_text(json.dumps({"arm": run.arm, "seed": run.seed, "process_wall_s": wall,
                                                   "command": args}, indent=1))
    log(f"  done {run.arm}/seed{run.seed} in {wall:.0f} s")


# --- summary ---------------------------------------------------------------------------------
def _col(rows: list[dict], key: str) -> np.ndarray:
    return np.array([np.nan if r.get(key) is None else float(r[key]) for r in rows], dtype=float)


def run_stats(rows: list[dict], threshold: float) -> dict:
    """Per-run figures from its metrics.jsonl rows: final reward = mean reward of the last quarter
    of the steps; steps to threshold = first step whose trailing mean reward (window = a tenth of
    the steps) reaches ``threshold``."""
    reward = _col(rows, "reward_mean")
    n = len(rows)
    q = max(1, n // 4)
    k = max(1, n // 10)
    trailing = np.array([np.nanmean(reward[max(0, i - k + 1): i + 1]) for i in range(n)])
    hit = np.nonzero(trailing >= threshold)[0]
    samples = _col(rows, "samples")
    wall = rows[-1].get("wall_s") if rows else None
    return {
        "steps": n,
        "final_reward": float(np.nanmean(reward[-q:])),
        "steps_to_threshold": int(rows[hit[0]]["step"]) if len(hit) else None,
        "mismatch_k3": float(np.nanmean(_col(rows, "mismatch_k3"))),
        "routing_match": float(np.nanmean(_col(rows, "routing_match"))) if any("routing_match" in r for r in rows) else None,
        "tokens_per_s": float(np.nanmedian(_col(rows, "tokens_per_s"))),
        "samples_per_s": float(np.nansum(samples) / wall) if wall else None,
        "icepop_frac": float(np.nanmean(_col(rows, "icepop_frac"))),
    }


def _mean_std(xs: list) -> tuple[float | None, float | None, int]:
    vals = np.array([x for x in xs if x is not None], dtype=float)
    if not len(vals):
        return None, None, 0
    return float(vals.mean()), float(vals.std(ddof=1)) if len(vals) > 1 else 0.0, len(vals)


def gen_versions(rows: list[dict]) -> np.ndarray:
    """The (mean) policy version that sampled each step's batch: the trainer is at version
    step - 1 when it takes the batch, whose tokens are staleness_mean versions older."""
    return _col(rows, "step") - 1 - np.nan_to_num(_col(rows, "staleness_mean"))


def version_window(all_rows: list[list[dict]]) -> tuple[float, float]:
    """The last quarter of the sampling-policy versions that every run sampled with: comparing
    runs over the same window of versions does not charge a stale run its lag."""
    hi = min(float(gen_versions(rows).max()) for rows in all_rows)
    lo = min(float(rows[-1]["step"]) for rows in all_rows) * 0.75 - 1
    return lo, hi


def reward_in_versions(rows: list[dict], lo: float, hi: float) -> float | None:
    """Mean batch reward over the steps whose batch was sampled by a policy version in [lo, hi]."""
    v = gen_versions(rows)
    sel = (v >= lo) & (v <= hi)
    return float(np.nanmean(_col(rows, "reward_mean")[sel])) if sel.any() else None


FIGURES = ("final_reward", "final_reward_by_version", "eval_reward", "steps_to_threshold", "mismatch_k3", "routing_match",
           "tokens_per_s", "samples_per_s", "icepop_frac")
PAIRED = ("final_reward", "final_reward_by_version", "eval_reward", "samples_per_s")


def run_eval(config: str, run: Run) -> dict | None:
    """The run's final-policy evaluation (its config's ``eval`` section), computed once and
    kept in ``<run>/eval.json``."""
    from .evaluate import eval_settings, evaluate_run

    cfg = load_config(config, list(run.overrides))
    path = run.dir / "eval.json"
    if path.exists():
        got = json.loads(path.read_text())
        if all(got.get(k) == v for k, v in eval_settings(cfg).items()):
            return got
    got = evaluate_run(run.dir, cfg)
    if got is not None:
        path.write_text(json.dumps(got, indent=1))
    return got


def paired(arms: dict[str, list[dict]], seeds: dict[str, list[int]]) -> list[dict]:
    """Each arm minus the first arm, seed by seed (seeds both have): mean and standard error."""
    names = list(arms)
    out = []
    for arm in names[1:]:
        row = {"arm": arm, "baseline": names[0]}
        for f in PAIRED:
            base = {s: st.get(f) for s, st in zip(seeds[names[0]], arms[names[0]])}
            d = [st.get(f) - base[s] for s, st in zip(seeds[arm], arms[arm])
                 if st.get(f) is not None and base.get(s) is not None]
            row[f + "_diff"] = float(np.mean(d)) if d else None
            row[f + "_diff_se"] = float(np.std(d, ddof=1) / np.sqrt(len(d))) if len(d) > 1 else None
            if f == "final_reward":
                row["pairs"] = len(d)
        out.append(row)
    return out


def summarise(runs: list[Run], out: Path, threshold: float, evaluate: str | None = None) -> list[dict]:
    """``evaluate``: the config file whose ``eval`` section scores each run's final checkpoint
    (run_eval); None: no final-policy evaluation."""
    arms: dict[str, list[dict]] = {}
    seeds: dict[str, list[int]] = {}
    curves: dict[str, list[list[dict]]] = {}
    for r in runs:
        path = r.dir / "metrics.jsonl"
        if not is_done(r) or not path.exists():
            continue
        rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
        if rows:
            st = run_stats(rows, threshold)
            ev = run_eval(evaluate, r) if evaluate else None
            st["eval_reward"] = ev["eval/reward_mean"] if ev else None
            arms.setdefault(r.arm, []).append(st)
            seeds.setdefault(r.arm, []).append(r.seed)
            curves.setdefault(r.arm, []).append(rows)
    # final reward by version: the same window of sampling-policy versions for every run (the last
    # quarter of versions that every run has sampled with), so a stale run is not charged its lag
    if curves:
        lo, hi = version_window([rows for rr in curves.values() for rows in rr])
        for arm, rr in curves.items():
            for st, rows in zip(arms[arm], rr):
                st["final_reward_by_version"] = reward_in_versions(rows, lo, hi)
    table = []
    for arm, stats in arms.items():
        row = {"arm": arm, "seeds": len(stats)}
        for f in FIGURES:
            xs = [s[f] for s in stats]
            m, sd, n = _mean_std(xs)
            row[f + "_mean"], row[f + "_std"] = m, sd
            if f == "steps_to_threshold":
                row["reached_threshold"] = n
        table.append(row)
    out.mkdir(parents=True, exist_ok=True)
    if table:
        with open(out / "summary.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
    pairs = paired(arms, seeds)
    (out / "summary.json").write_text(json.dumps({"threshold": threshold, "arms": table, "paired": pairs,
                                                  "per_seed": {a: dict(zip(map(str, seeds[a]), arms[a])) for a in arms}},
                                                 indent=1))
    (out / "summary.md").write_text(markdown(table, threshold, pairs))
    if curves:
        plot(curves, out)
    return table


def _pm(m, sd, digits: int) -> str:
    return "-" if m is None else f"{m:.{digits}f} ± {sd:.{digits}f}"


def markdown(table: list[dict], threshold: float, pairs: list[dict] = ()) -> str:
    head = ("| arm | seeds | final reward | final reward by version | final-policy eval | steps to reward ≥ %g "
            "| mismatch k3 KL | routing match | train tokens/s | samples/s | IcePop-masked |" % threshold)
    lines = [head, "|" + "---|" * 11]
    for r in table:
        reach = ("-" if r["steps_to_threshold_mean"] is None else
                 f"{r['steps_to_threshold_mean']:.0f} ± {r['steps_to_threshold_std']:.0f} ({r['reached_threshold']}/{r['seeds']})")
        lines.append(
            f"| {r['arm']} | {r['seeds']} | {_pm(r['final_reward_mean'], r['final_reward_std'], 3)} "
            f"| {_pm(r['final_reward_by_version_mean'], r['final_reward_by_version_std'], 3)} "
            f"| {_pm(r['eval_reward_mean'], r['eval_reward_std'], 3)} | {reach} "
            f"| {_pm(r['mismatch_k3_mean'], r['mismatch_k3_std'], 5)} | {_pm(r['routing_match_mean'], r['routing_match_std'], 3)} "
            f"| {_pm(r['tokens_per_s_mean'], r['tokens_per_s_std'], 0)} | {_pm(r['samples_per_s_mean'], r['samples_per_s_std'], 1)} "
            f"| {_pm(r['icepop_frac_mean'], r['icepop_frac_std'], 4)} |")
    lines.append("")
    lines.append("mean ± sample std over seeds; final reward = mean batch reward of the last quarter of steps; "
                 "by version = mean batch reward of the steps whose batch was sampled by a policy version in "
                 "the same window for every run (the last quarter of the versions all runs sampled with); "
                 "final-policy eval = each run's final checkpoint scored on a fixed prompt set (the same for "
                 "every run; '-' when not asked for); steps to threshold over the seeds that reached it "
                 "(reached/seeds).")
    if pairs:
        lines += ["", "Paired by seed against %s (mean ± standard error of the per-seed differences):" % pairs[0]["baseline"],
                  "", "| arm | pairs | " + " | ".join(f"Δ {f}" for f in PAIRED) + " |", "|" + "---|" * (2 + len(PAIRED))]
        for p in pairs:
            lines.append(f"| {p['arm']} | {p['pairs']} | " + " | ".join(
                _pm(p[f + "_diff"], p[f + "_diff_se"] or 0.0, 1 if f == "samples_per_s" else 3) for f in PAIRED) + " |")
    return "\n".join(lines) + "\n"


def _band(runs_rows: list[list[dict]], key: str):
    """x = samples trained (cumulative, mean over seeds), y mean / min / max over seeds, on the
    steps every seed has."""
    n = min(len(r) for r in runs_rows)
    x = np.mean([np.cumsum(_col(r[:n], "samples")) for r in runs_rows], axis=0)
    y = np.array([_col(r[:n], key) for r in runs_rows])
    return x, np.nanmean(y, 0), np.nanmin(y, 0), np.nanmax(y, 0)


def plot(curves: dict[str, list[list[dict]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The reward logged at a step was earned by the policy that sampled the batch, staleness_mean
    # versions older than the trainer's: reward_by_version.png puts each point at the samples that
    # policy had been trained on, so runs with different staleness compare policy for policy.
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for arm, rr in curves.items():
        n = min(len(r) for r in rr)
        per_step = np.mean([_col(r[:n], "samples") for r in rr])
        x = np.mean([gen_versions(r[:n]) * per_step for r in rr], axis=0)
        y = np.array([_col(r[:n], "reward_mean") for r in rr])
        line, = ax.plot(x, np.nanmean(y, 0), label=f"{arm} (n={len(rr)})")
        ax.fill_between(x, np.nanmin(y, 0), np.nanmax(y, 0), color=line.get_color(), alpha=0.2)
    ax.set_xlabel("samples the sampling policy had been trained on")
    ax.set_ylabel("reward (batch mean)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reward_by_version.png")
    plt.close(fig)
    for key, ylabel, fname in (("reward_mean", "reward (batch mean)", "reward.png"),
                               ("mismatch_k3", "train/infer mismatch, k3 KL", "mismatch_kl.png")):
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for arm, rr in curves.items():
            x, m, lo, hi = _band(rr, key)
            line, = ax.plot(x, m, label=f"{arm} (n={len(rr)})")
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2)
        ax.set_xlabel("samples trained")
        ax.set_ylabel(ylabel)
        if key == "mismatch_k3" and ax.dataLim.ymin > 0:
            ax.set_yscale("log")
        if key == "mismatch_k3":
            ax.set_title("mean over seeds, band = min..max (staleness drift included when eta > 0)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        if key != "mismatch_k3":
            ax.set_title("mean over seeds, band = min..max")
        fig.tight_layout()
        fig.savefig(out / fname)
        plt.close(fig)


# --- command line ------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="moe-rl sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                    help="a config key and its values (repeatable; replaces sweep.grid's entry for KEY)")
    ap.add_argument("--seeds", type=int, help="runs per arm (default sweep.seeds)")
    ap.add_argument("--steps", type=int, help="train.steps of every run (default sweep.steps, else the config's)")
    ap.add_argument("--parallel", type=int, help="runs at a time (default sweep.parallel)")
    ap.add_argument("--threshold", type=float, help="reward threshold (default sweep.threshold)")
    ap.add_argument("--out", help="sweep directory (default sweep.output_dir, else <output_dir>/sweep)")
    ap.add_argument("--summary-only", action="store_true", help="summarise the finished runs, start none")
    ap.add_argument("overrides", nargs="*", help="key=value applied to every run")
    a = ap.parse_intermixed_args(argv)
    cfg = load_config(a.config, a.overrides)
    sw = cfg.sweep
    grid = {k: v for k, v in {**sw.grid, **parse_grid(a.grid)}.items() if v}
    seeds = a.seeds or sw.seeds
    if seeds < 1:
        raise ConfigError("--seeds must be >= 1")
    parallel = a.parallel or sw.parallel
    threshold = sw.threshold if a.threshold is None else a.threshold
    out = Path(a.out or sw.output_dir or Path(cfg.output_dir) / "sweep")
    runs = plan(a.config, cfg, grid, seeds, a.steps or sw.steps, out, [*sw.overrides, *a.overrides])
    # seed-major order: with --parallel equal to the number of arms, the arms of one seed run
    # side by side under the same machine load, so their speed ratio compares like with like
    todo = sorted((r for r in runs if not is_done(r)), key=lambda r: r.seed)
    arms = len({r.arm for r in runs})
    print(f"sweep: {arms} arm(s) x {seeds} seed(s) = {len(runs)} runs in {out}; "
          f"{len(runs) - len(todo)} already done, {len(todo)} to run, {parallel} at a time", file=sys.stderr)
    failures = []
    if not a.summary_only and todo:
        log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

        def one(r: Run):
            try:
                execute(a.config, r, log)
            except RuntimeError as e:
                failures.append(str(e))
                log(f"  FAILED {e}")

        with ThreadPoolExecutor(max_workers=parallel) as pool:
            list(pool.map(one, todo))
    table = summarise(runs, out, threshold, a.config if sw.final_eval else None)
    print((out / "summary.md").read_text())
    print(f"written: {out}/summary.md, summary.csv, summary.json, reward.png, reward_by_version.png, mismatch_kl.png", file=sys.stderr)
    if failures:
        print(f"error: {len(failures)} run(s) failed; re-run the same command to retry them", file=sys.stderr)
        return 1
    return 0 if table else 1

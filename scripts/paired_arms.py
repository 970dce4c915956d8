"""Seed-paired comparison of sweep arms that ran in different sweep directories.

    python scripts/paired_arms.py BASE_ARM_DIR ARM_DIR [ARM_DIR ...]

Each directory is one arm of a `moe-rl sweep` (holding seed<k>/metrics.jsonl and, when the
sweep evaluated, seed<k>/eval.json). For every arm, the per-seed differences against the base
arm (mean ± standard error over the seeds both have) of: final reward (last quarter of steps),
final reward by sampling version (one version window for all the runs given,
moe_rl.experiments.sweep.version_window) and final-policy eval.
"""
import json
import sys
from pathlib import Path

import numpy as np

from moe_rl.experiments.sweep import reward_in_versions, version_window
from moe_rl.train.tracking import read_metrics


def load(arm: Path) -> dict[int, tuple[list[dict], float]]:
    out = {}
    for d in sorted(arm.glob("seed*")):
        ev = d / "eval.json"
        out[int(d.name[4:])] = (read_metrics(d / "metrics.jsonl"),
                                json.loads(ev.read_text())["eval_reward"] if ev.exists() else np.nan)
    return out


def main(argv: list[str]) -> None:
    base, arms = load(Path(argv[0])), {a: load(Path(a)) for a in argv[1:]}
    lo, hi = version_window([rows for runs in (base, *arms.values()) for rows, _ in runs.values()])

    def figures(rows, ev):
        q = max(1, len(rows) // 4)
        return np.mean([r["reward_mean"] for r in rows[-q:]]), reward_in_versions(rows, lo, hi), ev

    print(f"base {argv[0]} (versions {lo:.0f}-{hi:.0f} for 'by version')")
    print("| arm | seeds | staleness mean | Δ final reward | Δ by version | Δ final-policy eval |")
    print("|---|---|---|---|---|---|")
    for name, runs in arms.items():
        seeds = sorted(set(runs) & set(base))
        d = np.array([np.subtract(figures(*runs[k]), figures(*base[k])) for k in seeds], dtype=float)
        n = np.sum(~np.isnan(d), axis=0)
        mean, se = np.nanmean(d, axis=0), np.nanstd(d, axis=0, ddof=1) / np.sqrt(n)
        stale = np.mean([np.mean([r["staleness_mean"] for r in runs[k][0]]) for k in seeds])
        cells = " | ".join(f"{m:+.3f} ± {s:.3f}" for m, s in zip(mean, se))
        print(f"| {name} | {len(seeds)} | {stale:.2f} | {cells} |")


if __name__ == "__main__":
    main(sys.argv[1:])

"""One `moe-rl sweep` summary over arms that ran in different sweep directories.

    python scripts/paired_arms.py --out DIR BASE_ARM_DIR ARM_DIR [ARM_DIR ...]

Each ARM_DIR is one arm of a sweep (``<sweep dir>/<arm>``, holding ``seed<k>/done.json``). The
runs are read back as the sweep wrote them (each ``done.json`` keeps the run's command, so its
config and overrides) and summarised by the sweep's own code (``moe_rl.experiments.sweep.summarise``,
final-policy eval from the runs' cached ``eval.json``) into ``DIR/summary.{md,csv,json}`` and
plots, with the seed-paired differences against the first arm given. Also prints each arm's
mean token staleness.
"""
import argparse
import json
from pathlib import Path

import numpy as np

from moe_rl.experiments.sweep import Run, summarise
from moe_rl.train.tracking import read_metrics


def read_runs(arm_dir: Path) -> list[Run]:
    runs = []
    for done in sorted(arm_dir.glob("seed*/done.json")):
        cmd = json.loads(done.read_text())["command"]
        config, overrides = cmd[cmd.index("train") + 1], tuple(cmd[cmd.index("train") + 2:])
        runs.append(Run(str(arm_dir), (("config", config),), int(done.parent.name[4:]), done.parent, overrides))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--threshold", type=float, default=0.3)
    ap.add_argument("arms", nargs="+", type=Path)
    a = ap.parse_args()
    by_arm = {d: read_runs(d) for d in a.arms}
    runs = [r for arm_runs in by_arm.values() for r in arm_runs]
    configs = {dict(r.values)["config"] for r in runs}
    if len(configs) != 1:
        raise SystemExit(f"the arms ran different config files {sorted(configs)}; compare arms of one experiment")
    summarise(runs, a.out, a.threshold, configs.pop())  # final-policy eval by the config's eval section
    print((a.out / "summary.md").read_text())
    for d, arm_runs in by_arm.items():
        st = [np.mean([r["staleness_mean"] for r in read_metrics(run.dir / "metrics.jsonl")]) for run in arm_runs]
        print(f"{d}: mean token staleness {np.mean(st):.2f}")


if __name__ == "__main__":
    main()

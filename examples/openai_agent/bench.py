"""Agent path vs token-level path on the same game, side by side: `moe-rl train
configs/openai_agent.yaml` with the openai agent, and the same with the game as a token-level
environment (``guess_tools:GuessToolsEnv``), run in turn (A B A B ...) so that the machine's
drift hits both alike. Run from the repository root:

    python examples/openai_agent/bench.py --pairs 5 --steps 30 [--arm NAME=OVERRIDES ...]

Per run: samples/s = samples per step / the median of the step times (``wall_s`` between
consecutive metrics.jsonl rows) over steps 6..S (start-up excluded), and the 1-minute load
average before it. Prints every run, then per arm the median samples/s and the median of the
pair-by-pair ratios to the token-level arm. ``--arm`` adds arms (e.g. ``workers0=env.agent_workers=0``).

The learning check (minutes, so a benchmark and not a test):

    python examples/openai_agent/bench.py --learn [--minutes 5] [OVERRIDE ...]

trains the example for ``--minutes`` of wall time (``wall_s``, start-up excluded), prints the
mean reward by 20-step windows, and fails unless the last window's mean is above both the
blind level (1/3: answering without reading the tool results) + 0.15 and the first window's
mean + 0.3.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "openai_agent"
TOKEN_LEVEL = ["env.openai_agent=null", "env.factory=guess_tools:GuessToolsEnv"]


def run(overrides: list[str], steps: int, out: Path) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(EXAMPLE)]))
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "configs/openai_agent.yaml", f"output_dir={out}",
           f"train.steps={steps}", "logging.progress=false", "checkpoint.every=0", "overwrite_output_dir=true",
           *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    gaps = [b["wall_s"] - a["wall_s"] for a, b in zip(rows[4:], rows[5:])]
    if any(row["failed_samples"] for row in rows):
        raise SystemExit(f"{shlex.join(cmd)}: failed samples in {out / 'metrics.jsonl'}")
    return statistics.median(row["samples"] for row in rows[5:]) / statistics.median(gaps)


BLIND = 1 / 3  # guess_tools: the best a policy that ignores the tool results earns


def learn(minutes: float, overrides: list[str], out: Path) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(EXAMPLE)]))
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "configs/openai_agent.yaml", f"output_dir={out}",
           "train.steps=100000", "logging.progress=false", "checkpoint.every=0", "overwrite_output_dir=true",
           *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    metrics, rows = out / "metrics.jsonl", []
    try:
        while proc.poll() is None and (not rows or rows[-1]["wall_s"] < minutes * 60):
            time.sleep(2)
            if metrics.exists():
                rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    finally:
        proc.terminate()
        err = proc.communicate(timeout=60)[1]
    rows = [r for r in rows if r["wall_s"] <= minutes * 60]
    if len(rows) < 40:
        raise SystemExit(f"{shlex.join(cmd)}: {len(rows)} steps in {minutes} min\n{err[-3000:]}")
    windows = [rows[i:i + 20] for i in range(0, len(rows) - len(rows) % 20, 20)]
    means = [statistics.fmean(r["reward_mean"] for r in w) for w in windows]
    for w, m in zip(windows, means):
        print(f"steps {w[0]['step']:4d}-{w[-1]['step']:4d} (to {w[-1]['wall_s']:5.0f} s): mean reward {m:.3f}")
    ok = means[-1] > BLIND + 0.15 and means[-1] > means[0] + 0.3
    print(f"load {os.getloadavg()[0]:.1f}; {'learns' if ok else 'does NOT learn'}: last window {means[-1]:.3f} vs "
          f"first {means[0]:.3f}, blind level {BLIND:.3f}")
    return 0 if ok else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--arm", action="append", default=[], help="NAME=OVERRIDE[ OVERRIDE...]: another agent arm")
    ap.add_argument("--learn", action="store_true", help="the learning check instead of the throughput pairs")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("overrides", nargs="*", help="config overrides for --learn")
    a = ap.parse_args()
    if a.learn:
        with tempfile.TemporaryDirectory(prefix="agent-learn-") as tmp:
            raise SystemExit(learn(a.minutes, a.overrides, Path(tmp) / "run"))
    arms = {"agent": [], **{s.split("=", 1)[0]: shlex.split(s.split("=", 1)[1]) for s in a.arm},
            "token-level": TOKEN_LEVEL}
    rates: dict[str, list[float]] = {k: [] for k in arms}
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as tmp:
        for i in range(a.pairs):
            for name, overrides in arms.items():
                load = os.getloadavg()[0]
                rates[name].append(run(overrides, a.steps, Path(tmp) / name))
                print(f"pair {i + 1} {name}: {rates[name][-1]:.1f} samples/s (load {load:.1f})", flush=True)
    base = rates["token-level"]
    for name, r in rates.items():
        ratios = [x / b for x, b in zip(r, base)]
        print(f"{name}: median {statistics.median(r):.1f} samples/s ({', '.join(f'{x:.1f}' for x in r)}); "
              f"ratio to token-level median {statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()

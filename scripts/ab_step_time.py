"""Step time of two `moe-rl train` variants, run alternately (A B A B ...) so machine drift
hits both alike.

    python scripts/ab_step_time.py --pairs 5 --steps 40 \\
        --a "PYTHONPATH=/path/to/other/checkout" --b "" [--a-args k=v ...] [--b-args k=v ...] [CONFIG]

Each side is ``ENV... python -m moe_rl.cli train CONFIG output_dir=<tmp> train.steps=S
logging.progress=false checkpoint.every=0 <its args>``; from the wall-clock between consecutive
metrics.jsonl rows (``wall_s``: everything a step costs, logging and evaluation included;
start-up excluded) over steps 6..S it takes the median (a typical step) and the mean (every
cost spread over the steps, e.g. an evaluation every N steps). Prints each pair and the
medians of the per-pair ratios B/A.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def step_time(env_words: str, config: str, steps: int, args: list[str], out: Path) -> tuple[float, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.update(dict(w.split("=", 1) for w in shlex.split(env_words)))
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", config, f"output_dir={out}", f"train.steps={steps}",
           "logging.progress=false", "checkpoint.every=0", "overwrite_output_dir=true", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    walls = [r["wall_s"] for r in rows]
    gaps = [b - a for a, b in zip(walls[4:], walls[5:])]
    return statistics.median(gaps), statistics.mean(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default=str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"))
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--a", default="", help="environment words of side A (e.g. PYTHONPATH=...)")
    ap.add_argument("--b", default="", help="environment words of side B")
    ap.add_argument("--a-args", nargs="*", default=[])
    ap.add_argument("--b-args", nargs="*", default=[])
    a = ap.parse_args()
    med, mean = [], []
    with tempfile.TemporaryDirectory(prefix="ab-step-") as tmp:
        for i in range(a.pairs):
            ma, sa = step_time(a.a, a.config, a.steps, a.a_args, Path(tmp) / "a")
            mb, sb = step_time(a.b, a.config, a.steps, a.b_args, Path(tmp) / "b")
            med.append(mb / ma)
            mean.append(sb / sa)
            print(f"pair {i + 1}: median step A {ma * 1e3:.1f} ms, B {mb * 1e3:.1f} ms, B/A {mb / ma:.3f}; "
                  f"mean step A {sa * 1e3:.1f} ms, B {sb * 1e3:.1f} ms, B/A {sb / sa:.3f}", flush=True)
    for name, r in (("median", med), ("mean", mean)):
        print(f"{name} step, B/A over {a.pairs} pairs: median {statistics.median(r):.3f} "
              f"(min {min(r):.3f}, max {max(r):.3f})")


if __name__ == "__main__":
    main()

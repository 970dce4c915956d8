"""The long-run check: `moe-rl train` for thousands of steps with the process groups' timeout forced
small, sampling the resident memory of every rank, the routing log's bytes on disk and the step
rate; writes the curves (a plot) and their slopes (docs/run_safety.md, "Long runs").

    python scripts/long_run.py --steps 3000 --warmup 1000 --plot docs/long_run_tiny.png --json /tmp/long.json

What it reports, over the steps after ``--warmup`` (up to the last one: the run's end, with its
final checkpoint and reward plot, is not the steady state): each rank's RSS growth (least-squares slope,
MB per 1000 steps, and first-to-last: the medians of the first and last tenth of the samples),
the routing log's bytes (at warm-up, the most after it, and its slope), the step rate (steps/s
in the first and last tenth). Exit code 1 if the run failed (its stderr's tail is printed).
tests/scripts/test_long_run.py runs a short version in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the ranks under the `moe-rl train` launcher)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def rank_of(pid: int) -> int | None:
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            return int(kv[5:])
    return None


def rss_mb(pid: int) -> float | None:
    try:
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass  # deleted by the run's retention meanwhile
    return total


class Metrics:
    """metrics.jsonl read as it grows."""

    def __init__(self, path: Path):
        self.path, self.pos, self.rows, self._tail = path, 0, [], ""

    def poll(self) -> list[dict]:
        if self.path.exists():
            with open(self.path) as f:
                f.seek(self.pos)
                data = f.read()
                self.pos = f.tell()
            lines = (self._tail + data).split("\n")
            self._tail = lines.pop()
            self.rows += [json.loads(line) for line in lines if line.strip()]
        return self.rows


def run(config: str, out: Path, steps: int, dist_timeout: float, every_s: float, overrides: list[str],
        log=print) -> dict:
    """Runs `moe-rl train` and samples it every ``every_s`` s; returns the samples and the run's rows."""
    args = [sys.executable, "-m", "moe_rl.cli", "train", config, f"output_dir={out}", f"train.steps={steps}",
            f"dist.timeout_s={dist_timeout}", "logging.progress=false", *overrides]
    if out.exists():
        args.append("overwrite_output_dir=true")
    err_path = out.with_name(out.name + ".stderr")
    t0 = time.monotonic()
    with open(err_path, "w") as err:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    metrics = Metrics(out / "metrics.jsonl")
    samples = []
    last_log = 0.0
    while proc.poll() is None:
        rows = metrics.poll()
        pids = {r: p for p in children(proc.pid) if (r := rank_of(p)) is not None}
        rss = {r: m for r, p in pids.items() if (m := rss_mb(p)) is not None}
        if rows and rss:
            samples.append({"t": time.monotonic() - t0, "step": rows[-1]["step"], "rss_mb": rss,
                            "routing_bytes": dir_bytes(out / "routing")})
            if samples[-1]["t"] - last_log > 60:
                last_log = samples[-1]["t"]
                log(f"  step {rows[-1]['step']}/{steps}, {samples[-1]['t']:.0f} s, RSS MB "
                    f"{ {r: round(m) for r, m in sorted(rss.items())} }, routing {samples[-1]['routing_bytes'] / 1024:.0f} KB")
        time.sleep(every_s)
    wall = time.monotonic() - t0
    stderr = err_path.read_text()
    return {"rc": proc.returncode, "wall_s": wall, "samples": samples, "rows": metrics.poll(), "stderr": stderr,
            "args": args[3:]}


def _fit(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.polyfit(x, y, 1)[0]) if len(x) > 1 and np.ptp(x) > 0 else 0.0


def summarize(result: dict, warmup: int) -> dict:
    """Slopes and growth over the steps after ``warmup`` (see the module docstring)."""
    last = result["rows"][-1]["step"] if result["rows"] else 0
    # the last step's samples hold the run's end (final checkpoint, reward plot): not the steady state
    after = [s for s in result["samples"] if warmup <= s["step"] < last]
    if len(after) < 4:
        raise ValueError(f"only {len(after)} samples after step {warmup}: run longer or sample more often")
    steps = np.array([s["step"] for s in after], dtype=float)
    tenth = max(1, len(after) // 10)
    ranks = sorted({r for s in after for r in s["rss_mb"]}, key=int)
    rss = {}
    for r in ranks:
        pts = [(s["step"], s["rss_mb"][r]) for s in after if r in s["rss_mb"]]
        x, y = np.array(pts, dtype=float).T
        rss[str(r)] = {"at_warmup_mb": float(np.median(y[:tenth])), "end_mb": float(np.median(y[-tenth:])),
                       "growth_mb": float(np.median(y[-tenth:]) - np.median(y[:tenth])),
                       "slope_mb_per_1000_steps": 1000 * _fit(x, y), "max_mb": float(y.max())}
    routing = np.array([s["routing_bytes"] for s in after], dtype=float)
    rows = [r for r in result["rows"] if r["step"] >= warmup]
    rate_first = rate_last = float("nan")
    if len(rows) > 20:
        k = max(2, len(rows) // 10)
        span = lambda rs: (rs[-1]["step"] - rs[0]["step"]) / max(rs[-1]["wall_s"] - rs[0]["wall_s"], 1e-9)
        rate_first, rate_last = span(rows[:k]), span(rows[-k:])
    return {
        "steps": int(result["rows"][-1]["step"]) if result["rows"] else 0, "warmup": warmup,
        "window_steps": int(steps[-1] - steps[0]), "wall_s": result["wall_s"], "samples": len(result["samples"]),
        "rss": rss,
        "routing": {"at_warmup_bytes": int(np.median(routing[:tenth])), "max_bytes": int(routing.max()),
                    "end_bytes": int(routing[-1]), "growth_bytes": int(np.median(routing[-tenth:]) - np.median(routing[:tenth])),
                    "slope_bytes_per_1000_steps": 1000 * _fit(steps, routing)},
        "steps_per_s": {"first_tenth": rate_first, "last_tenth": rate_last},
    }


def plot(result: dict, summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), dpi=100, sharex=True)
    steps = [x["step"] for x in s]
    for r in sorted({r for x in s for r in x["rss_mb"]}, key=int):
        pts = [(x["step"], x["rss_mb"][r]) for x in s if r in x["rss_mb"]]
        g = summary["rss"].get(str(r), {})
        axes[0].plot(*zip(*pts), label=f"rank {r}: {g.get('slope_mb_per_1000_steps', float('nan')):+.2f} MB/1000 steps")
    axes[0].set_ylabel("RSS (MB)")
    axes[0].legend(fontsize=8)
    axes[1].plot(steps, [x["routing_bytes"] / 1024 for x in s])
    axes[1].set_ylabel("routing log (KB on disk)")
    rows = result["rows"]
    k = 50
    rate = [(rows[i]["step"], k / max(rows[i]["wall_s"] - rows[i - k]["wall_s"], 1e-9)) for i in range(k, len(rows))]
    if rate:
        axes[2].plot(*zip(*rate))
    axes[2].set_ylabel(f"steps/s ({k}-step window)")
    axes[2].set_xlabel("trainer step")
    for ax in axes:
        ax.axvline(summary["warmup"], color="grey", ls=":", lw=1)
        ax.grid(alpha=0.3)
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=1000, help="steps before the window the slopes are taken over")
    p.add_argument("--dist-timeout", type=float, default=5.0, help="dist.timeout_s: the process groups' timeout")
    p.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--out", default="runs/long_run", help="the run's output_dir (deleted and reused)")
    p.add_argument("--plot", help="write the curves here (PNG)")
    p.add_argument("--json", help="write the summary and the samples here")
    p.add_argument("overrides", nargs="*", help="more key=value overrides for the run")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"moe-rl train {a.config} for {a.steps} steps, dist.timeout_s={a.dist_timeout:g}, into {out}", flush=True)
    result = run(a.config, out, a.steps, a.dist_timeout, a.every, a.overrides)
    if result["rc"] != 0:
        print(f"the run failed (exit {result['rc']}):\n{result['stderr'][-3000:]}", file=sys.stderr)
        return 1
    summary = summarize(result, a.warmup)
    summary["outlived_timeout_x"] = result["wall_s"] / a.dist_timeout
    summary["command"] = " ".join(["python", "scripts/long_run.py", *(argv if argv is not None else sys.argv[1:])])
    print(json.dumps(summary, indent=1))
    if a.plot:
        plot(result, summary, Path(a.plot), f"{a.config}, {summary['steps']} steps, dist.timeout_s={a.dist_timeout:g} "
             f"(outlived {summary['outlived_timeout_x']:.0f}x); warm-up to step {a.warmup} (dotted)")
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "samples": result["samples"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Agent path vs token-level path on the same game, side by side: `moe-rl train
configs/openai_agent.yaml` with the openai agent, and the same with the game as a token-level
environment (``guess_tools:GuessToolsEnv``), run in turn (A B A B ...) so that the machine's
drift hits both alike. Run from the repository root:

    python examples/openai_agent/bench.py --pairs 5 [--prep-steps 400 --warmup 20 --steps 100] [--arm NAME=OVERRIDES ...]

Both paths play one policy, so that they do the same work: the bench first trains the example
for ``--prep-steps`` (the agent path; data.seed 0, then 1 and 2 until the last 20 steps score
above the blind level + 0.15, else it stops), and every run starts from that checkpoint's
``hf/`` at a learning rate of 1e-9 (``train.lr`` must be positive): each step still trains,
syncs the weights and plays, but the policy, and so the games and their lengths, stay as they
were. Per run: samples/s = samples per step / the median of the step times (``wall_s`` between
consecutive metrics.jsonl rows) over steps W..S (``--warmup`` W, ``--steps`` S), and the
1-minute load average before it. Each run's mean response length over the window (its tokens
per sample, model turns and tool results) is printed; a pair whose arm's length differs from
the token-level run's by more than 5% compared unequal work, and the bench then exits 1 (after
its figures). Prints every run, then per arm the median samples/s and the median of the
pair-by-pair ratios to the token-level arm. ``--arm`` adds arms (e.g. ``workers0=env.agent_workers=0``,
``gateway=env.agent_gateway=true``,
or ``raw=env.openai_agent=raw_agent:play``: the same agent without the openai SDK, to tell the SDK's
CPU from the rest of the agent path); ``--cpu`` prints each process's CPU time per step (Linux /proc;
steps W to S-2) after every run; ``--json FILE`` writes the figures after every pair (the GPU round's ``agent_api``
stage: the same pairs on the GPU machine's cores).

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


def _tree(pid: int) -> list[int]:
    """pid and its descendants (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return out


def _cpu_s(pid: int) -> tuple[str, float] | None:
    """(what the process is: launcher, rank N, agent worker; user + system CPU seconds) from /proc,
    None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        rank = [kv[5:].decode() for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if kv.startswith(b"RANK=")]
    except OSError:
        return None
    if b"multiprocessing" in argv:
        name = "agent worker" if b"spawn_main" in argv else "multiprocessing helper"
    else:
        name = f"rank {rank[0]}" if rank else "launcher"
    return name, (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _start(overrides: list[str], steps: int, out: Path) -> tuple[list[str], subprocess.Popen, Path]:
    """Starts `moe-rl train` of the example into ``out``: (its command, its process, the file its
    stderr goes to: a file, not a pipe, which nobody would read while the run goes on)."""
    path = [str(ROOT), str(EXAMPLE), *filter(None, [os.environ.get("PYTHONPATH")])]  # and what the caller set
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "configs/openai_agent.yaml", f"output_dir={out}",
           f"train.steps={steps}", "logging.progress=false", "checkpoint.every=0", "overwrite_output_dir=true",
           *overrides]
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)  # polled before the run starts over
    log = out.with_suffix(".stderr")
    with log.open("w") as err_file:
        return cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file, env=env, cwd=ROOT), log


def _wait(cmd: list[str], proc: subprocess.Popen, log: Path) -> None:
    """Waits for a run that _start began; its failure stops the bench with the end of its stderr."""
    if proc.wait():
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{log.read_text()[-3000:]}")


def run(overrides: list[str], steps: int, out: Path, cpu: bool, warmup: int) -> tuple[float, dict, float]:
    """(samples/s over steps ``warmup``..``steps``, CPU seconds per step by process over that
    window: empty without ``cpu``, the window's mean response length)."""
    cmd, proc, log = _start(overrides, steps, out)
    per: dict[str, float] = {}
    if cpu:  # each process's CPU time per step over steps W..S-2 (start-up, warm-up and the end excluded)
        first = last = None
        while proc.poll() is None:
            rows = _metrics(out)
            step = rows[-1]["step"] if rows else 0
            if step >= steps - 2:
                break
            if first is None and step >= warmup:
                first = (step, {p: c for p in _tree(proc.pid) if (c := _cpu_s(p))})
            time.sleep(0.05)
        if first is not None and proc.poll() is None:
            last = (_metrics(out)[-1]["step"], {p: c for p in first[1] if (c := _cpu_s(p))})
    _wait(cmd, proc, log)
    if cpu and last is not None and last[0] > first[0]:
        n = last[0] - first[0]
        for p in last[1]:  # two agent workers: their sum
            name = first[1][p][0]
            per[name] = per.get(name, 0.0) + (last[1][p][1] - first[1][p][1]) / n
        print("  CPU per step: " + ", ".join(f"{k} {1000 * v:.0f} ms" for k, v in per.items() if v > 0.0005)
              + f"; all {1000 * sum(per.values()):.0f} ms", flush=True)
    rows = _metrics(out)
    if any(row["failed_samples"] for row in rows):
        raise SystemExit(f"{shlex.join(cmd)}: failed samples in {out / 'metrics.jsonl'}")
    window = rows[warmup:]  # rows[i] is step i + 1
    if len(window) < 5:
        raise SystemExit(f"{shlex.join(cmd)}: {len(rows)} steps, too few past the warm-up ({warmup})")
    gaps = [b["wall_s"] - a["wall_s"] for a, b in zip(rows[warmup - 1:], window)]
    length = statistics.fmean(row["response_len_mean"] for row in window)
    return statistics.median(row["samples"] for row in window) / statistics.median(gaps), per, length


BLIND = 1 / 3  # guess_tools: the best a policy that ignores the tool results earns
LEARNED = BLIND + 0.15  # a mean reward above it: the policy reads the tool results
FROZEN_LR = "1e-9"  # the measured runs' learning rate: AdamW's steps of ~lr leave the policy as it is
SAME_WORK = 0.05  # the largest relative difference of response lengths within a pair


def prepare(steps: int, out: Path) -> Path:
    """Trains the example (agent path) for ``steps`` at data.seed 0, 1, 2 until its last 20 steps
    score above LEARNED; the final checkpoint's ``hf/``."""
    from moe_rl.rundir import resolve_model_dir

    for seed in range(3):
        cmd, proc, log = _start([f"data.seed={seed}"], steps, out)
        _wait(cmd, proc, log)
        last = statistics.fmean(row["reward_mean"] for row in _metrics(out)[-20:])
        print(f"prepared: {steps} steps at data.seed={seed}, last 20 steps' mean reward {last:.3f}", flush=True)
        if last > LEARNED:
            return resolve_model_dir(out)  # its latest checkpoint: the final one
    raise SystemExit(f"the example did not learn in {steps} steps at data.seed 0-2 (mean reward <= {LEARNED:.3f}); "
                     "try --prep-steps with more")


def learn(minutes: float, overrides: list[str], out: Path) -> int:
    cmd, proc, log = _start(overrides, 100000, out)
    rows = []
    try:
        while proc.poll() is None and (not rows or rows[-1]["wall_s"] < minutes * 60):
            time.sleep(2)
            rows = _metrics(out)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    rows = [r for r in rows if r["wall_s"] <= minutes * 60]
    if len(rows) < 40:
        raise SystemExit(f"{shlex.join(cmd)}: {len(rows)} steps in {minutes} min\n{log.read_text()[-3000:]}")
    windows = [rows[i:i + 20] for i in range(0, len(rows) - len(rows) % 20, 20)]
    means = [statistics.fmean(r["reward_mean"] for r in w) for w in windows]
    for w, m in zip(windows, means):
        print(f"steps {w[0]['step']:4d}-{w[-1]['step']:4d} (to {w[-1]['wall_s']:5.0f} s): mean reward {m:.3f}")
    ok = means[-1] > LEARNED and means[-1] > means[0] + 0.3
    print(f"load {os.getloadavg()[0]:.1f}; {'learns' if ok else 'does NOT learn'}: last window {means[-1]:.3f} vs "
          f"first {means[0]:.3f}, blind level {BLIND:.3f}")
    return 0 if ok else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20, help="steps before the measured window")
    ap.add_argument("--prep-steps", type=int, default=400, help="steps of the training that gives the runs their policy")
    ap.add_argument("--arm", action="append", default=[], help="NAME=OVERRIDE[ OVERRIDE...]: another agent arm")
    ap.add_argument("--learn", action="store_true", help="the learning check instead of the throughput pairs")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--cpu", action="store_true", help="print each process's CPU time per step of every run")
    ap.add_argument("--json", type=Path, help="also write the figures there (machine, runs, medians, ratios)")
    ap.add_argument("overrides", nargs="*", help="config overrides for --learn")
    a = ap.parse_args()
    if a.learn:
        with tempfile.TemporaryDirectory(prefix="agent-learn-") as tmp:
            raise SystemExit(learn(a.minutes, a.overrides, Path(tmp) / "run"))
    arms = {"agent": [], **{s.split("=", 1)[0]: shlex.split(s.split("=", 1)[1]) for s in a.arm},
            "token-level": TOKEN_LEVEL}
    rates: dict[str, list[float]] = {k: [] for k in arms}
    cpu: dict[str, list[dict]] = {k: [] for k in arms}
    lengths: dict[str, list[float]] = {k: [] for k in arms}
    loads = []
    unequal = []
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as tmp:
        policy = prepare(a.prep_steps, Path(tmp) / "prep")
        frozen = [f"model.path={policy}", f"train.lr={FROZEN_LR}"]
        for i in range(a.pairs):
            for name, overrides in arms.items():
                loads.append(os.getloadavg()[0])
                rate, per, length = run([*frozen, *overrides], a.steps, Path(tmp) / name, a.cpu, a.warmup)
                rates[name].append(rate)
                cpu[name].append(per)
                lengths[name].append(length)
                print(f"pair {i + 1} {name}: {rate:.1f} samples/s, response length {length:.1f} "
                      f"(load {loads[-1]:.1f})", flush=True)
            base = lengths["token-level"][-1]
            unequal += [f"pair {i + 1} {name}: {ls[-1]:.1f} against {base:.1f}" for name, ls in lengths.items()
                        if abs(ls[-1] - base) > SAME_WORK * base]
            if a.json:  # after every pair: a run stopped by a time cap keeps the pairs it finished
                a.json.write_text(json.dumps(figures(arms, rates, cpu, lengths, loads, a), indent=1) + "\n")
    for name, arm in figures(arms, rates, cpu, lengths, loads, a)["arms"].items():
        print(f"{name}: median {arm['median_samples_per_s']:.1f} samples/s "
              f"({', '.join(f'{x:.1f}' for x in arm['samples_per_s'])}); ratio to token-level median "
              f"{arm['ratio_median']:.2f} ({', '.join(f'{x:.2f}' for x in arm['ratios_to_token_level'])})")
    if unequal:
        raise SystemExit(f"unequal work (response lengths more than {SAME_WORK:.0%} apart): " + "; ".join(unequal))


def figures(arms: dict, rates: dict, cpu: dict, lengths: dict, loads: list, a) -> dict:
    """Machine, pairs done, and per arm its rates, their median, the ratios to token-level, its
    runs' response lengths."""
    base = rates["token-level"]
    done = len(base)
    result = {"machine": {"cpus": os.cpu_count(), "load_1min": [min(loads), max(loads)]},
              "pairs": a.pairs, "pairs_done": done, "prep_steps": a.prep_steps, "warmup": a.warmup, "steps": a.steps,
              "arms": {}}
    for name, r in rates.items():
        r = r[:done]
        ratios = [x / b for x, b in zip(r, base)]
        result["arms"][name] = {
            "overrides": arms[name], "samples_per_s": r, "median_samples_per_s": statistics.median(r),
            "ratios_to_token_level": ratios, "ratio_median": statistics.median(ratios),
            "response_len_mean": [round(x, 2) for x in lengths[name][:done]],
            "cpu_ms_per_step": {k: round(1000 * statistics.median(p[k] for p in cpu[name][:done] if k in p), 1)
                                for k in sorted({k for p in cpu[name][:done] for k in p})}}
    return result


if __name__ == "__main__":
    main()

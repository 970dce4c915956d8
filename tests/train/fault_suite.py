"""The fault-injection suite: chains of `moe-rl train` runs on configs/tiny.yaml, each run
crashed at a fault point (moe_rl/faults.py) drawn from a seed, then resumed with resume=true,
with the run directory checked after every crash and at the end.

After every crash: no process of the run left (5 s), metrics.jsonl holds steps 1..m once each,
the routing log reads end to end, the latest checkpoint loads; a failed checkpoint write left
no partial checkpoint and said why. At the end: steps 1..N exactly once, no prompt group
trained twice, and the final reward (next to an uninterrupted run's of the same seed).

  python -m tests.train.fault_suite --seeds 4 --kills 8 --json out.json   # the long sweep (docs/run_safety.md)

tests/train/test_run_safety.py runs one short chain in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

STEPS, EVERY = 60, 5
RUN = (f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "checkpoint.keep=2", "train.lr=0.003",
       "logging.progress=false", "logging.tensorboard=false")  # lr: the tiny task's reward rises clearly within 60 steps
SEED_KEYS = ("seed", "train.seed", "data.seed", "model.init_seed")
# hits of a point per trainer step on configs/tiny.yaml (prompts_per_step 8 x group_size 4): one
# /generate call per group (SGLang's batch form), one routing record per sample
PER_STEP = {"engine.generate": 8, "routing.append": 32}
CKPT_WRITES = 4  # checkpoint.write points per checkpoint on rank 0: hf/, rollout.pt, trainer_rank0.pt, latest


# a frozen (SIGSTOPped) rank is found within these (docs/run_safety.md, "Long runs"); the run
# must end within the bound that applies plus 30 s
FROZEN = ("engine.request_timeout_s=4", "sync.timeout_s=4", "dist.peer_timeout_s=4")


@dataclass(frozen=True)
class Fault:
    name: str
    point: str
    action: str
    rank: int | None = None
    expect: str | None = None  # a frozen rank: what the run's error must say (a regex)
    bound_s: float = 0.0  # a frozen rank: the timeout within which it is found

    def at(self, rng: random.Random, steps: int) -> int:
        """The hit of the point that lands about ``steps`` steps into a run (counted in the
        crashed process, from its start)."""
        if self.point in PER_STEP:
            return PER_STEP[self.point] * steps + rng.randrange(PER_STEP[self.point])
        if self.point in ("sync.bucket", "engine.update"):  # one bucket per sync on tiny; a resumed run syncs once at start
            return steps
        return CKPT_WRITES * max(0, steps // EVERY - 1) + rng.randrange(1, CKPT_WRITES + 1)  # checkpoint.write

    def overrides(self, at: int) -> list[str]:
        ov = [f"fault.point={self.point}", f"fault.action={self.action}", f"fault.at={at}"]
        return ov + ([f"fault.rank={self.rank}"] if self.rank is not None else []) + (
            list(FROZEN) if self.action == "stop" else [])


FAULTS = (
    Fault("SIGKILL of the whole tree mid-rollout", "engine.generate", "kill_tree"),
    Fault("SIGKILL of the whole tree mid-weight-sync", "sync.bucket", "kill_tree"),
    Fault("SIGKILL of the whole tree mid-checkpoint write", "checkpoint.write", "kill_tree", rank=0),
    Fault("SIGKILL of the whole tree mid-routing-log append", "routing.append", "kill_tree"),
    Fault("engine rank SIGKILLed mid-rollout", "engine.generate", "kill", rank=1),
    Fault("checkpoint write fails with ENOSPC", "checkpoint.write", "enospc", rank=0),
    # frozen, not dead: the one engine gives no answer (a rollout's request or the sync's pause
    # times out), the trainer ends the run naming it and the step
    Fault("engine rank frozen (SIGSTOP) mid-rollout", "engine.generate", "stop", rank=1, bound_s=4 + 4,
          expect=r"engine http://\S+ gave no answer within 4 s .*no other engine serves|every engine is down: "
                 r"http://\S+: .*no answer within"),
    # the engine host watching trainer rank 0 finds it silent and ends the run naming it
    Fault("trainer rank frozen (SIGSTOP) mid-weight-sync", "sync.bucket", "stop", rank=0, bound_s=4,
          expect=r"rank 1 \(engine host\): FrozenPeerError: trainer rank 0 \(pid \d+ on host \S+\) has sent no "
                 r"heartbeat for [\d.]+ s \(dist.peer_timeout_s=4\); its last one said: step \d+"),
    # the bucket's broadcast or the engine's answer times out: the sync names the engine
    Fault("engine rank frozen (SIGSTOP) mid-weight-sync", "engine.update", "stop", rank=1, bound_s=4 + 4 + 4,
          expect=r"engines still taking it \(stuck\?\): http://\S+|rejected: http://\S+: .*no answer within"),
)


@dataclass
class Chain:
    seed: int
    events: list[dict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def kills(self) -> int:
        return sum(e["fired"] for e in self.events)


def start(out: Path, *overrides: str) -> subprocess.Popen:
    """A `moe-rl train` run in a session of its own (a kill_tree fault takes it and every
    process under it, never the caller); stderr is piped."""
    args = [sys.executable, "-m", "moe_rl.cli", "train", "configs/tiny.yaml", f"output_dir={out}", *RUN, *overrides]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def train(out: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """One `moe-rl train` run to its end (or its crash)."""
    proc = start(out, *overrides)
    args = proc.args
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in run_processes(out) + [proc.pid]:
            os.kill(pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"`moe-rl train` into {out} did not end within {timeout} s")
    return subprocess.CompletedProcess(args, proc.returncode, "", err)


def seeded(seed: int) -> list[str]:
    return [f"{k}={seed}" for k in SEED_KEYS]


def run_processes(out: Path) -> list[int]:
    """Pids of live processes (not zombies) whose command line names ``output_dir=out``."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"output_dir={out}".encode() in cmd and state != "Z":
            pids.append(int(p.name))
    return pids


def wait_gone(out: Path, within: float = 5.0) -> float:
    """Seconds until no process of the run in ``out`` is alive; AssertionError after ``within``."""
    t0 = time.monotonic()
    while run_processes(out):
        if time.monotonic() - t0 > within:
            raise AssertionError(f"processes of the run in {out} alive {within} s after it ended: {run_processes(out)}")
        time.sleep(0.05)
    return time.monotonic() - t0


def read_rows(out: Path, complete: bool) -> list[dict]:
    """metrics.jsonl's rows; a crash may cut the last line short (``complete=False``)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            assert not complete and i == len(lines) - 1, f"{path}:{i + 1} is not JSON: {line[:80]!r}"
    return rows


def check_run_dir(out: Path, complete: bool) -> dict:
    """What must hold after any crash (``complete``: after a run that ended normally)."""
    import safetensors.torch
    import torch

    from moe_rl.replay import ReplayLog

    rows = read_rows(out, complete)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(steps) + 1)), f"metrics.jsonl steps are not 1..m once each: {steps}"
    records = 0
    if (out / "routing" / "meta.json").exists():
        log = ReplayLog(out / "routing", mode="r")
        for uid in log.uids():  # every record reads back and passes its CRC
            assert log.get(uid).shape[1:] == (log.num_layers, log.top_k)
            records += 1
        log.close()
    root = out / "checkpoints"
    latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
    if latest:
        ckpt = root / latest
        state = torch.load(ckpt / "trainer_rank0.pt", weights_only=False)
        assert f"step_{state['step']}" == latest
        torch.load(ckpt / "rollout.pt", weights_only=False)
        assert safetensors.torch.load_file(ckpt / "hf" / "model.safetensors")
        json.loads((ckpt / "hf" / "config.json").read_text())
    assert not list(root.glob("**/*.tmp")) or not complete, f"temp files left: {list(root.glob('**/*.tmp'))}"
    return dict(steps=len(steps), records=records, latest=latest)


def run_chain(out: Path, seed: int, kills: int, faults=FAULTS, log=print) -> Chain:
    """A run of STEPS steps crashed ``kills`` times (faults and points drawn from ``seed``),
    resumed after each; the last run goes to the end."""
    rng = random.Random(seed)
    chain = Chain(seed)
    t0 = time.monotonic()
    order = [faults[i % len(faults)] for i in range(kills)]
    rng.shuffle(order)
    for fault in order + [None]:
        before = check_run_dir(out, complete=False) if out.exists() else dict(steps=0, latest=None)
        start = int(before["latest"].split("_")[1]) if before["latest"] else 0
        resume = ["resume=true"] if before["latest"] else (["overwrite_output_dir=true"] if out.exists() else [])
        ov = []
        if fault is not None:  # a crash some steps into this run, before its end
            ahead = min(rng.randint(EVERY - 1, 3 * EVERY - 1), STEPS - start - 3)
            if ahead < 2:
                fault = None  # too close to the end for another crash: the final run
            else:
                ov = fault.overrides(fault.at(rng, ahead))
        t = time.monotonic()
        r = train(out, *seeded(seed), *resume, *ov)
        ended = time.time()
        gone = wait_gone(out)
        event = dict(fault=fault.name if fault else None, overrides=ov, resumed_from=start, rc=r.returncode,
                     wall_s=time.monotonic() - t, gone_s=gone)
        if r.returncode == 0:
            after = check_run_dir(out, complete=True)
            event.update(fired=False, **after)
            chain.events.append(event)
            log(f"  seed {seed}: {event['fault'] or 'final run'}: finished ({after['steps']} steps)")
            if after["steps"] == STEPS:
                break
            continue
        assert fault is not None, f"the final run failed (exit {r.returncode}):\n{r.stderr[-3000:]}"
        after = check_run_dir(out, complete=False)
        event.update(fired=True, **after)
        if fault.action == "kill_tree":
            assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
        elif fault.action == "kill":
            assert "rank 1 (engine host) ended first, with signal SIGKILL" in r.stderr, r.stderr[-3000:]
        elif fault.action == "stop":  # named, the step said, and within its timeout + 30 s of freezing
            assert re.search(fault.expect, r.stderr), r.stderr[-3000:]
            assert re.search(r"the run stopped at step \d+ of \d+|its last one said: step \d+", r.stderr), r.stderr[-3000:]
            frozen_at = float(re.search(r"\[fault injection\] stop at .* at unix time ([\d.]+)", r.stderr).group(1))
            event["ended_after_s"] = ended - frozen_at
            assert ended - frozen_at < fault.bound_s + 30, (ended - frozen_at, r.stderr[-3000:])
        else:  # enospc: said why, removed the partial checkpoint, kept the previous one in charge
            assert "could not be written: [Errno 28] No space left on device" in r.stderr, r.stderr[-3000:]
            assert ("is intact (`latest` names it)" if after["latest"] else "no earlier checkpoint") in r.stderr
            failed = [int(x) for x in _failed_steps(r.stderr)]
            assert failed and not any((out / "checkpoints" / f"step_{s}").exists() for s in failed)
            assert after["latest"] is None or int(after["latest"].split("_")[1]) < failed[0]
            assert not list((out / "checkpoints").glob("**/*.tmp")), "the failed write left a temp file"
        chain.events.append(event)
        log(f"  seed {seed}: {fault.name} ({' '.join(ov)}) from step {start}: fired at step ~{after['steps']}, "
            f"latest {after['latest']}, workers gone in {gone:.2f} s")
    chain.rows = read_rows(out, complete=True)
    chain.wall_s = time.monotonic() - t0
    return chain


def _failed_steps(stderr: str) -> list[str]:
    return re.findall(r"checkpoint \S*/step_(\d+) could not be written", stderr)


def final_reward(rows: list[dict], last: int = 10) -> float:
    return float(np.mean([r["reward_mean"] for r in rows[-last:]]))


def check_chain(chain: Chain) -> None:
    steps = [r["step"] for r in chain.rows]
    assert steps == list(range(1, STEPS + 1)), f"seed {chain.seed}: steps {steps}"
    groups = [g for r in chain.rows for g in r["groups"]]
    assert len(groups) == len(set(groups)), f"seed {chain.seed}: a prompt group was trained on twice"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--kills", type=int, default=8, help="crashes per chain (one chain per seed)")
    p.add_argument("--dir", default="runs/fault_suite")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    base = Path(a.dir).resolve()
    results = []
    for seed in range(a.seeds):
        chain = run_chain(base / f"chain{seed}", seed, a.kills)
        check_chain(chain)
        ref = base / f"uninterrupted{seed}"
        r = train(ref, *seeded(seed), *(["overwrite_output_dir=true"] if ref.exists() else []))
        assert r.returncode == 0, r.stderr[-3000:]
        results.append(dict(seed=seed, kills=chain.kills, events=chain.events, wall_s=chain.wall_s,
                            final_reward_chain=final_reward(chain.rows),
                            final_reward_uninterrupted=final_reward(read_rows(ref, complete=True))))
        print(f"seed {seed}: {chain.kills} crashes, final reward {results[-1]['final_reward_chain']:.3f} "
              f"(uninterrupted {results[-1]['final_reward_uninterrupted']:.3f}), {chain.wall_s:.0f} s")
    d = np.array([r["final_reward_chain"] - r["final_reward_uninterrupted"] for r in results])
    summary = dict(seeds=a.seeds, kills=int(sum(r["kills"] for r in results)),
                   duplicated_or_missing_steps=0, unreadable_records=0,  # check_run_dir/check_chain asserted both
                   final_reward_chain=[r["final_reward_chain"] for r in results],
                   final_reward_uninterrupted=[r["final_reward_uninterrupted"] for r in results],
                   diff_mean=float(d.mean()), diff_se=float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else None)
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(summary=summary, runs=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

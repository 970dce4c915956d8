"""`moe-rl sweep`: plan/validation, the per-run figures against a plain recomputation, and one
tiny real sweep (2 arms x 1 seed x 2 steps) that resumes without rerunning a finished arm."""
import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.experiments.sweep import parse_grid, plan, run_stats, summarise

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def test_grid_and_plan_validate_every_arm(tmp_path):
    assert parse_grid(["a.b=1,2", "c=x,true", "d="]) == {"a.b": [1, 2], "c": ["x", True], "d": []}
    cfg = load_config(TINY)
    runs = plan(TINY, cfg, {"rollout.max_staleness": [0, 2], "replay.enabled": [True, False]}, 3, 5, tmp_path, [])
    assert len(runs) == 12 and len({r.dir for r in runs}) == 12
    r = runs[0]
    assert r.arm == "max_staleness=0__enabled=true" and "train.steps=5" in r.overrides and "data.seed=0" in r.overrides
    # a mapping value sets several keys of a section together, named by its first entry
    (ppo, wide) = plan(TINY, cfg, {"algo": [{"clip_low": 0.2}, {"clip_low": 3e-4, "clip_high": 4e-4}]}, 1, None,
                       tmp_path, [])
    assert wide.arm == "clip_low=0.0003" and {"algo.clip_low=0.0003", "algo.clip_high=0.0004"} <= set(wide.overrides)
    with pytest.raises(ConfigError, match="algo.bogus: unknown key"):
        plan(TINY, cfg, {"algo.bogus": [1]}, 1, None, tmp_path, [])
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        plan(TINY, cfg, {"rollout.max_staleness": [-1]}, 1, None, tmp_path, [])


def test_run_stats_match_a_plain_recomputation():
    rewards = [0.0, 0.1, 0.2, 0.2, 0.5, 0.6, 0.6, 0.9]
    rows = [{"step": i + 1, "reward_mean": r, "samples": 32, "mismatch_k3": 0.01 * (i + 1), "tokens_per_s": 100.0 + i,
             "icepop_frac": 0.0, "wall_s": 2.0 * (i + 1), **({"routing_match": 0.5} if i % 2 else {})}
            for i, r in enumerate(rewards)]
    s = run_stats(rows, threshold=0.55)
    # last quarter = last 2 steps; trailing window = max(1, 8 // 10) = 1 step
    assert s["final_reward"] == pytest.approx((0.6 + 0.9) / 2)
    assert s["steps_to_threshold"] == 6
    assert s["mismatch_k3"] == pytest.approx(sum(0.01 * k for k in range(1, 9)) / 8)
    assert s["routing_match"] == pytest.approx(0.5)
    assert s["samples_per_s"] == pytest.approx(8 * 32 / 16.0)
    assert run_stats(rows, threshold=2.0)["steps_to_threshold"] is None


def test_summary_mean_std_over_seeds(tmp_path):
    cfg = load_config(TINY)
    runs = plan(TINY, cfg, {"replay.enabled": [True]}, 3, None, tmp_path, [])
    finals = [0.2, 0.4, 0.9]
    for r, f in zip(runs, finals):
        r.dir.mkdir(parents=True)
        (r.dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": f, "samples": 4, "wall_s": 1.0,
                                                          "mismatch_k3": 0.0, "tokens_per_s": 1.0, "icepop_frac": 0}) + "\n")
        (r.dir / "done.json").write_text("{}")
    (row,) = summarise(runs, tmp_path, 0.5)
    mean = sum(finals) / 3
    std = (sum((x - mean) ** 2 for x in finals) / 2) ** 0.5
    assert row["final_reward_mean"] == pytest.approx(mean) and row["final_reward_std"] == pytest.approx(std)
    assert row["reached_threshold"] == 1 and row["steps_to_threshold_mean"] == 1
    assert (tmp_path / "reward_by_version.png").stat().st_size > 0 and (tmp_path / "reward.png").stat().st_size > 0 and "± " in (tmp_path / "summary.md").read_text()


@pytest.mark.slow(longest=True)  # long: scheduled first (tests/conftest.py); runs in CI
def test_tiny_sweep_runs_and_resumes(tmp_path):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "moe_rl.cli", "sweep", TINY, "--grid", "replay.enabled=true,false",
           "--seeds", "1", "--steps", "2", "--out", str(out), "rollout.prompts_per_step=2", "rollout.group_size=2",
           "rollout.max_new_tokens=4", "train.micro_batch_size=4",
           "engine.dtype=bfloat16"]  # the mismatch case: a bf16 engine is sent bf16 weights by the fp32 trainer
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert sorted(x["arm"] for x in rows) == ["enabled=false", "enabled=true"]
    for arm in ("enabled=true", "enabled=false"):
        assert len((out / arm / "seed0" / "metrics.jsonl").read_text().splitlines()) == 2
    on = next(x for x in rows if x["arm"] == "enabled=true")
    assert float(on["routing_match_mean"]) == pytest.approx(1.0)  # replay on: the trainer used the engine's routing
    for f in ("summary.md", "summary.json", "reward.png", "mismatch_kl.png"):
        assert (out / f).stat().st_size > 0
    stamp = (out / "enabled=true" / "seed0" / "done.json").stat().st_mtime_ns
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "2 already done, 0 to run" in r.stderr
    assert (out / "enabled=true" / "seed0" / "done.json").stat().st_mtime_ns == stamp
    # runs cut short are the sweep's own: continued from a checkpoint, or started over without one
    cut, bare = out / "enabled=true" / "seed0", out / "enabled=false" / "seed0"
    for d in (cut, bare):
        (d / "done.json").unlink()
    shutil.rmtree(bare / "checkpoints")
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "0 already done, 2 to run" in r.stderr, r.stderr[-3000:]
    assert "--- moe-rl sweep: resume=true ---" in (cut / "train.log").read_text()
    assert "--- moe-rl sweep: overwrite_output_dir=true ---" in (bare / "train.log").read_text()
    for d in (cut, bare):
        assert [json.loads(l)["step"] for l in (d / "metrics.jsonl").read_text().splitlines()] == [1, 2]
        assert (d / "done.json").exists() and (d / "checkpoints" / "latest").exists()


def test_reward_by_version_shifts_by_staleness():
    from moe_rl.experiments.sweep import gen_versions, reward_in_versions

    rows = [{"step": t, "reward_mean": float(t), "staleness_mean": 2.0 if t > 2 else 0.0} for t in range(1, 9)]
    # step t was sampled by version t-1-2 (t > 2): versions 0,1,0,1,2,3,4,5
    assert list(gen_versions(rows)) == [0, 1, 0, 1, 2, 3, 4, 5]
    assert reward_in_versions(rows, 4, 5) == pytest.approx((7 + 8) / 2)
    assert reward_in_versions(rows, 9, 10) is None


def test_version_window_is_the_last_quarter_every_run_sampled():
    from moe_rl.experiments.sweep import version_window

    sync = [{"step": t, "reward_mean": 0.0, "staleness_mean": 0.0} for t in range(1, 101)]  # versions 0..99
    stale = [{"step": t, "reward_mean": 0.0, "staleness_mean": 1.5} for t in range(1, 101)]  # versions -1.5..97.5
    assert version_window([sync, stale]) == (74.0, 97.5)  # from 100 * 0.75 - 1 to the lower of the two tops


def test_paired_differences_match_a_plain_recomputation():
    from moe_rl.experiments.sweep import paired

    base = [{"final_reward": x, "eval_reward": None} for x in (0.5, 0.4, 0.3)]
    other = [{"final_reward": x, "eval_reward": None} for x in (0.1, 0.45, 0.3)]  # seeds 2, 0, 1
    (p,) = paired({"a": base, "b": other}, {"a": [0, 1, 2], "b": [2, 0, 1]})
    d = [0.1 - 0.3, 0.45 - 0.5, 0.3 - 0.4]  # same seed minus same seed
    m = sum(d) / 3
    se = (sum((x - m) ** 2 for x in d) / 2) ** 0.5 / 3 ** 0.5
    assert p["baseline"] == "a" and p["pairs"] == 3
    assert p["final_reward_diff"] == pytest.approx(m) and p["final_reward_diff_se"] == pytest.approx(se)
    assert p["eval_reward_diff"] is None

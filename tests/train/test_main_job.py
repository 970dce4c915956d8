"""The main job end to end: `moe-rl train` worlds (1 trainer + 1 embedded engine over gloo)."""
import os
import subprocess
import sys

import pytest
import torch

from moe_rl.train.tracking import read_metrics


def train(tmp_path, *overrides, name="run", check=True):
    out = tmp_path / name
    args = [sys.executable, "-m", "moe_rl.cli", "train", "configs/tiny.yaml", f"output_dir={out}",
            "logging.progress=false", *overrides]
    r = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return out, r


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
@pytest.mark.parametrize("eta, pause", [(2, "abort"), (0, "in_place")])
def test_train_world_runs_and_reports(tmp_path, eta, pause):
    out, _ = train(tmp_path, "train.steps=6", f"rollout.max_staleness={eta}", f"sync.pause_mode={pause}",
                   "checkpoint.every=3", "data.task_args.long_tail=true")
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert 0.0 <= r["reward_mean"] <= 1.0
        assert r["staleness_max"] <= eta  # the bound, measured per token
        # R3 on: where the engine's routing is replayed (samples made with the trainer's weights)
        # the trainer used the engine's experts; a step of only stale samples replays none
        assert r.get("routing_match", 1.0) == 1.0 and ("routing_match" in r or eta > 0)
        assert eta > 0 or "routing_match_stale" not in r
        assert r["samples"] == 8 * 4 and r["dropped_stale_groups"] == 0
        assert r["mismatch_k3"] >= 0 and r["sync_s"] > 0
        assert 0 < r["busy_trainer"] <= 1 and 0 < r["busy_rollout"] <= 1
        assert sum(v for k, v in r.items() if k.startswith("staleness_hist_")) == r["train_tokens"]
        # tokens the engines returned since the last row: none in a short step whose samples were all
        # made before it (the staleness bound lets the buffer run ahead); the run's total is checked below
        assert r["tokens_per_s"] > 0 and r["rollout_tokens_per_s"] >= 0
    # rollout tokens/s x each step's wall time adds up to every generated token: at least the trained ones
    walls = [0.0] + [r["wall_s"] for r in rows]
    generated = sum(r["rollout_tokens_per_s"] * (walls[i + 1] - walls[i]) for i, r in enumerate(rows))
    assert generated >= sum(r["train_tokens"] for r in rows) - 0.5
    if eta == 0:  # synchronous: every token comes from the policy being trained
        assert all(r["mismatch_k3"] < 1e-6 for r in rows)
    assert (out / "reward_curve.png").stat().st_size > 0
    assert list((out / "tensorboard").iterdir())
    # HF weights of the last checkpoint load in transformers and equal the trainer's state
    transformers = pytest.importorskip("transformers")
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(ckpt / "hf").eval()
    state = torch.load(ckpt / "trainer_rank0.pt", weights_only=False)["backend"]["model"]
    torch.testing.assert_close(hf.lm_head.weight, state["lm_head.weight"], rtol=0, atol=0)


# evaluation between steps and a tracker ride along the resume test's two worlds (one pair of worlds for both)
EVAL = ["eval.every=2", "eval.prompts=6", "eval.samples=3", "eval.pass_threshold=0.0625", "logging.wandb=true"]
EVAL_KEYS = ("eval/reward_mean", "eval/pass@1", "eval/pass@3", "eval/response_len_mean")


@pytest.mark.slow(longest=True)  # long: scheduled first (tests/conftest.py); runs in CI
def test_resume_continues_without_losing_or_repeating_groups(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")  # noqa: F841
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    out, _ = train(tmp_path, "train.steps=3", "checkpoint.every=2", *EVAL)
    first = read_metrics(out / "metrics.jsonl")
    out, _ = train(tmp_path, "train.steps=7", "checkpoint.every=2", "resume=true", *EVAL)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert rows[:3] == first  # the resumed run kept the first run's lines
    consumed = [g for r in rows for g in r["groups"]]
    assert len(consumed) == len(set(consumed)), "a prompt group was trained on twice"
    # every prompt drawn so far is accounted for: consumed, in the buffer, or in flight
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    rollout = torch.load(ckpt / "rollout.pt", weights_only=False)
    buffered = [g["group_id"] for g in rollout["buffer"]["groups"]]
    accounted = consumed + buffered + rollout["pending"] + rollout["buffer"]["dropped_ids"]
    assert sorted(accounted) == list(range(rollout["next_index"]))
    _check_evaluations(out, first, rows)


def _check_evaluations(out, first, rows):
    """eval.every=2: evaluated at steps 2 and 3 (the last) by the first run, 4, 6 and 7 by the
    resumed one; the evaluation after the last step, run on the rollout engines, equals the
    final checkpoint scored apart (an embedded engine in this process, the same prompts and
    sampling seeds); W&B got the same from trainer rank 0 alone, one run continued by the resume."""
    from moe_rl.config import load_config
    from moe_rl.experiments.evaluate import evaluate_run
    from moe_rl.train.trackers import read_ids
    from tests.train.wandb_records import offline_run, read_run

    assert [r["step"] for r in first if "eval/reward_mean" in r] == [2, 3]
    assert [r["step"] for r in rows if "eval/reward_mean" in r] == [2, 3, 4, 6, 7]
    for r in rows:
        if "eval/reward_mean" in r:
            assert r["eval/prompts"] == 6 and r["eval/samples"] == 3 and r["eval/failed_samples"] == 0
            assert 0 <= r["eval/pass@1"] <= r["eval/pass@3"] <= 1 and r["eval/time_s"] > 0
    assert 0 < rows[-1]["eval/pass@1"] < 1  # a measure that tells these policies apart
    apart = evaluate_run(out, load_config("configs/tiny.yaml", [f"output_dir={out}", *EVAL]))
    assert apart["checkpoint"].endswith("step_7/hf")
    assert {k: rows[-1][k] for k in EVAL_KEYS} == pytest.approx({k: apart[k] for k in EVAL_KEYS}, abs=1e-12)
    wandb_id = read_ids(out)["wandb"]
    files = offline_run(out, wandb_id)
    assert len(files) == 2 and len(list((out / "wandb").glob("offline-run-*"))) == 2
    logged = [h for f in files for h in read_run(f)["history"] if "reward_mean" in h]
    assert [h["step"] for h in logged] == [1, 2, 3, 4, 5, 6, 7]
    assert {h["step"]: h["eval/pass@3"] for h in logged if "eval/pass@3" in h} == \
        {r["step"]: r["eval/pass@3"] for r in rows if "eval/pass@3" in r}


def test_bad_config_fails_before_launch(tmp_path):
    _, r = train(tmp_path, "rollout.max_stalenes=2", check=False)
    assert r.returncode == 2
    assert "rollout.max_stalenes: unknown key (did you mean 'rollout.max_staleness'?)" in r.stderr


def test_bad_dataset_line_fails_before_launch_naming_the_line(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answr": "4"}\n')
    _, r = train(tmp_path, "data.task=jsonl", f"data.path={data}", check=False)
    assert r.returncode == 2
    assert f"{data}:2:" in r.stderr and "answer" in r.stderr


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
def test_a_dead_engine_ends_the_run_with_a_clear_error(tmp_path):
    import signal
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_rl.cli", "train", "configs/tiny.yaml", f"output_dir={out}",
         "logging.progress=false", "train.steps=100000"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            assert time.time() < deadline and proc.poll() is None, "training did not start"
            time.sleep(0.2)
        engine = [p for p in _children(proc.pid) if "moe_rl.launch" in _cmdline(p) and _env(p).get("RANK") == "1"][0]
        os.kill(engine, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "error: the run failed: rank 1 (engine host) ended first, with signal SIGKILL" in err


def _children(pid):
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for c in f.read().split():
                out += [int(c)] + _children(int(c))
    return out


def _env(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)


def _cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()

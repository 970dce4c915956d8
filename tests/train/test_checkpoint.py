"""Checkpoints and metrics across crashes: a failed write keeps the previous checkpoint in
charge and says why; leftovers of a crashed run are cleared; a torn metrics line is dropped."""
import json

import pytest
import torch

from moe_rl import faults
from moe_rl.config import FaultConfig, load_config
from moe_rl.train.backend import NativeBackend
from moe_rl.train.checkpoint import CheckpointWriteError, latest_checkpoint, load_checkpoint, save_checkpoint
from moe_rl.train.tracking import Tracker, read_metrics


@pytest.fixture
def backend():
    return NativeBackend(load_config("configs/tiny.yaml"))


@pytest.fixture(autouse=True)
def _disarm():
    yield
    faults.arm(FaultConfig(), 0)


def _save(run, step, backend):
    return save_checkpoint(run, step, backend, None, {"step": step, "version": step}, {"next_index": step}, keep=2)


@pytest.mark.parametrize("hit", [1, 2, 3, 4])  # hf/, rollout.pt, trainer_rank0.pt, latest
def test_a_full_disk_keeps_the_previous_checkpoint_and_says_why(tmp_path, backend, hit):
    _save(tmp_path, 5, backend)
    faults.arm(FaultConfig(point="checkpoint.write", at=hit, action="enospc"), rank=0)
    with pytest.raises(CheckpointWriteError) as e:
        _save(tmp_path, 10, backend)
    msg = str(e.value)
    assert "step_10 could not be written: [Errno 28] No space left on device" in msg
    assert "step_5 is intact (`latest` names it) and resume=true continues from it" in msg
    ckpts = tmp_path / "checkpoints"
    assert latest_checkpoint(tmp_path) == ckpts / "step_5"
    assert not (ckpts / "step_10").exists() and not list(ckpts.glob("**/*.tmp"))
    state, rollout = load_checkpoint(ckpts / "step_5", backend, rank=0)
    assert state["step"] == 5 and rollout == {"next_index": 5}
    faults.arm(FaultConfig(), 0)
    _save(tmp_path, 10, backend)  # space again: the next write succeeds
    assert latest_checkpoint(tmp_path) == ckpts / "step_10"


def test_leftovers_of_a_crashed_run_are_replaced_and_pruned(tmp_path, backend):
    _save(tmp_path, 5, backend)
    ckpts = tmp_path / "checkpoints"
    # a run resumed from step 5 had crashed while writing step 10 and after starting step 15
    (ckpts / "step_10" / "hf").mkdir(parents=True)
    (ckpts / "step_10" / "trainer_rank0.pt.tmp").write_bytes(b"torn")
    (ckpts / "step_15").mkdir()
    _save(tmp_path, 10, backend)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_10", "step_5"]
    assert not (ckpts / "step_10" / "trainer_rank0.pt.tmp").exists()
    assert torch.load(ckpts / "step_10" / "trainer_rank0.pt", weights_only=False)["step"] == 10
    _save(tmp_path, 15, backend)  # keep=2
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_10", "step_15"]


def test_resume_drops_a_metrics_line_cut_short_and_the_steps_after_the_checkpoint(tmp_path):
    rows = [json.dumps({"step": s, "reward_mean": 0.1 * s}) for s in range(1, 8)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 8, "rew')  # killed mid-write
    t = Tracker(tmp_path, tensorboard=False, progress=False, start_step=5)
    t.log(6, {"reward_mean": 0.5})
    t._file.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    (tmp_path / "metrics.jsonl").write_text(rows[0] + "\n{not json\n" + rows[1] + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a JSON object"):
        Tracker(tmp_path, tensorboard=False, progress=False, start_step=5)

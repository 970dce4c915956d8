"""The main job on one GPU: trainer and embedded engine colocated on GPU 0 (the issue-18 failure:
the engine rank used to call torch.cuda.set_device(LOCAL_RANK=1) on a 1-GPU machine)."""
import os
import subprocess
import sys

import pytest

from moe_rl.train.tracking import read_metrics

pytestmark = pytest.mark.gpu


def train(tmp_path, *overrides, check=True):
    # eager (train.compile is on by default with CUDA): these runs check placement and the sync
    # backends, and the GPU round gives the whole GPU test stage under two minutes
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "configs/tiny.yaml", f"output_dir={out}",
                        "logging.progress=false", "train.compile=false", *overrides], capture_output=True,
                       text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=240)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return out, r


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_tiny_colocated_on_one_gpu(tmp_path, backend):
    out, r = train(tmp_path, "train.device=cuda", f"sync.backend={backend}", "placement.gpus=[0,0]", "train.steps=6",
                   "checkpoint.every=0")
    rows = read_metrics(out / "metrics.jsonl")
    assert [x["step"] for x in rows] == list(range(1, 7))
    for x in rows:
        assert x["routing_match"] > 0.95  # the trainer follows the engine's experts (CUDA kernels may flip near-ties)
        assert x["sync_s"] > 0 and x["tokens_per_s"] > 0 and x["rollout_tokens_per_s"] > 0
        assert x["samples"] == 8 * 4
    assert "on GPU 0 (shared with another rank)" in r.stderr


def test_nccl_sync_on_one_gpu_is_refused_before_launch(tmp_path):
    _, r = train(tmp_path, "train.device=cuda", "placement.gpus=[0,0]", check=False)
    assert r.returncode == 2 and "sync.backend=auto uses NCCL" in r.stderr

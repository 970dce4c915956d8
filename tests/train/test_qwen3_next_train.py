"""The main job with configs/qwen3_next_tiny.yaml (1 trainer + 1 embedded engine): a hybrid Gated
DeltaNet MoE trained and served, synchronously (staleness 0). The engine decodes recurrently,
the trainer runs the chunked rule over packed sequences: their log-probs agree (mismatch_k3 <
1e-5, the target; measured ~1e-14), routing replay matches (every layer MoE), and the HF
checkpoint written loads in transformers' Qwen3NextForCausalLM with the trainer's logits."""
import os
import subprocess
import sys

import pytest
import torch

from moe_rl.model import load_hf
from moe_rl.train.tracking import read_metrics


@pytest.mark.slow  # a `moe-rl train` world (~30 s on 2 quiet cores); run in CI all the same
def test_hybrid_model_trains_and_serves_in_sync(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    args = [sys.executable, "-m", "moe_rl.cli", "train", "configs/qwen3_next_tiny.yaml", f"output_dir={out}",
            "logging.progress=false", "train.steps=3", "rollout.max_staleness=0", "checkpoint.every=3"]
    r = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [x["step"] for x in rows] == [1, 2, 3]
    for x in rows:
        assert x["staleness_max"] == 0 and x["mismatch_k3"] < 1e-5 and x["routing_match"] == 1.0
    hf = out / "checkpoints" / "step_3" / "hf"
    ours = load_hf(hf)
    ref = transformers.Qwen3NextForCausalLM.from_pretrained(hf).eval()
    ids = torch.randint(0, 64, (2, 80))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=0)

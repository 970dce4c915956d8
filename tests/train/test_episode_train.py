"""Multi-turn episodes through the whole job: `moe-rl train configs/guess_number.yaml`."""
import os
import subprocess
import sys

import pytest

from moe_rl.train.tracking import read_metrics


@pytest.mark.slow  # a `moe-rl train` world each
@pytest.mark.parametrize("eta, pause", [(0, "in_place"), (2, "abort")])
def test_guess_number_world_trains_on_model_tokens_only(tmp_path, eta, pause):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "configs/guess_number.yaml", f"output_dir={out}",
                        "logging.progress=false", "train.steps=4", f"rollout.max_staleness={eta}",
                        f"sync.pause_mode={pause}"],
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        assert row["samples"] == 8 * 8 and row["failed_samples"] == 0 and row["env_failures"] == 0
        assert 1 <= row["turns_mean"] <= 3
        # one token per model turn: the trainer's tokens are the model's, none of the
        # environment's (each turn but the last adds 2 observation tokens to the sequence)
        assert row["train_tokens"] == round(row["turns_mean"] * row["samples"])
        assert row.get("routing_match", 1.0) == 1.0 and ("routing_match" in row or eta > 0)  # R3 over whole episodes
        assert row["staleness_max"] <= eta
        assert sum(v for k, v in row.items() if k.startswith("staleness_hist_")) == row["train_tokens"]
        if eta == 0:  # on-policy: the engine's log-probs of the model tokens are the trainer's
            assert row["mismatch_k3"] < 1e-6

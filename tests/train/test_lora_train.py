"""LoRA in the main job: `moe-rl train` with lora.enabled (1 trainer + 1 embedded engine)."""
import os
import subprocess
import sys

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.model import MoEForCausalLM, load_hf
from moe_rl.model.lora import LoraAdapters, load_peft
from moe_rl.train.tracking import read_metrics



def train(tmp_path, *overrides):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "moe_rl.cli", "train", "configs/tiny.yaml", f"output_dir={out}",
            "logging.progress=false", *overrides]
    r = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r

LORA = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8", "rollout.max_staleness=0", "train.lr=0.01",
        "lora.targets=[q_proj,o_proj,router,experts.gate_up_proj,experts.down_proj]"]


def _check_rows(rows):
    for r in rows:
        assert r["mismatch_k3"] < 1e-6  # synchronous: the engine's log-probs are the trainer's
        assert r["routing_match"] == 1.0  # R3 with an adapted router: replayed = recorded


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
def test_lora_adapter_sync_checkpoint_and_resume(tmp_path):
    args = [*LORA, "lora.sync=adapter", "checkpoint.every=2"]
    out, _ = train(tmp_path, "train.steps=4", *args)
    first = read_metrics(out / "metrics.jsonl")
    _check_rows(first)
    out, _ = train(tmp_path, "train.steps=6", *args, "resume=true")
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7)) and rows[:4] == first
    _check_rows(rows)

    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    cfg = load_config("configs/tiny.yaml", [])
    base = MoEForCausalLM(cfg.model.arch()).init_weights(cfg.model.init_seed, std=cfg.model.init_std)
    state = torch.load(ckpt / "trainer_rank0.pt", weights_only=False)["backend"]
    for n, t in base.state_dict().items():  # the base stayed frozen
        assert torch.equal(state["model"][n], t), n
    ad = LoraAdapters(base, 4, 8.0, ["q_proj", "o_proj", "router", "experts.gate_up_proj", "experts.down_proj"])
    load_peft(ad, ckpt / "adapter")
    assert any(b.abs().max() > 0 for b in ad.B.values())  # trained
    merged = load_hf(ckpt / "hf")  # the merged export
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad(), ad.applied():
        torch.testing.assert_close(merged(ids), base(ids), atol=1e-6, rtol=0)


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
def test_lora_shared_outer_adapter_sync(tmp_path):
    """Shared outer expert factors through the main job: adapter-only sync to the embedded engine
    (same log-probs), and a checkpoint whose PEFT file loads into per-expert adapters equal to
    the shared ones broadcast over the experts."""
    out, _ = train(tmp_path, "train.steps=3", *LORA, "lora.sync=adapter", "lora.experts_shared_outer=true",
                   "checkpoint.every=3")
    _check_rows(read_metrics(out / "metrics.jsonl"))
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    cfg = load_config("configs/tiny.yaml", [])
    targets = ["q_proj", "o_proj", "router", "experts.gate_up_proj", "experts.down_proj"]
    base = MoEForCausalLM(cfg.model.arch()).init_weights(cfg.model.init_seed, std=cfg.model.init_std)
    shared = load_peft(LoraAdapters(base, 4, 8.0, targets, shared_outer=True), ckpt / "adapter")
    per = load_peft(LoraAdapters(base, 4, 8.0, targets), ckpt / "adapter")
    key = "model__layers__0__mlp__experts__gate_up_proj"
    assert shared.A[key].shape[0] == 1 and per.A[key].shape[0] == cfg.model.num_experts
    assert torch.equal(per.A[key], shared.A[key].expand_as(per.A[key]))
    assert any(b.abs().max() > 0 for b in shared.B.values())  # trained


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
def test_lora_merged_sync(tmp_path):
    out, _ = train(tmp_path, "train.steps=3", *LORA, "lora.sync=merged")
    _check_rows(read_metrics(out / "metrics.jsonl"))


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
@pytest.mark.parametrize("shared", [False, True])
def test_lora_adapter_sync_through_sglang_lora_endpoints(tmp_path, shared):
    """engine.kind=sglang with lora.sync=adapter: every step's adapter goes as a PEFT directory
    over /load_lora_adapter (moe_rl.sync.adapter_files) to a `moe-rl serve` engine, and the
    rollouts name it. Synchronous, so the engine's log-probs must be the trainer's. With shared
    outer factors the files are SGLang's 3-D shared-outer form."""
    from tests.engine.helpers import OVERRIDES, ServerProc

    targets = "lora.targets=[q_proj,v_proj,o_proj,experts.gate_up_proj,experts.down_proj]"
    common = ["lora.enabled=true", "lora.sync=adapter", "lora.rank=4", "lora.alpha=8", targets,
              f"lora.experts_shared_outer={str(shared).lower()}"]
    s = ServerProc(common)
    try:
        out, _ = train(tmp_path, *OVERRIDES, *common, "rollout.max_staleness=0", "train.lr=0.01", "train.steps=3",
                       "engine.kind=sglang", f'engine.urls=["{s.url}"]', "pools.rollout=0")
    finally:
        s.stop()
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 3
    for r in rows:
        assert r["mismatch_k3"] < 1e-6
    assert sorted(p.name for p in (out / "lora_sync").iterdir()) == ["moe-rl-v3"]  # older versions unloaded
    from moe_rl.model.lora import read_peft
    _, sd = read_peft(out / "lora_sync" / "moe-rl-v3")
    assert any(".experts.0." in k for k in sd) == (not shared)
    assert any(k.endswith("mlp.experts.gate_up_proj.lora_A.weight") and t.shape[0] == 1 for k, t in sd.items()) == shared

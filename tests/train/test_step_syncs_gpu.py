"""Host syncs of one training step on a real GPU: CUDA's sync debug mode warns on
every operation that makes the host wait for the device; one step of the real
``Trainer.train_step`` must make exactly one, the read of its metrics at its end. The CPU form
of this check runs on ``fakedev`` (tests/train/test_device_discipline.py); this one also sees
what fakedev cannot: CUDA's own syncs inside ops, the Triton grouped GEMM and the compiled
blocks (train.compile, on by default on CUDA)."""
from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

from moe_rl.config import load_config
from tests.train.test_device_discipline import TINY, _batch, _trainer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("overrides", [
    ["train.compile=true"],  # fp32: the Triton grouped GEMM, compiled blocks, the fused loss
    ["train.compile=false", "train.fused_loss=false", "model.dtype=bfloat16"],  # CUTLASS, eager, general loss
], ids=["compiled-fp32", "eager-bf16-general"])
def test_one_step_syncs_once(overrides):
    cfg = load_config(None, [*TINY, *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        batch = _batch(cfg, tmp)
        trainer = _trainer(cfg, "cuda", tmp)
        trainer.train_step(batch)  # warm-up: compiles, allocator, lazy CUDA init
        trainer.version += 1
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                metrics = trainer.train_step(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchronizing CUDA operation" in str(w.message)]
    assert metrics["train_tokens"] > 0 and metrics["routing_match"] == 1.0
    assert len(syncs) == 1, [f"{w.filename}:{w.lineno}" for w in syncs][:20]
    # AdamW's fused CUDA kernel (over fp32 main params in bf16), syncs counted above
    opt = trainer.backend.optimizer
    assert getattr(opt, "optimizer", opt).defaults["fused"] is True

"""``train.cuda_graphs`` on a real GPU: the trainer's steps with the compiled blocks replayed as
CUDA graphs equal the steps with the same blocks compiled alone (the same Inductor kernels), over
several micro-batches (gradient accumulation across replays of one recording), a no_grad
proximal forward (two minibatches) and a second step that replays what the first recorded; and
no recording is skipped (a skip is an error: compile_blocks). The CPU side (options, padding,
the record's copy, refusals) is tests/model/test_compiled_blocks.py and
tests/train/test_equal_micro_batches.py."""
from __future__ import annotations

import tempfile

import pytest
import torch

from moe_rl.config import load_config
from tests.train.test_device_discipline import TINY, _assert_same_steps, _batch, _rotated_steps, _trainer

pytestmark = pytest.mark.gpu

STEP = [*TINY, "train.device=cuda", "train.compile=true", "train.minibatches=2", "train.micro_batch_size=1", "train.token_bucket=32"]


@pytest.mark.slow  # two compiles: scheduled first
def test_graphed_steps_equal_compiled_steps():
    from torch._dynamo.utils import counters

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        batch = _batch(load_config(None, STEP), tmp)
        for graphs in (False, True):
            torch._dynamo.reset()
            counters.clear()
            cfg = load_config(None, [*STEP, f"train.cuda_graphs={str(graphs).lower()}"])
            results[graphs] = _rotated_steps(_trainer(cfg, "cuda", tmp), batch)
            if graphs:
                assert counters["inductor"]["cudagraph_skips"] == 0
    _assert_same_steps(results[True], results[False], metric_abs=1e-6)

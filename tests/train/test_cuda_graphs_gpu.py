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
from tests.train.test_device_discipline import TINY, _batch, _trainer

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
            trainer = _trainer(cfg, "cuda", tmp)
            metrics = []
            for r in range(2):
                metrics.append(trainer.train_step(batch[r:] + batch[:r]))
                trainer.version += 1
            b = trainer.backend
            results[graphs] = metrics, [p.detach().clone() for p in b.dense_params + b.expert_params]
            if graphs:
                assert counters["inductor"]["cudagraph_skips"] == 0
    (m_plain, p_plain), (m_graph, p_graph) = results[False], results[True]
    for a, b in zip(m_graph, m_plain):
        for k in b:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    for a, b in zip(p_graph, p_plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

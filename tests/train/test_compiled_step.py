"""``train.compile``: the trainer's step with compiled decoder blocks equals the eager step, and
the key's choices and refusals.

The step runs the real ``Trainer.train_step`` (tests/train/test_device_discipline.py's batch:
replayed and stale samples, a multi-turn episode, two minibatches so the proximal forward runs
under no_grad, LoRA on attention, router and experts). The blocks are compiled with dynamo's
``eager`` backend: what is checked here is the trainer's use of them (adapters attached once,
records checked before the blocks, the routing recorded); inductor's code is checked against
eager in tests/model/test_compiled_blocks.py.
"""
from __future__ import annotations

import logging
import tempfile

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from moe_rl.config import ConfigError, load_config
from moe_rl.model.transformer import BLOCK_GRAPHS, MoEForCausalLM
from moe_rl.train.backend import use_compile

from tests.train.test_device_discipline import TINY, _batch, _trainer

STEP = [*TINY, "replay.stale=trainer", "train.minibatches=2", "lora.rank=4",
        "lora.targets=[q_proj,router,experts.gate_up_proj,experts.down_proj]"]


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
def test_a_compiled_step_equals_the_eager_step(monkeypatch):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compile_blocks = MoEForCausalLM.compile_blocks
    monkeypatch.setattr(MoEForCausalLM, "compile_blocks", lambda self, **o: compile_blocks(self, backend=counter, **o))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        batch = _batch(load_config(None, STEP), tmp)
        for mode in ("false", "true"):
            cfg = load_config(None, [*STEP, f"train.compile={mode}"])
            trainer = _trainer(cfg, None, tmp)
            assert trainer.backend.compiled == (mode == "true")
            metrics = trainer.train_step(batch)
            b = trainer.backend
            results[mode] = metrics, [p.detach().clone() for p in b.dense_params + b.expert_params]
            if mode == "true":  # more steps, the samples packed otherwise: other lengths, the
                seen = [counter.frame_count]  # same kinds of call (measured: 12, then 16, 16)
                for r in range(1, 3):
                    trainer.version += 1
                    trainer.train_step(batch[r:] + batch[:r])
                    seen.append(counter.frame_count)
                assert seen[1] == seen[2], seen
    (m_eager, p_eager), (m_comp, p_comp) = results["false"], results["true"]
    assert m_comp.keys() == m_eager.keys() and m_comp["routing_match"] == 1.0
    for k in m_eager:
        assert m_comp[k] == pytest.approx(m_eager[k], rel=1e-5, abs=1e-7), k
    for a, b in zip(p_comp, p_eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # dense or MoE block x grad or no_grad x replay or not x input requiring grad or not (LoRA
    # freezes the embedding) x one sequence or several: 16 kinds met here, whatever the lengths
    assert 0 < counter.frame_count <= 16 < BLOCK_GRAPHS
    torch._dynamo.reset()


def test_the_choice_and_its_refusals(caplog):
    def cfg(*o):
        return load_config(None, [*TINY, *o])

    with caplog.at_level(logging.INFO):
        assert not use_compile(cfg(), logging.getLogger("t"))  # auto: off on the CPU
    assert "train.compile=auto is off on the CPU" in caplog.text
    assert use_compile(cfg("train.compile=true"))
    assert not use_compile(cfg("train.compile=false"))
    with pytest.raises(ConfigError, match="train.compile=true with train.ep_size > 1"):
        cfg("train.compile=true", "train.ep_size=2", "pools.trainer=2")
    auto_ep = cfg("train.ep_size=2", "pools.trainer=2")
    object.__setattr__(auto_ep.train, "device", "cuda")  # auto on CUDA, but EP
    assert not use_compile(auto_ep)
    object.__setattr__(auto_ep.train, "ep_size", 1)
    assert use_compile(auto_ep)

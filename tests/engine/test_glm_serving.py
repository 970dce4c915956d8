"""`moe-rl serve` with a GLM-4.5-style model: the engine generates from the native GLM model
(sigmoid router with correction bias and groups, shared experts, a dense first layer, partial
rotary, q/k/v bias), returns its routed experts in SGLang's layout (the dense layer's rows 0) and
says which family it serves."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from moe_rl.config import load_config
from moe_rl.engine import EngineClient, decode_routed_experts
from moe_rl.engine.server import build_model

from .helpers import CONFIG, OVERRIDES, K, L, ServerProc, check_against_native, run

GLM = ["model.model_type=glm4_moe", "model.mlp_only_layers=[]", "model.first_k_dense_replace=1",
       "model.n_shared_experts=1", "model.n_group=2", "model.topk_group=1", "model.routed_scaling_factor=2.0",
       "model.attention_bias=true", "model.init_std=0.1"]


@pytest.fixture(scope="module")
def server():
    s = ServerProc(GLM)
    yield s
    s.stop()


def test_glm_generate_matches_native_and_returns_routed_experts(server):
    cfg = load_config(CONFIG, OVERRIDES + GLM)
    model = build_model(cfg)
    assert model.arch.model_type == "glm4_moe" and model.moe_layers == [1, 2] and (L, K) == (3, 2)
    prompts = [[(5 * i + j) % 64 for j in range(3 + i)] for i in range(6)]

    async def main():
        async with EngineClient(server.url) as c:
            info = await c.get_model_info()
            outs = await asyncio.gather(*(
                c.generate(p, {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": i},
                           return_logprob=True, return_routed_experts=True) for i, p in enumerate(prompts)))
            return info, outs

    info, outs = run(main())
    assert info["model_type"] == "glm4_moe" and info["architectures"] == ["Glm4MoeForCausalLM"]
    used = set()
    for p, out in zip(prompts, outs):
        check_against_native(model, p, out, 1.0)  # log-probs and routed experts of every MoE layer
        rows = decode_routed_experts(out, L, K)
        assert not rows[:, 0].any()  # the dense first layer, as SGLang writes it
        used.update(np.unique(rows[:, 1:]).tolist())
    assert len(used) > 2  # the routing is not degenerate

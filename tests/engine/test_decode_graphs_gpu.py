"""Decode CUDA graphs of the families whose attention or routing differ from the default's, on a
GPU (bf16, sm_90+): GLM-4.5 (sigmoid router with bias and groups, shared experts, partial rotary),
DeepSeek-V3 (multi-head latent attention, absorbed decode over the latent cache) and Qwen3.5
(Gated DeltaNet layers beside gated full attention). Each captures its decode step; the replayed
graphs give the eager static step's outputs, and both follow the fp32 CPU model's full forwards
within bf16 rounding (the experts replayed). gpt-oss and Qwen3-Next have theirs beside their
engine tests."""
from __future__ import annotations

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.model import MoEForCausalLM

from .helpers import CONFIG, OVERRIDES, check_bf16_against_fp32_replayed, decode_graphs_on_a_gpu
from .test_glm_serving import GLM
from .test_mla_engine import ARCH as DEEPSEEK_V3
from .test_qwen35_tools import QWEN35

pytestmark = pytest.mark.gpu


def _arch(family: str):
    if family == "deepseek_v3":
        return DEEPSEEK_V3
    return load_config(CONFIG, {"glm4_moe": OVERRIDES + GLM, "qwen3_5_moe_text": QWEN35}[family]).model.arch()


def _bodies(vocab: int, n: int = 6) -> list[dict]:
    """Prompts of 2 to 37 tokens, outputs of 12 to 27: the batch shrinks step by step, and one
    request decodes greedily."""
    return [{"input_ids": [(5 * i + 3 * j + 1) % vocab for j in range(2 + 7 * i)], "return_logprob": True,
             "return_routed_experts": True,
             "sampling_params": {"temperature": [1.0, 0.0, 0.7][i % 3], "max_new_tokens": 12 + 3 * i,
                                 "sampling_seed": i}} for i in range(n)]


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "qwen3_5_moe_text"])
def test_decode_graphs_on_a_gpu(family):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the capturable (CUTLASS) grouped GEMM needs sm_90+")
    arch = _arch(family)
    assert arch.model_type == family
    model = MoEForCausalLM(arch).init_weights(5, std=0.1).eval()
    bodies = _bodies(arch.vocab_size)
    outs = decode_graphs_on_a_gpu(model, bodies, max_running_requests=4, max_context=128)
    check_bf16_against_fp32_replayed(model, bodies, outs)

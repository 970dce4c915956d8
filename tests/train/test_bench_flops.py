"""The bench's model-FLOPs count against the parameters of the model it times."""
import pytest
import torch

from moe_rl.model import MoEArch, MoEForCausalLM
from moe_rl.train.megatron.bench import PRESETS, model_flops, peak_tflops


@pytest.mark.parametrize("name", ["small", "medium"])
def test_active_params_match_the_model(name):
    preset = PRESETS[name]
    a = preset["arch"]
    with torch.device("meta"):  # shapes only
        model = MoEForCausalLM(MoEArch(**a))
    total = sum(p.numel() for n, p in model.named_parameters()
                if "embed_tokens" not in n and "norm" not in n)  # a lookup and elementwise scales
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * a["num_experts_per_tok"] // a["num_experts"]
    f = model_flops(preset)
    assert f["active_params"] == active
    seqs = preset["micro"] * preset["seqs_per_micro"]
    assert f["tokens"] == seqs * preset["seq"]
    heads = a["num_attention_heads"] * a["head_dim"]
    assert f["flops"] == 6 * active * f["tokens"] + 3 * 2 * 2 * (preset["seq"] ** 2 // 2) * heads * seqs * a["num_hidden_layers"]


def test_large_preset_is_qwen3_30b_a3b_shaped():
    a = PRESETS["large"]["arch"]
    assert (a["hidden_size"], a["moe_intermediate_size"], a["num_experts_per_tok"], a["num_attention_heads"],
            a["num_key_value_heads"], a["head_dim"], a["vocab_size"]) == (2048, 768, 8, 32, 4, 128, 151936)
    assert model_flops(PRESETS["large"])["tokens"] >= 16384


def test_peaks():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.4 and peak_tflops("some cpu") is None

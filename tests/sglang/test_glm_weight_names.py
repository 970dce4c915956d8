"""The weight sync's names for GLM-4.5 go through SGLang's own ``Glm4MoeForCausalLM.load_weights``
(and ``FusedMoE.make_expert_params_mapping``), compiled from the installed source (the module
does not import on CPU, see ``conftest.sglang_methods``). SGLang's loader skips a name it has no
parameter for without a word, so the test records every weight_loader call: each tensor moe-rl
sends must land on a parameter of SGLang's model, and every shard of every SGLang parameter must
be written, with SGLang's fused shared expert (``--num-fused-shared-experts``) and without."""
from __future__ import annotations

import logging
import re
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from moe_rl.model import MoEArch, hf_param_specs

from .conftest import require_sglang, sglang_methods

require_sglang("sglang.srt.utils.common")

ARCH = MoEArch(model_type="glm4_moe", vocab_size=64, hidden_size=32, num_hidden_layers=3, head_dim=8,
               num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
               n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, attention_bias=True,
               use_qk_norm=True, moe_intermediate_size=16)


def sglang_param_names(arch: MoEArch, fused_shared: int) -> list[str]:
    """The parameters of SGLang 0.5.23's Glm4MoeForCausalLM (srt/models/glm4_moe.py): attention's
    fused ``qkv_proj`` (with bias when attention_bias) and per-head q/k norms, dense layers'
    ``mlp.gate_up_proj``, MoE layers' ``mlp.gate`` (weight, e_score_correction_bias), the FusedMoE
    ``mlp.experts.w13_weight`` / ``w2_weight`` and, unless fused into the experts, the
    ``mlp.shared_experts`` MLP."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight"]
        names += [p + "self_attn.qkv_proj.bias"] if arch.attention_bias else []
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"] if arch.use_qk_norm else []
        if arch.is_moe_layer(i):
            names += [p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias",
                      p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight"]
            if not fused_shared:
                names += [p + "mlp.shared_experts.gate_up_proj.weight", p + "mlp.shared_experts.down_proj.weight"]
        else:
            names += [p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
    return names


def run_sglang_loader(arch: MoEArch, fused_shared: int):
    fused = sglang_methods("srt/layers/moe/fused_moe_triton/layer.py", "FusedMoE", ("make_expert_params_mapping",))
    FusedMoE = type("FusedMoE", (), {"make_expert_params_mapping": classmethod(fused["make_expert_params_mapping"])})
    calls: dict[str, list] = defaultdict(list)

    def default_weight_loader(param, w):
        calls[param.name].append(("all", None))

    load = sglang_methods("srt/models/glm4_moe.py", "Glm4MoeForCausalLM", ("load_weights",), re=re,
                          torch=torch, FusedMoE=FusedMoE, default_weight_loader=default_weight_loader,
                          logger=logging.getLogger("sglang-ref"))["load_weights"]

    def param(name):
        def weight_loader(p, w, *args, shard_id=None, expert_id=None):
            if expert_id is not None:  # FusedMoE: (param, weight, name, shard_id=, expert_id=)
                calls[name].append((shard_id, expert_id))
            else:  # stacked linear: (param, weight, shard_id)
                calls[name].append((args[0] if args else "all", None))
        return SimpleNamespace(name=name, weight_loader=weight_loader)

    cfg = dict(arch.to_hf_dict(), num_nextn_predict_layers=0)
    model = SimpleNamespace(config=SimpleNamespace(**cfg), num_fused_shared_experts=fused_shared)
    params = {n: param(n) for n in sglang_param_names(arch, fused_shared)}
    # moe-rl's wire names, one tensor each (shapes do not matter to the name mapping)
    sent = [n for n, _ in hf_param_specs(arch)]
    load(model, ((n, torch.empty(0)) for n in sent), params_dict=params)
    return sent, params, calls


@pytest.mark.parametrize("fused_shared", [0, 1], ids=["shared-mlp", "shared-fused-into-experts"])
def test_every_glm_tensor_lands_on_an_sglang_parameter(fused_shared):
    sent, params, calls = run_sglang_loader(ARCH, fused_shared)
    E = ARCH.num_experts
    assert set(calls) == set(params), f"SGLang parameters never written: {sorted(set(params) - set(calls))}"
    writes = sum(len(v) for v in calls.values())
    assert writes == len(sent), "a sent tensor was skipped by SGLang's loader (no parameter of that name)"
    for name, got in calls.items():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            assert sorted(got) == [("k", None), ("q", None), ("v", None)], name
        elif name.endswith("gate_up_proj.weight"):
            assert sorted(got) == [(0, None), (1, None)], name
        elif name.endswith("experts.w13_weight"):
            want = {(s, e) for e in range(E + fused_shared) for s in ("w1", "w3")}
            assert sorted(got) == sorted(want), name
        elif name.endswith("experts.w2_weight"):
            assert sorted(got) == sorted(("w2", e) for e in range(E + fused_shared)), name
        else:
            assert got == [("all", None)], name
    bias = [n for n in calls if n.endswith("e_score_correction_bias")]
    assert len(bias) == len(ARCH.moe_layers)  # the correction bias reaches SGLang's gate

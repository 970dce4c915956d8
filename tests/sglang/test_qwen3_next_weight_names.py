"""The weight sync's names for Qwen3-Next and Qwen3.5-MoE go through SGLang's own loaders,
compiled from the installed source (the modules do not import on CPU, see
``conftest.sglang_methods``): ``Qwen3NextForCausalLM.load_weights`` (srt/models/qwen3_next.py)
and the Qwen3.5 MoE body's ``load_weights`` (srt/models/qwen3_5.py) behind the text model's
prefix strip (srt/models/qwen3_5_text.py). SGLang's loaders skip or only warn on a name with no
parameter, so every weight_loader call is recorded: each tensor moe-rl sends must land on a
parameter of SGLang's model, and every shard of every SGLang parameter must be written (Gated
DeltaNet's fused in_proj_qkvz / in_proj_ba, the gated q_proj inside qkv_proj, the shared
expert and its gate), with SGLang's shared-expert fusion and without."""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from moe_rl.model import MoEArch, hf_param_specs

from .conftest import require_sglang, sglang_methods

common = require_sglang("sglang.srt.layers.utils.common")

ARCHS = {family: MoEArch(model_type=family, vocab_size=64, hidden_size=32, num_hidden_layers=4, head_dim=8,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=16, shared_expert_intermediate_size=16)
         for family in ("qwen3_next", "qwen3_5_moe_text")}


def sglang_param_names(arch: MoEArch, fused_shared: int, prefix: str) -> list[str]:
    """SGLang 0.5.23's parameters of the hybrid models: linear layers' ``linear_attn.{conv1d,
    in_proj_qkvz, in_proj_ba, dt_bias, A_log, norm, out_proj}``, full-attention layers'
    ``qkv_proj`` (q heads twice: query and gate), ``o_proj``, q/k norms (no ``self_attn``
    level), every layer's ``Qwen2MoeSparseMoeBlock`` (``gate``, FusedMoE ``w13``/``w2``, the
    ``shared_expert`` MLP unless fused into the experts, ``shared_expert_gate``)."""
    names = [prefix + "embed_tokens.weight", prefix + "norm.weight"]
    for i, kind in enumerate(arch.layer_types):
        p = f"{prefix}layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if kind == "linear_attention":
            names += [p + f"linear_attn.{n}" for n in ("conv1d.weight", "in_proj_qkvz.weight", "in_proj_ba.weight",
                                                        "dt_bias", "A_log", "norm.weight", "out_proj.weight")]
        else:
            names += [p + n for n in ("qkv_proj.weight", "o_proj.weight", "q_norm.weight", "k_norm.weight")]
        names += [p + "mlp.gate.weight", p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight",
                  p + "mlp.shared_expert_gate.weight"]
        if not fused_shared:
            names += [p + "mlp.shared_expert.gate_up_proj.weight", p + "mlp.shared_expert.down_proj.weight"]
    return names


class Recorder:
    def __init__(self):
        self.calls: dict[str, list] = defaultdict(list)

    def param(self, name):
        def weight_loader(p, w, *args, shard_id=None, expert_id=None):
            if expert_id is not None:  # FusedMoE: (param, weight, name, shard_id=, expert_id=)
                self.calls[name].append((shard_id, expert_id))
            elif len(args) >= 3:  # FusedMoE called positionally: (param, weight, name, shard_id, expert_id)
                self.calls[name].append((args[1], args[2]))
            else:  # stacked linear: (param, weight, shard_id)
                self.calls[name].append((args[0] if args else "all", None))
        return SimpleNamespace(name=name, weight_loader=weight_loader)

    def default_weight_loader(self, param, w):
        self.calls[param.name].append(("all", None))


def _fused_moe():
    fused = sglang_methods("srt/layers/moe/fused_moe_triton/layer.py", "FusedMoE", ("make_expert_params_mapping",))
    return type("FusedMoE", (), {"make_expert_params_mapping": classmethod(fused["make_expert_params_mapping"])})


def run_qwen3_next(arch, fused_shared):
    rec = Recorder()
    load = sglang_methods("srt/models/qwen3_next.py", "Qwen3NextForCausalLM", ("load_weights",), torch=torch,
                          FusedMoE=_fused_moe(), default_weight_loader=rec.default_weight_loader,
                          logger=logging.getLogger("sglang-ref"))["load_weights"]
    names = sglang_param_names(arch, fused_shared, "model.") + ["lm_head.weight"]
    params = {n: rec.param(n) for n in names}
    model = SimpleNamespace(config=SimpleNamespace(**arch.to_hf_dict()), enable_shared_expert_fusion=bool(fused_shared),
                            num_fused_shared_experts=fused_shared, named_parameters=lambda: params.items())
    sent = [n for n, _ in hf_param_specs(arch)]
    load(model, ((n, torch.empty(0)) for n in sent))
    return sent, params, rec.calls


def run_qwen3_5(arch, fused_shared):
    """The text model (qwen3_5_text.Qwen3_5MoeForCausalLM) strips ``model.`` and loads the
    head itself; its body loads the rest."""
    rec = Recorder()
    mapper = sglang_methods("srt/models/utils.py", None, ("WeightsMapper",), torch=torch, dataclass=dataclass,
                            field=field, WeightsMapping=dict)["WeightsMapper"]
    kv_mapper = mapper(orig_to_new_substr={".self_attn.k_proj.k_scale": ".attn.k_scale",
                                           ".self_attn.v_proj.v_scale": ".attn.v_scale"})
    load = sglang_methods("srt/models/qwen3_5.py", "Qwen3_5MoeForCausalLM", ("load_weights",), torch=torch,
                          FusedMoE=_fused_moe(), default_weight_loader=rec.default_weight_loader,
                          get_layer_id=common.get_layer_id, QWEN3_5_KV_SCALE_MAPPER=kv_mapper,
                          logger=logging.getLogger("sglang-ref"))["load_weights"]
    params = {n: rec.param(n) for n in sglang_param_names(arch, fused_shared, "")}
    body = SimpleNamespace(config=SimpleNamespace(**arch.to_hf_dict()), enable_shared_expert_fusion=bool(fused_shared),
                           num_fused_shared_experts=fused_shared,
                           named_parameters=lambda remove_duplicate=True: params.items())
    sent = [n for n, _ in hf_param_specs(arch)]
    assert all(n.startswith("model.") or n == "lm_head.weight" for n in sent)
    load(body, ((n[len("model."):], torch.empty(0)) for n in sent if n.startswith("model.")))
    rec.calls["lm_head.weight"].append(("all", None))  # the text model's own lm_head load
    params["lm_head.weight"] = None
    return sent, params, rec.calls


RUNS = {"qwen3_next": run_qwen3_next, "qwen3_5_moe_text": run_qwen3_5}


@pytest.mark.parametrize("fused_shared", [0, 1], ids=["shared-mlp", "shared-fused-into-experts"])
@pytest.mark.parametrize("family", list(ARCHS))
def test_every_tensor_lands_on_an_sglang_parameter(family, fused_shared):
    arch = ARCHS[family]
    sent, params, calls = RUNS[family](arch, fused_shared)
    E = arch.num_experts
    assert set(calls) == set(params), f"SGLang parameters never written: {sorted(set(params) - set(calls))}"
    assert sum(len(v) for v in calls.values()) == len(sent), "a sent tensor was not loaded by SGLang"
    for name, got in calls.items():
        if name.endswith("qkv_proj.weight"):
            assert sorted(got) == [("k", None), ("q", None), ("v", None)], name
        elif name.endswith("in_proj_qkvz.weight"):  # Qwen3.5's split projections stack into it
            want = [("all", None)] if family == "qwen3_next" else [(3, None), ((0, 1, 2), None)]
            assert sorted(got, key=str) == sorted(want, key=str), name
        elif name.endswith("in_proj_ba.weight"):
            assert sorted(got) == ([("all", None)] if family == "qwen3_next" else [(0, None), (1, None)]), name
        elif name.endswith("gate_up_proj.weight"):
            assert sorted(got) == [(0, None), (1, None)], name
        elif name.endswith("experts.w13_weight"):
            assert sorted(got) == sorted((s, e) for e in range(E + fused_shared) for s in ("w1", "w3")), name
        elif name.endswith("experts.w2_weight"):
            assert sorted(got) == sorted(("w2", e) for e in range(E + fused_shared)), name
        else:
            assert got == [("all", None)], name

"""The weight sync's names for gpt-oss go through SGLang's own ``GptOssForCausalLM`` loader for
bf16 checkpoints (``_load_normal_weights``, with its ``_get_default_weight_mapping``,
``_canonicalize_weights`` and ``FusedMoE.make_expert_params_mapping_fused``), compiled from the
installed source (the module does not import on CPU). SGLang skips a name it has no parameter
for without a word, so every weight_loader call is recorded: each tensor moe-rl sends must land
on a parameter of SGLang's model, every SGLang parameter must be written, the stacked experts
arrive whole ([E, H, 2I] transposed to SGLang's [E, 2I, H]; biases as they are) and the sinks
(loaded by a copy, not a weight_loader) keep their values."""
from __future__ import annotations

import logging
from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import torch

from moe_rl.model import MoEArch, MoEForCausalLM, iter_local_hf_tensors

from .conftest import require_sglang, sglang_methods

require_sglang("sglang.srt.utils.common")

ARCH = MoEArch(model_type="gpt_oss", vocab_size=64, hidden_size=32, num_hidden_layers=2, head_dim=8,
               num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=16, sliding_window=3, attention_bias=True)


def sglang_param_names(arch: MoEArch) -> list[str]:
    """The parameters of SGLang 0.5.23's GptOssForCausalLM (srt/models/gpt_oss.py) with bf16
    experts: the fused ``qkv_proj`` and ``o_proj`` (with bias), ``sinks``, the ``mlp.router``
    (weight, bias) and the FusedMoE ``w13_weight`` / ``w2_weight`` with their biases."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias", "self_attn.o_proj.weight",
                                  "self_attn.o_proj.bias", "self_attn.sinks", "mlp.router.weight", "mlp.router.bias",
                                  "mlp.experts.w13_weight", "mlp.experts.w13_weight_bias", "mlp.experts.w2_weight",
                                  "mlp.experts.w2_weight_bias")]
    return names


def test_every_gpt_oss_tensor_lands_on_an_sglang_parameter():
    from sglang.srt.layers.utils import get_layer_id

    path = "srt/models/gpt_oss.py"
    module = sglang_methods(path, None, ("_canonicalize_weights", "_WeightCreator"), partial=partial,
                            Iterable=object, Tuple=tuple)
    fused = sglang_methods("srt/layers/moe/fused_moe_triton/layer.py", "FusedMoE",
                           ("make_expert_params_mapping_fused",))
    FusedMoE = type("FusedMoE", (), {"make_expert_params_mapping_fused": classmethod(fused["make_expert_params_mapping_fused"])})
    calls: dict[str, list] = defaultdict(list)
    sinks: dict[str, torch.Tensor] = {}

    def default_weight_loader(param, w):
        calls[param.name].append(("all", tuple(w.shape)))

    methods = sglang_methods(path, "GptOssForCausalLM", ("_load_normal_weights", "_get_default_weight_mapping"),
                             FusedMoE=FusedMoE, default_weight_loader=default_weight_loader,
                             get_layer_id=get_layer_id, unwrap_lora_layer=lambda m: m,
                             get_group_rank_size=lambda group: (0, 1), _is_cpu=True,
                             logging=logging, logger=logging.getLogger("sglang-ref"), **module)

    def param(name):
        if name.endswith("sinks"):  # SGLang copies the sinks into the parameter's data
            t = torch.empty(ARCH.num_attention_heads)

            class Data:
                def copy_(self, w):
                    sinks[name] = w.clone()
                    calls[name].append(("copy", tuple(w.shape)))
            return SimpleNamespace(name=name, numel=t.numel, data=Data())

        def weight_loader(p, w, *args, shard_id=None, expert_id=None):
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):  # stacked linear: (param, w, shard_id)
                calls[name].append((args[0], tuple(w.shape)))
            elif args:  # FusedMoE, fused: (param, w, name, shard_id=)
                calls[name].append((shard_id, tuple(w.shape)))
            else:  # a plain parameter: (param, w)
                calls[name].append(("all", tuple(w.shape)))
        return SimpleNamespace(name=name, weight_loader=weight_loader)

    params = {n: param(n) for n in sglang_param_names(ARCH)}
    cfg = SimpleNamespace(**ARCH.to_hf_dict())
    model = SimpleNamespace(config=cfg, named_parameters=lambda: params.items(), model=SimpleNamespace(),
                            get_submodule=lambda n: SimpleNamespace(moe_tp_rank=0, qkv_proj=SimpleNamespace(tp_group=None)))
    model._get_default_weight_mapping = lambda: methods["_get_default_weight_mapping"](model)
    ours = MoEForCausalLM(ARCH).init_weights(0)
    sent = dict(iter_local_hf_tensors(ours))  # moe-rl's wire names and tensors (EP=1: whole)
    methods["_load_normal_weights"](model, list(sent.items()), is_nextn=False, weight_name_mapping=None)

    assert set(calls) == set(params), f"SGLang parameters never written: {sorted(set(params) - set(calls))}"
    assert sum(len(v) for v in calls.values()) == len(sent), "a sent tensor was skipped by SGLang's loader"
    E, H, I = ARCH.num_experts, ARCH.hidden_size, ARCH.moe_intermediate_size
    for name, got in calls.items():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            assert sorted(s for s, _ in got) == ["k", "q", "v"], name
        elif name.endswith("experts.w13_weight"):
            assert got == [("w13", (E, 2 * I, H))], name  # the HF [E, H, 2I] stack, transposed by SGLang
        elif name.endswith("experts.w13_weight_bias"):
            assert got == [("w13", (E, 2 * I))], name
        elif name.endswith("experts.w2_weight"):
            assert got == [("w2", (E, H, I))], name
        elif name.endswith("experts.w2_weight_bias"):
            assert got == [("w2", (E, H))], name
        elif name.endswith("sinks"):
            assert got == [("copy", (ARCH.num_attention_heads,))]
            assert torch.equal(sinks[name], sent[name])
        else:
            assert [s for s, _ in got] == ["all"], name

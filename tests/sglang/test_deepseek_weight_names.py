"""The weight sync's tensors for the DeepSeek-V3 family (multi-head latent attention) go through
SGLang's own ``DeepseekV2WeightLoaderMixin.do_load_weights`` (srt/models/deepseek_common/
deepseek_weight_loader.py; DeepseekV3ForCausalLM's) and GLM-4.7-Flash's through its own
``Glm4MoeLiteForCausalLM.load_weights``, compiled from the installed source as
tests/sglang/test_glm_weight_names.py does for GLM. SGLang fuses q_a_proj with kv_a_proj_with_mqa into ``fused_qkv_a_proj_with_mqa`` and writes it only when both
arrive in one load_weights call, so the test loads bucket by bucket, as a weight update does:
every tensor must land, the fused parameter must be the concatenation, and post_load_weights
(which splits kv_b_proj into w_kc / w_vc) must see every layer's kv_b_proj."""
from __future__ import annotations

import concurrent.futures
import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from moe_rl.model import MoEArch, MoEForCausalLM, hf_param_specs, iter_local_hf_tensors
from moe_rl.sync.plan import plan_buckets

from .conftest import require_sglang, sglang_methods

require_sglang("sglang.srt.utils.common")
from sglang.srt.layers.utils.common import get_layer_id  # noqa: E402

LOADER = "srt/models/deepseek_common/deepseek_weight_loader.py"
ARCH = MoEArch(model_type="deepseek_v3", vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
               num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
               first_k_dense_replace=1, moe_intermediate_size=16, intermediate_size=24, q_lora_rank=12,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def sglang_param_names(arch: MoEArch, fused_shared: int) -> list[str]:
    """The parameters of SGLang 0.5.23's DeepseekV2ForCausalLM (srt/models/deepseek_v2.py): with
    q_lora_rank the fused ``fused_qkv_a_proj_with_mqa``, ``q_a_layernorm``, ``q_b_proj``, else
    ``q_proj`` and ``kv_a_proj_with_mqa``; ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; dense
    layers' ``mlp.gate_up_proj``; MoE layers' gate (weight, e_score_correction_bias), FusedMoE
    ``w13_weight`` / ``w2_weight`` and, unless fused into the experts, the shared-expert MLP."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(arch.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if arch.q_lora_rank is None:
            names += [a + "q_proj.weight", a + "kv_a_proj_with_mqa.weight"]
        else:
            names += [a + "fused_qkv_a_proj_with_mqa.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"]
        names += [a + "kv_a_layernorm.weight", a + "kv_b_proj.weight", a + "o_proj.weight"]
        if arch.is_moe_layer(i):
            names += [p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias",
                      p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight"]
            if not fused_shared:
                names += [p + "mlp.shared_experts.gate_up_proj.weight", p + "mlp.shared_experts.down_proj.weight"]
        else:
            names += [p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
    return names


def fused_moe():
    fused = sglang_methods("srt/layers/moe/fused_moe_triton/layer.py", "FusedMoE", ("make_expert_params_mapping",))
    return type("FusedMoE", (), {"make_expert_params_mapping": classmethod(fused["make_expert_params_mapping"])})


def glm47_flash_loader():
    """SGLang's Glm4MoeLiteForCausalLM.load_weights (GLM-4.7-Flash: its own copy of the pairing)."""
    return sglang_methods("srt/models/glm4_moe_lite.py", "Glm4MoeLiteForCausalLM", ("load_weights",), re=re,
                          torch=torch, FusedMoE=fused_moe(), default_weight_loader=None,
                          logger=logging.getLogger("sglang-ref"))["load_weights"]


def sglang_loader():
    FusedMoE = fused_moe()
    utils = sglang_methods("srt/model_loader/utils.py", None, ("should_async_load", "maybe_executor_submit"),
                           torch=torch, concurrent=concurrent, RUNAI_STREAMER_TENSOR_ATTR="_sglang_runai_streamer_tensor")
    helpers = sglang_methods(LOADER, None, ("_clone_if_runai_streamed_tensor", "_resolve_quark_fp8_block_scale_name",
                                            "_load_fused_expert_tensor", "NextNEnabledConfig", "NextNDisabledConfig"),
                             torch=torch, dataclass=dataclass, RUNAI_STREAMER_TENSOR_ATTR="_sglang_runai_streamer_tensor")
    ns = dict(helpers, **utils, torch=torch, concurrent=concurrent, FusedMoE=FusedMoE, get_layer_id=get_layer_id,
              is_wint4afp8_or_wint4a16_config=lambda q: False, log_info_on_rank0=lambda log, msg: None, _is_npu=False,
              logger=logging.getLogger("sglang-ref"), re=re, NVFP4_CKPT_FP8_ATTN_QUANT_MODULES=["q_b_proj"],
              default_weight_loader=None)
    return sglang_methods(LOADER, "DeepseekV2WeightLoaderMixin", ("do_load_weights", "_initialize_nextn_conf"), **ns)


class SGLangModel:
    """What ``do_load_weights`` reads of ``self``: every weight_loader call is recorded, with the
    tensor; ``post_load_weights`` records the names it is given (SGLang re-derives w_kc / w_vc of
    the layers whose kv_b_proj is among them)."""

    def __init__(self, arch: MoEArch, fused_shared: int, load=None):
        self.config = SimpleNamespace(**dict(arch.to_hf_dict(), num_nextn_predict_layers=0))
        self.num_fused_shared_experts, self.quant_config = fused_shared, None
        self.pp_group, self.model = SimpleNamespace(is_last_rank=True), SimpleNamespace()
        self.calls: dict[str, list] = defaultdict(list)
        self.post_load: list[list[str]] = []
        self.params = {n: self._param(n) for n in sglang_param_names(arch, fused_shared)}
        if load is not None:  # a family's own load_weights
            self.load_weights = lambda weights: load(self, weights)
            return
        fns = sglang_loader()
        self.load_weights = lambda weights: fns["do_load_weights"](self, weights)
        self._initialize_nextn_conf = lambda is_nextn: fns["_initialize_nextn_conf"](self, is_nextn)

    def _param(self, name):
        def weight_loader(p, w, *args, shard_id=None, expert_id=None):
            if expert_id is not None:  # FusedMoE: (param, weight, name, shard_id=, expert_id=)
                self.calls[name].append((shard_id, expert_id, w))
            else:  # stacked linear: (param, weight, shard_id)
                self.calls[name].append((args[0] if args else "all", None, w))
        return SimpleNamespace(name=name, weight_loader=weight_loader)

    def named_parameters(self):
        return self.params.items()

    def _maybe_quant_weights_to_fp8_ue8m0(self, weights, modules, nextn_conf):
        return weights

    def post_load_weights(self, is_nextn=False, weight_names=None):
        # None: every layer (GLM-4.7-Flash's loader re-derives all of them after each call)
        self.post_load.append(list(weight_names) if weight_names is not None else
                              [f"model.layers.{i}.self_attn.kv_b_proj.weight"
                               for i in range(self.config.num_hidden_layers)])


@pytest.mark.parametrize("q_lora,fused_shared,family", [(True, 0, "deepseek_v3"), (True, 1, "deepseek_v3"),
                                                        (False, 0, "deepseek_v3"), (True, 1, "glm4_moe_lite")],
                         ids=["q_lora", "q_lora-shared-fused", "plain-q_proj", "glm-4.7-flash"])
def test_every_tensor_lands_bucket_by_bucket(q_lora, fused_shared, family):
    arch = ARCH.model_copy(update={"q_lora_rank": ARCH.q_lora_rank if q_lora else None, "model_type": family})
    model = MoEForCausalLM(arch).init_weights(0)
    tensors = dict(iter_local_hf_tensors(model))
    specs = [(n, s, torch.float32) for n, s in hf_param_specs(arch)]
    # small buckets: most split the model, but never a layer's q_a_proj / kv_a_proj_with_mqa pair
    plan = plan_buckets(specs, bucket_bytes=2048)
    assert len(plan.buckets) > 10
    sg = SGLangModel(arch, fused_shared, glm47_flash_loader() if family == "glm4_moe_lite" else None)
    for b in plan.buckets:
        sg.load_weights((n, tensors[n]) for n in b.names)
    assert set(sg.calls) == set(sg.params), f"never written: {sorted(set(sg.params) - set(sg.calls))}"
    E = arch.num_experts
    for name, got in sg.calls.items():
        keys = sorted((s, e) for s, e, _ in got)
        if name.endswith("experts.w13_weight"):
            assert keys == sorted((s, e) for e in range(E + fused_shared) for s in ("w1", "w3")), name
        elif name.endswith("experts.w2_weight"):
            assert keys == sorted(("w2", e) for e in range(E + fused_shared)), name
        elif name.endswith("gate_up_proj.weight"):
            assert keys == [(0, None), (1, None)], name
        else:
            assert keys == [("all", None)], name
    for i in range(arch.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        if q_lora:  # SGLang's fused parameter gets [q_a_proj ; kv_a_proj_with_mqa]
            fused = sg.calls[a + "fused_qkv_a_proj_with_mqa.weight"][0][2]
            want = torch.cat([tensors[a + "q_a_proj.weight"], tensors[a + "kv_a_proj_with_mqa.weight"]])
            assert torch.equal(fused, want)
    # post_load_weights saw every layer's kv_b_proj (w_kc / w_vc re-derived after each update)
    seen = {n for names in sg.post_load for n in names}
    assert all(f"model.layers.{i}.self_attn.kv_b_proj.weight" in seen for i in range(arch.num_hidden_layers))
    bias = [n for n in sg.calls if n.endswith("e_score_correction_bias")]
    assert len(bias) == len(arch.moe_layers)


def test_a_split_pair_is_what_the_plan_prevents():
    """Without the pairing the fused parameter is never written: SGLang drops a lone q_a_proj."""
    model = MoEForCausalLM(ARCH).init_weights(0)
    tensors = dict(iter_local_hf_tensors(model))
    sg = SGLangModel(ARCH, 0)
    a = "model.layers.0.self_attn."
    sg.load_weights([(a + "q_a_proj.weight", tensors[a + "q_a_proj.weight"])])
    sg.load_weights([(a + "kv_a_proj_with_mqa.weight", tensors[a + "kv_a_proj_with_mqa.weight"])])
    assert a + "fused_qkv_a_proj_with_mqa.weight" not in sg.calls
    # a pair larger than a bucket gets a bucket of its own
    specs = [(n, s, torch.float32) for n, s in hf_param_specs(ARCH)]
    plan = plan_buckets(specs, bucket_bytes=64)
    for i in range(ARCH.num_hidden_layers):
        q, kv = plan.by_name[f"model.layers.{i}.self_attn.q_a_proj.weight"], \
            plan.by_name[f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"]
        assert q[0] == kv[0]

"""megatron-core's multi-latent attention (MLATransformerConfig) with a DeepSeek-V3-style model on
CPU, against the native model (fp32): the mapping of every MLA tensor, YaRN with mscale, the
latent norms' eps, NeoX-layout RoPE rows (rope_interleave=false), GLM-4.5's router and shared
experts; log-probs, routing and every gradient (the CPU shims of test_forward_cpu.py)."""
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
pytest.importorskip("megatron.core")

from .common import (  # noqa: E402
    assert_logprobs_and_grads_equal_native, assert_lora_logprobs_and_adapter_grads_equal_native, build, make_mb,
    native_record, random_correction_bias, random_routes)
from .test_forward_cpu import cpu_megatron  # noqa: E402,F401  (the module-scoped 1-rank world with shims)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 1.0}
DSV3 = dict(model_type="deepseek_v3", vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
            num_hidden_layers=3, num_attention_heads=4, num_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
            n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, q_lora_rank=20, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, rope_theta=10_000.0, rms_norm_eps=1e-5,
            max_position_embeddings=256, rope_scaling=YARN)
CASES = {"q_lora_yarn": {}, "neox_rope": dict(rope_interleave=False, rope_scaling=None), "q_proj": dict(q_lora_rank=None)}
# megatron-core 0.19 builds an MLA q_proj without q_lora_rank as a fused norm+linear: refused there
MCORE_019 = importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is not None
LENGTHS = (11, 20, 9)


def build_dsv3(**over):
    arch = {**DSV3, **over}
    meg, native = build(arch, "cpu")
    random_correction_bias(meg, native, arch["num_experts"])
    return meg, native


def test_mla_transformer_config_and_names(cpu_megatron):
    from moe_rl.train.megatron.convert import megatron_param_specs

    meg, _ = build_dsv3()
    tc = meg.tconfig
    assert type(tc).__name__ == "MLATransformerConfig" and tc.multi_latent_attention
    assert (tc.q_lora_rank, tc.kv_lora_rank, tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim) == (20, 16, 8, 6, 10)
    assert (tc.rope_type, tc.rotary_scaling_factor, tc.original_max_position_embeddings, tc.mscale,
            tc.mscale_all_dim) == ("yarn", 4.0, 16, 0.707, 1.0)
    built = {n: tuple(p.shape) for n, p in meg.model.named_parameters()}
    built.update((n, tuple(b.shape)) for n, b in meg.model.named_buffers() if n.endswith("router.expert_bias"))
    assert built == dict(megatron_param_specs(meg.arch, meg.layout))
    att = meg.model.decoder.layers[0].self_attention
    assert att.q_layernorm.eps == att.kv_layernorm.eps == 1e-6  # HF's latent norms, not rms_norm_eps (1e-5)
    plain, _ = build_dsv3(**CASES["neox_rope"])
    assert (plain.tconfig.rope_type, plain.tconfig.rotary_scaling_factor, plain.tconfig.mscale_all_dim) == ("rope", 1.0, 0.0)


@pytest.mark.parametrize("case", list(CASES))
def test_mla_logprobs_routing_and_gradients_equal_native(cpu_megatron, case):
    """megatron's own routing picks the native model's experts; under replayed routes the log-probs
    and every gradient (MLA projections and norms, router, shared experts, experts), mapped back to
    HF names, equal the native model's."""
    if case == "q_proj" and MCORE_019:
        with pytest.raises(ValueError, match="without q_lora_rank"):
            build_dsv3(**CASES[case])
        return
    meg, native = build_dsv3(**CASES[case])
    mb = make_mb(DSV3["vocab_size"], LENGTHS)
    rec_meg = []
    with torch.no_grad():
        meg.hidden_states(mb, record=rec_meg)
    for a, b in zip(rec_meg, native_record(native, mb)):
        assert torch.equal(a.sort(1).values, b.sort(1).values)
    mb.replay = random_routes(mb.num_tokens, DSV3["num_experts"], 2, 2, seed=4)
    assert_logprobs_and_grads_equal_native(meg, native, mb)


def test_mla_round_trip_and_refusals():
    """HF -> megatron -> HF is the identity (the RoPE-row reorder of a NeoX checkpoint undone);
    what megatron's MLA cannot express is refused by name."""
    from moe_rl.model import MoEArch, MoEForCausalLM, hf_state_dict
    from moe_rl.train.megatron.convert import MegatronLayout, check_arch, hf_to_megatron, megatron_to_hf

    for over in CASES.values():
        arch = MoEArch(**{**DSV3, **over})
        hf = hf_state_dict(MoEForCausalLM(arch).init_weights(1))
        meg = hf_to_megatron(hf, arch, MegatronLayout())
        back = dict(megatron_to_hf(meg, arch, MegatronLayout()))
        assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)
    neox = MoEArch(**{**DSV3, **CASES["neox_rope"], "q_lora_rank": None})
    hf = hf_state_dict(MoEForCausalLM(neox).init_weights(1))
    meg = hf_to_megatron(hf, neox, MegatronLayout())
    assert not torch.equal(meg["decoder.layers.0.self_attention.linear_q_proj.weight"],
                           hf["model.layers.0.self_attn.q_proj.weight"])  # the RoPE rows moved
    assert dict(megatron_to_hf(meg, neox, MegatronLayout())).keys() == hf.keys()
    with pytest.raises(ValueError, match="tp_size > 1"):
        check_arch(MoEArch(**DSV3), MegatronLayout(tp_size=2))
    with pytest.raises(ValueError, match="megatron-core's MLA has no biases"):
        check_arch(MoEArch(**{**DSV3, "attention_bias": True}), MegatronLayout())
    with pytest.raises(ValueError, match="mscale_all_dim but no mscale"):
        check_arch(MoEArch(**{**DSV3, "rope_scaling": {**YARN, "mscale": None}}), MegatronLayout())


@pytest.mark.parametrize("case", ["q_lora_yarn", "neox_rope"])
def test_mla_lora_logprobs_and_adapter_grads_equal_native(cpu_megatron, case):
    """LoRA on the latent-attention projections and the experts: the same log-probs and adapter
    gradients as the native trainer (the NeoX case moves B's RoPE rows as the weight's)."""
    from moe_rl.config import LoraConfig

    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "experts.down_proj"]
    meg, native = build({**DSV3, **CASES[case]}, "cpu", lora=LoraConfig(enabled=True, rank=4, alpha=8.0,
                                                                          targets=targets, sync="adapter"))
    g = torch.Generator().manual_seed(11)
    ad = {n: (torch.randn(t.shape, generator=g) * 0.2).to(t) for n, t in native.lora.hf_tensors()}
    native.lora.load_hf_tensors(ad)
    meg.lora.load_hf_tensors(ad)
    mb = make_mb(DSV3["vocab_size"], LENGTHS)
    mb.replay = random_routes(mb.num_tokens, DSV3["num_experts"], 2, 2, seed=4)
    assert_lora_logprobs_and_adapter_grads_equal_native(meg, native, mb, nonzero=True)

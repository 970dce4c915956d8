"""megatron-core with a gpt-oss model on CPU, against the native model (fp32): the learned softmax
offset (HF's sinks), sliding windows by layer (``window_size=(W - 1, 0)``), yarn rope with
megatron's concentration factor, biases on attention, router and experts, the router's softmax
over the top-k biased logits (``pre_softmax=False``) and the clamped quick-GELU GLU with the +1
(``glu_linear_offset``, ``activation_func_clamp_value``), with megatron's SequentialMLP experts
(megatron's own MLP arithmetic) and with TorchGroupedMLP. Runs under the CPU shims of
test_forward_cpu.py's ``cpu_megatron`` fixture, megatron-core 0.16.1 and 0.19.2."""
import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
pytest.importorskip("megatron.core")

from .common import (  # noqa: E402
    assert_logprobs_and_grads_equal_native, assert_lora_logprobs_and_adapter_grads_equal_native, build, make_mb,
    native_hidden, native_record, random_routes)
from .test_forward_cpu import cpu_megatron  # noqa: E402,F401  (the module-scoped 1-rank world with shims)

W = 4
GPT_OSS = dict(model_type="gpt_oss", vocab_size=96, hidden_size=48, moe_intermediate_size=24, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=8, num_experts_per_tok=2,
               sliding_window=W, attention_bias=True, swiglu_limit=0.1, rope_theta=150_000.0,
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                             "truncate": False},
               max_position_embeddings=256)
LENGTHS = (11, 20, 9)  # every sequence longer than the window


def build_gpt_oss(**train):
    """(megatron, native) with identical weights; sinks and router biases large enough to matter."""
    meg, native = build(GPT_OSS, "cpu", **train)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for i in range(GPT_OSS["num_hidden_layers"]):
            sinks, bias = torch.randn(4, generator=g), torch.randn(8, generator=g) * 0.3
            layer, mlayer = native.model.model.layers[i], meg.model.decoder.layers[i]
            layer.self_attn.sinks.copy_(sinks)
            mlayer.self_attention.core_attention.softmax_offset.copy_(sinks)
            layer.mlp.router.bias.copy_(bias)
            mlayer.mlp.router.bias.copy_(bias)
    return meg, native


def check_config_and_names(meg, native):
    """The config's gpt-oss flags; the GPTModel's names are the converter's; Megatron -> HF gives
    the native model's tensors back, bit for bit."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from moe_rl.model import iter_local_hf_tensors
    from moe_rl.train.megatron.convert import megatron_param_specs

    tc = meg.tconfig
    assert (tc.softmax_type, tc.window_size, tc.window_attn_skip_freq) == ("learnable", (W - 1, 0), [1, 0, 1])
    assert tc.add_bias_linear and tc.activation_func is quick_gelu and tc.gated_linear_unit
    assert (tc.glu_linear_offset, tc.activation_func_clamp_value) == (1.0, 0.1)
    assert (tc.moe_router_score_function, tc.moe_router_pre_softmax) == ("softmax", False)
    assert (tc.yarn_rotary_scaling_factor, tc.yarn_original_max_position_embeddings, tc.yarn_mscale,
            tc.yarn_correction_range_round_to_int) == (4.0, 64, None, False)
    assert meg.model.position_embedding_type == "yarn"
    built = {n: tuple(p.shape) for n, p in meg.model.named_parameters()}
    assert built == dict(megatron_param_specs(meg.arch, meg.layout))
    back, want = dict(meg.hf_tensors()), dict(iter_local_hf_tensors(native.model))
    assert back.keys() == want.keys() and all(torch.equal(back[n], want[n]) for n in want)


@pytest.mark.parametrize("grouped", [False, True], ids=["SequentialMLP", "TorchGroupedMLP"])
def test_gpt_oss_hidden_routing_and_logprobs_equal_native(cpu_megatron, grouped):
    """The config and names (``check_config_and_names``); megatron's own routing (softmax over the
    top-k biased logits) picks the native model's experts in the same order; hidden states and
    log-probs agree, routed and replayed."""
    meg, native = build_gpt_oss(megatron_grouped_gemm=grouped)
    assert meg.opts.experts == ("TorchGroupedMLP" if grouped else "SequentialMLP")
    check_config_and_names(meg, native)
    mb = make_mb(GPT_OSS["vocab_size"], LENGTHS)
    rec_native = native_record(native, mb)
    rec_meg = []
    with torch.no_grad():
        got = meg.hidden_states(mb, record=rec_meg)
        ref = native_hidden(native, mb)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert len(rec_meg) == len(rec_native) == 3
    assert all(torch.equal(a, b) for a, b in zip(rec_meg, rec_native))
    mb.replay = random_routes(mb.num_tokens, GPT_OSS["num_experts"], 2, 3)
    with torch.no_grad():
        lp, ent = meg.logprobs(mb, 0.7, with_entropy=True)
        lp_ref, ent_ref = native.logprobs(mb, 0.7, with_entropy=True)
    torch.testing.assert_close(lp, lp_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent, ent_ref, atol=1e-4, rtol=1e-4)


def test_gpt_oss_every_gradient_equals_native_under_replay(cpu_megatron):
    """Log-probs and every parameter's gradient (sinks, o_proj/router/expert biases, the
    interleaved gate/up), mapped to HF names, equal the native model's."""
    meg, native = build_gpt_oss()
    mb = make_mb(GPT_OSS["vocab_size"], LENGTHS)
    mb.replay = random_routes(mb.num_tokens, GPT_OSS["num_experts"], 2, 3, seed=4)
    assert_logprobs_and_grads_equal_native(meg, native, mb)


def test_megatrons_own_attention_counts_the_window_and_sinks_as_hf(cpu_megatron, monkeypatch):
    """megatron-core's local DotProductAttention (its own masks and SoftmaxOne) with this
    backend's config (window_size=(W - 1, 0), the learned softmax_offset) equals the native
    attention with HF's window W and sinks on one sequence; with Megatron-Bridge's (W, 0) it does
    not (one key more)."""
    import dataclasses

    import megatron.core.transformer.utils as mutils
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from moe_rl.model.attention import sdpa

    class CpuTorch:  # megatron builds the sliding mask on "cuda"
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def ones(*a, device=None, **k):
            return torch.ones(*a, **k)

    monkeypatch.setattr(mutils, "torch", CpuTorch())
    from moe_rl.model import MoEArch
    from moe_rl.train.megatron.model import MegatronOptions, init_parallel_state, transformer_config

    init_parallel_state(1, 1, cuda=False)  # the layer reads megatron's groups (this test may run first in its world)
    tconfig = transformer_config(MoEArch(**GPT_OSS), MegatronOptions(use_te=False, grouped_gemm=False))
    g = torch.Generator().manual_seed(0)
    T, D = 13, 12
    q, k, v = (torch.randn(T, 1, n, D, generator=g) for n in (4, 2, 2))
    sinks = torch.randn(4, generator=g)
    want = sdpa(q[:, 0].transpose(0, 1)[None], k[:, 0].transpose(0, 1)[None], v[:, 0].transpose(0, 1)[None],
                is_causal=True, sinks=sinks, window=W)[0].transpose(0, 1).reshape(T, 1, -1)
    for window, equal in (((W - 1, 0), True), ((W, 0), False)):
        cfg = dataclasses.replace(tconfig, window_size=window, masked_softmax_fusion=False)
        for k_, v_ in vars(tconfig).items():
            if k_.startswith("yarn_"):
                setattr(cfg, k_, v_)
        attn = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        with torch.no_grad():
            attn.softmax_offset.copy_(sinks)
            got = attn(q, k, v, attention_mask=None)
        assert torch.allclose(got, want, atol=1e-5) == equal, window


def test_gpt_oss_lora_on_attention_router_and_experts_equals_native(cpu_megatron):
    """The native adapters applied to megatron's weights (gpt-oss's interleaved gate/up rows
    de-interleaved into fc1's [gate; up]): the same log-probs and adapter gradients."""
    from .test_lora_cpu import build_lora

    meg, native = build_lora(arch=GPT_OSS)
    mb = make_mb(GPT_OSS["vocab_size"], LENGTHS)
    mb.replay = native_record(native, mb)
    nat = assert_lora_logprobs_and_adapter_grads_equal_native(meg, native, mb)
    assert any("experts__gate_up_proj" in n for n in nat)

"""megatron-core with a GLM-4.5-style model on CPU, against the native model (fp32): sigmoid
routing with the expert bias and router groups, shared experts, the first layer dense, partial
rotary and q/k/v bias (the CPU shims of test_forward_cpu.py's ``cpu_megatron`` fixture)."""
import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
pytest.importorskip("megatron.core")

from .common import (  # noqa: E402
    assert_logprobs_and_grads_equal_native, build, make_mb, native_hidden, native_record, pg_step, random_correction_bias, random_routes, replayed_batch)
from .test_forward_cpu import cpu_megatron  # noqa: E402,F401  (the module-scoped 1-rank world with shims)

GLM_ARCH = dict(model_type="glm4_moe", vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=8,
                num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1,
                routed_scaling_factor=2.5, attention_bias=True, rope_theta=10_000.0, max_position_embeddings=256)
LENGTHS = (11, 20, 9)


def build_glm(**train):
    """(megatron, native) with identical weights, the correction bias random (the same in both)."""
    meg, native = build(GLM_ARCH, "cpu", **train)
    random_correction_bias(meg, native, GLM_ARCH["num_experts"])
    return meg, native


def test_glm_transformer_config_and_names(cpu_megatron):
    from moe_rl.train.megatron.convert import megatron_param_specs

    meg, _ = build_glm()
    tc = meg.tconfig
    assert (tc.moe_router_score_function, tc.moe_router_enable_expert_bias, tc.moe_router_num_groups,
            tc.moe_router_group_topk, tc.moe_router_topk_scaling_factor) == ("sigmoid", True, 2, 1, 2.5)
    assert tc.moe_shared_expert_intermediate_size == 24 and tc.add_qkv_bias and not tc.qk_layernorm
    assert tc.moe_layer_freq == [0, 1, 1]
    built = {n: tuple(p.shape) for n, p in meg.model.named_parameters()}
    built.update((n, tuple(b.shape)) for n, b in meg.model.named_buffers() if n.endswith("router.expert_bias"))
    assert built == dict(megatron_param_specs(meg.arch, meg.layout))


def test_glm_hidden_routing_and_logprobs_equal_native(cpu_megatron):
    """megatron's own routing (sigmoid + bias, group-limited) picks the native model's experts;
    hidden states and log-probs agree, routed and replayed."""
    meg, native = build_glm()
    mb = make_mb(GLM_ARCH["vocab_size"], LENGTHS)
    rec_native = native_record(native, mb)
    rec_meg = []
    with torch.no_grad():
        got = meg.hidden_states(mb, record=rec_meg)
        ref = native_hidden(native, mb)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert len(rec_meg) == len(rec_native) == 2
    for a, b in zip(rec_meg, rec_native):
        assert torch.equal(a.sort(1).values, b.sort(1).values)
    # the bias and the groups decide: plain top-2 of the scores would route elsewhere
    scores = torch.sigmoid(native.model.model.layers[1].mlp.gate(_mlp_input(native, mb, 1)))
    assert not torch.equal(rec_native[0].sort(1).values, scores.topk(2).indices.sort(1).values)
    mb.replay = random_routes(mb.num_tokens, GLM_ARCH["num_experts"], 2, 2)
    with torch.no_grad():
        lp, ent = meg.logprobs(mb, 0.7, with_entropy=True)
        lp_ref, ent_ref = native.logprobs(mb, 0.7, with_entropy=True)
    torch.testing.assert_close(lp, lp_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent, ent_ref, atol=1e-4, rtol=1e-4)


def _mlp_input(native, mb, layer):
    """The post-attention-norm hidden states entering MoE layer ``layer`` (a forward hook)."""
    seen = []
    h = native.model.model.layers[layer].mlp.register_forward_hook(lambda m, a, o: seen.append(a[0].detach()))
    try:
        with torch.no_grad():
            native.model.hidden_states(mb.input_ids, cu_seqlens=mb.cu_seqlens)
    finally:
        h.remove()
    return seen[0]


def test_glm_every_gradient_equals_native_under_replay(cpu_megatron):
    """Replayed routes the routers would not pick: log-probs and every parameter's gradient
    (router, shared experts, q/k/v bias, experts), mapped to HF names, equal the native model's."""
    meg, native = build_glm()
    mb = make_mb(GLM_ARCH["vocab_size"], LENGTHS)
    mb.replay = random_routes(mb.num_tokens, GLM_ARCH["num_experts"], 2, 2, seed=4)
    assert_logprobs_and_grads_equal_native(meg, native, mb)


@pytest.mark.parametrize("rate", [0.0, 0.01])
def test_glm_expert_bias_update_equals_native(cpu_megatron, rate):
    """train.expert_bias_update_rate: megatron-core's update after a step equals the native
    backend's (DeepSeek-V3's rule); at 0 the bias stays; either way the counts restart."""
    meg, native = build_glm(expert_bias_update_rate=rate)
    mbs, adv, n_tokens = replayed_batch(native, GLM_ARCH["vocab_size"], LENGTHS)
    before = {l: native.model.model.layers[l].mlp.gate.e_score_correction_bias.clone() for l in meg.arch.moe_layers}
    for _ in range(2):
        pg_step(meg, mbs, adv, n_tokens)
        pg_step(native, mbs, adv, n_tokens)
    for l in meg.arch.moe_layers:
        router = meg.model.decoder.layers[l].mlp.router
        nb = native.model.model.layers[l].mlp.gate.e_score_correction_bias
        assert router.expert_bias.dtype == torch.float32 and torch.equal(router.expert_bias, nb)
        assert torch.equal(nb, before[l]) == (rate == 0)
        assert router.local_tokens_per_expert.sum() == 0
    got = dict(meg.hf_tensors())
    assert torch.equal(got["model.layers.1.mlp.gate.e_score_correction_bias"],
                       native.model.model.layers[1].mlp.gate.e_score_correction_bias)


@pytest.mark.parametrize("recompute", [False, True])
def test_glm_filler_rows_are_left_out_of_the_expert_load(cpu_megatron, recompute):
    """A packed row's filler (``MicroBatch.padding``: the equal-length padding of megatron's
    allgather dispatcher, a dummy micro-batch) is forwarded but not counted in the expert load
    that the bias update reads: megatron's routers (a forward hook of the backend's) and the
    native gates count exactly the replayed experts of the real rows, also where megatron counts
    in the backward's recompute (``megatron_recompute``: its forward runs without grad). Without
    the mark the filler's rows, all routed to experts 0 and 1 here, would be counted."""
    from moe_rl.train.backend import MicroBatch

    meg, native = build_glm(expert_bias_update_rate=0.01, megatron_recompute=recompute)
    E, k, pad = GLM_ARCH["num_experts"], GLM_ARCH["num_experts_per_tok"], 13
    mb = make_mb(GLM_ARCH["vocab_size"], LENGTHS)
    real = native_record(native, mb)
    T = mb.num_tokens
    filler = torch.arange(k).expand(pad, k)

    def padded(padding):
        return MicroBatch(torch.cat([mb.input_ids, torch.zeros(1, pad, dtype=torch.long)], 1),
                          torch.cat([mb.cu_seqlens, torch.tensor([T + pad])]),
                          torch.cat([mb.labels, torch.full((pad,), -100)]),
                          [torch.cat([r, filler]) for r in real], padding=padding)

    def loads(backend):
        if backend is meg:
            return [meg.model.decoder.layers[l].mlp.router.local_tokens_per_expert.double().clone() for l in meg.arch.moe_layers]
        return [native.model.model.layers[l].mlp.gate.load.clone() for l in meg.arch.moe_layers]

    def step(backend, micro):  # forward and backward, as the training loop runs a micro-batch
        lp, _ = backend.logprobs(micro, 1.0)
        lp.sum().backward()

    want = [torch.bincount(r.reshape(-1), minlength=E).double() for r in real]
    dummy = MicroBatch(torch.zeros(1, 6, dtype=torch.long), torch.tensor([0, 6]), torch.full((6,), -100),
                       [torch.arange(k).expand(6, k)] * len(real), padding=6)
    for backend in (meg, native):
        step(backend, padded(pad))
        got = loads(backend)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (backend, g, w)
        step(backend, dummy)  # all filler: counts nothing
        assert all(torch.equal(a, b) for a, b in zip(loads(backend), got))
        step(backend, padded(0))  # unmarked, the filler counts
        extra = torch.zeros(E, dtype=torch.float64).index_add_(0, filler.reshape(-1), torch.ones(pad * k, dtype=torch.float64))
        assert all(torch.equal(a, 2 * w + extra) for a, w in zip(loads(backend), want))

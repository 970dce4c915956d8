"""megatron-core's GPTModel built on CPU (use_cpu_initialization, gloo): its parameter names and
shapes equal what the converter produces, at EP=1 and EP=2, and the MegatronBackend's weight
path (HF -> GPTModel -> hf_tensors) is bit-exact. megatron-core's forward needs CUDA (the router
moves its weight to the GPU), so forward checks live in test_megatron_gpu.py and, under the CUDA
shims of cpu_shims/, in test_forward_cpu.py; the EP=2 test here runs one with shims too (its two
ranks' micro-batches of unequal lengths, padded by the loop).

On CPU the MoE layers use the allgather token dispatcher, except in the alltoall test (the
GPU default: it copies the split sizes to the host on a CUDA side stream, for which the shims
put CPU stand-ins). Parameter names do not depend on the dispatcher.
"""
import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
pytest.importorskip("megatron.core")

from tests.distributed import free_port, run_distributed

from .workers import _cfg, check_alltoall_ep2, check_backend

def test_gptmodel_ep1_names_shapes_and_weights(monkeypatch):
    """In this process (a 1-rank gloo world), torn down afterwards."""
    from megatron.core import parallel_state as ps

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        check_backend(0, 1, 1, 1)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_gptmodel_ep2_inside_trainer_pool():
    """2 trainers (EP=2) + 1 engine rank: megatron's parallel_state is built by the trainers alone;
    the two ranks' micro-batches of unequal lengths are padded by the loop to equal lengths, which
    megatron's allgather dispatcher needs, and give the EP=1 native model's log-probs."""
    run_distributed(check_backend, 3, 2, 2, timeout=180)


def test_alltoall_dispatcher_ep2_equals_native():
    """The GPU default dispatcher at EP=2, on CPU over gloo (workers.check_alltoall_ep2)."""
    run_distributed(check_alltoall_ep2, 2, timeout=180)


def test_router_fusion_refused_with_replay():
    from moe_rl.train.megatron.model import MegatronOptions

    with pytest.raises(ValueError, match="megatron_router_fusion=true cannot be used with routing replay"):
        MegatronOptions.from_config(_cfg(megatron_router_fusion=True, megatron_use_te=False))
    cfg = _cfg(megatron_router_fusion=True, megatron_use_te=False)
    cfg.replay.enabled = False
    assert MegatronOptions.from_config(cfg).router_fusion


def test_transformer_config_router_flags():
    """Qwen3-MoE's softmax -> top-k -> renormalise == megatron softmax with pre_softmax=False."""
    from moe_rl.train.megatron.model import MegatronOptions, transformer_config

    cfg = _cfg(megatron_use_te=False)
    opts = MegatronOptions.from_config(cfg)
    tc = transformer_config(cfg.model.arch(), opts)
    assert (tc.moe_router_score_function, tc.moe_router_pre_softmax, tc.moe_router_topk_scaling_factor) == ("softmax", False, None)
    assert tc.moe_enable_routing_replay and not tc.moe_router_fusion and tc.qk_layernorm and not tc.add_bias_linear
    assert tc.moe_layer_freq == [1, 0, 1] and tc.num_query_groups == 2 and tc.kv_channels == 8
    cfg.model.norm_topk_prob = False
    assert transformer_config(cfg.model.arch(), opts).moe_router_pre_softmax


def test_replay_math_matches_native():
    """megatron's replay path (topk_routing_with_score_function + RouterReplay, REPLAY_FORWARD)
    gives the native router's weights for the same replayed ids (R3: softmax over the chosen)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from moe_rl.model.transformer import SparseMoE

    arch = _cfg().model.arch()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, arch.num_experts, generator=g)
    ids = torch.stack([torch.randperm(arch.num_experts, generator=g)[:2] for _ in range(7)])
    before = list(RouterReplay.global_router_replay_instances)
    rr = RouterReplay()
    try:
        rr.set_target_indices(ids)
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        probs, routing_map = topk_routing_with_score_function(logits, 2, use_pre_softmax=False, router_replay=rr)
    finally:
        RouterReplay.global_router_replay_instances[:] = before
    moe = SparseMoE(arch, 0)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.eye(arch.num_experts, arch.hidden_size))
    x = torch.zeros(7, arch.hidden_size)
    x[:, : arch.num_experts] = logits
    nids, nweights = moe.route(x, ids)
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, ids, True))
    torch.testing.assert_close(probs.gather(1, nids), nweights, atol=1e-6, rtol=0)


def _other_spec_form(spec):
    """A layer-spec entry in the other release's form: megatron-core 0.16's
    ``ModuleSpec(module=cls, submodules=...)`` <-> 0.19's ``functools.partial(cls, submodules=...)``."""
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, functools.partial):
        return ModuleSpec(module=spec.func, submodules=spec.keywords["submodules"])
    return functools.partial(spec.module, submodules=spec.submodules, **spec.params)


@pytest.mark.parametrize("form", ["installed", "other"])
def test_spec_edits_take_both_megatron_spec_forms(form):
    """The expert and core-attention swaps read the layer specs of either megatron-core form (0.19.2
    crashed on `.module` of a partial): whichever release is installed, its own spec and the spec
    rewritten into the other release's form both get TorchGroupedMLP / TorchSDPAttention."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from moe_rl.train.megatron.attention import TorchSDPAttention
    from moe_rl.train.megatron.experts import TorchGroupedMLP
    from moe_rl.train.megatron.model import (_spec_module, _spec_submodules, use_torch_grouped_experts,
                                             use_torch_sdpa_attention)

    # what get_gpt_decoder_block_spec assembles (it needs parallel_state): MoE, dense, MoE layers
    layer = lambda experts: get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=True,  # noqa: E731
                                                     normalization="RMSNorm")
    spec = TransformerBlockSubmodules(layer_specs=[layer(4), layer(None), layer(4)])
    if form == "other":
        for layer in spec.layer_specs:
            sub = _spec_submodules(layer)
            sub.mlp = _other_spec_form(sub.mlp)
            sub.self_attention = _other_spec_form(sub.self_attention)
    use_torch_grouped_experts(spec)
    use_torch_sdpa_attention(spec)
    mlps = [_spec_submodules(layer).mlp for layer in spec.layer_specs]
    assert [_spec_module(m) is MoELayer for m in mlps] == [True, False, True]
    assert [_spec_module(_spec_submodules(m).experts) for m in (mlps[0], mlps[2])] == [TorchGroupedMLP] * 2
    assert all(_spec_submodules(_spec_submodules(layer).self_attention).core_attention is TorchSDPAttention
               for layer in spec.layer_specs)

    dense = copy.deepcopy(spec)
    dense.layer_specs = [layer for layer, m in zip(dense.layer_specs, mlps) if _spec_module(m) is not MoELayer]
    with pytest.raises(RuntimeError, match="no MoELayer"):
        use_torch_grouped_experts(dense)

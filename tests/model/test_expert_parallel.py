"""Expert parallelism over 2 gloo processes equals the single-process model (fp32, 1e-5)."""
import pytest
import torch
import torch.distributed as dist

from moe_rl.model import MoEArch, MoEForCausalLM, expert_owner, iter_local_hf_tensors, stacked_expert_rows
from tests.distributed import run_distributed

ARCHS = {
    "qwen3": MoEArch(vocab_size=48, hidden_size=32, num_hidden_layers=3, num_experts=8, num_experts_per_tok=3,
                     mlp_only_layers=[1], moe_intermediate_size=16, head_dim=8),
    # DeepSeek-V3: GLM's router and shared experts behind multi-head latent attention
    "dsv3": MoEArch(model_type="deepseek_v3", vocab_size=48, hidden_size=32, num_hidden_layers=3, num_experts=8,
                    num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                    routed_scaling_factor=2.0, moe_intermediate_size=16, q_lora_rank=12, kv_lora_rank=16,
                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
    # gpt-oss: stacked expert tensors with biases (each rank holds a block of their rows), biased router
    "gpt_oss": MoEArch(model_type="gpt_oss", vocab_size=48, hidden_size=32, num_hidden_layers=2, num_experts=8,
                       num_experts_per_tok=3, sliding_window=3, attention_bias=True, moe_intermediate_size=16,
                       head_dim=8),
    # Qwen3-Next: Gated DeltaNet and gated attention layers, every layer MoE with a gated shared expert
    "qwen3_next": MoEArch(model_type="qwen3_next", vocab_size=48, hidden_size=32, num_hidden_layers=2, num_experts=8,
                          num_experts_per_tok=3, shared_expert_intermediate_size=16, moe_intermediate_size=16,
                          head_dim=8, layer_types=["linear_attention", "full_attention"]),
}


def _build(ARCH, ep_group=None):
    model = MoEForCausalLM(ARCH, ep_group=ep_group).init_weights(11, std=0.2)
    with torch.no_grad():
        for i in model.moe_layers:
            if ARCH.router == "sigmoid":
                model.model.layers[i].mlp.gate.e_score_correction_bias.normal_(
                    0, 0.2, generator=torch.Generator().manual_seed(i))
    return model


def _ep_equals_reference(rank, world, use_replay, arch):
    ARCH = ARCHS[arch]
    torch.manual_seed(0)
    ids = torch.randint(0, ARCH.vocab_size, (4, 9), generator=torch.Generator().manual_seed(5))
    ref = _build(ARCH)
    ep = _build(ARCH, dist.group.WORLD)
    assert ep.model.layers[ep.moe_layers[0]].mlp.num_local == 4
    if ARCH.router == "sigmoid":
        ref.track_expert_load()
        ep.track_expert_load()

    rec = []
    ref_logits = ref(ids, record=rec if use_replay else None)
    ref_logits.pow(2).mean(-1).sum().backward()  # loss over the whole batch

    mine = slice(2 * rank, 2 * rank + 2)  # this rank's data-parallel shard of sequences
    replay = None
    if use_replay:
        replay = [r.view(4, 9, -1)[mine].reshape(-1, r.shape[-1]) for r in rec]
    logits = ep(ids[mine], replay=replay)
    torch.testing.assert_close(logits, ref_logits[mine], atol=1e-5, rtol=0)
    logits.pow(2).mean(-1).sum().backward()

    ref_named = dict(iter_local_hf_tensors(ref))
    checked = 0
    for name, t in iter_local_hf_tensors(ep):
        if name.endswith("e_score_correction_bias"):
            continue  # a buffer: no gradient (checked below)
        grad = _grad_of(ep, name)
        expected = _grad_of(ref, name)
        if stacked_expert_rows(name, ARCH) is not None:  # this rank's rows of a stacked expert tensor
            rows = slice(rank * 4, rank * 4 + 4)
            expected, want = expected[rows], ref_named[name][rows]
        else:
            want = ref_named[name]
            if expert_owner(name, ARCH, world) is None:  # replicated: sum the data-parallel parts
                dist.all_reduce(grad)
        # rtol: a few fp32 ulps (the two paths sum a token's k expert rows, and the ranks' parts,
        # in other orders; the Gated DeltaNet conv's grads reach ~20)
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=2e-6, msg=lambda m: f"{name}: {m}")
        assert torch.equal(t, want)
        checked += 1
    assert checked > 0
    if use_replay:
        router = ep.model.layers[ep.moe_layers[0]].mlp.gate
        assert router.weight.grad.abs().sum() > 0
    if ARCH.router == "sigmoid":  # the bias update sees the loads of both ranks' tokens
        ref.update_expert_bias(0.05)
        ep.update_expert_bias(0.05, group=dist.group.WORLD)
        for i in ep.moe_layers:
            want = ref.model.layers[i].mlp.gate.e_score_correction_bias
            assert torch.equal(ep.model.layers[i].mlp.gate.e_score_correction_bias, want)


def _grad_of(model, hf_name):
    """Gradient of the tensor behind an HF name (a slice of the stacked expert grad)."""
    from moe_rl.model import parse_expert_name

    parsed = parse_expert_name(hf_name)
    if parsed is None:
        return model.get_parameter(hf_name).grad.clone()
    layer, expert, proj = parsed
    moe = model.model.layers[layer].mlp
    return getattr(moe.experts, proj).grad[expert - moe.ep_rank * moe.num_local].clone()


# dsv3 carries GLM-4.5's router and shared experts (the MoE block EP shards) behind latent attention
@pytest.mark.parametrize("use_replay,arch", [(False, "qwen3"), (True, "qwen3"), (True, "dsv3"), (True, "qwen3_next")],
                         ids=["routed", "replayed", "dsv3-replayed", "qwen3_next-replayed"])
def test_ep2_equals_ep1(use_replay, arch):
    run_distributed(_ep_equals_reference, 2, use_replay, arch)


def _gpt_oss_ep(rank, world, path):
    """gpt-oss under EP=2 (one spawn for all of it): the forward, backward and replay equal the
    single-process model's; the checkpoint's gather (train/checkpoint.gather_hf_state) brings the
    stacked expert tensors back whole, equal to the EP=1 model's; and each rank loads only its
    experts' rows of an MXFP4 checkpoint, dequantized as the whole model's rows."""
    from types import SimpleNamespace

    from moe_rl.model import hf_state_dict, load_hf
    from moe_rl.train.checkpoint import gather_hf_state

    _ep_equals_reference(rank, world, True, "gpt_oss")
    ARCH = ARCHS["gpt_oss"]
    ep = _build(ARCH, dist.group.WORLD)
    backend = SimpleNamespace(arch=ARCH, ep_size=world, hf_tensors=lambda: iter_local_hf_tensors(ep),
                              owner_ep_rank=lambda name: expert_owner(name, ARCH, world))
    got = gather_hf_state(backend, SimpleNamespace(ep=dist.group.WORLD, dp_rank=0))
    if rank == 0:
        want = hf_state_dict(_build(ARCH))
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want)
    else:
        assert got is None
    full, part = load_hf(path), load_hf(path, ep_group=dist.group.WORLD)
    rows = slice(rank * 2, rank * 2 + 2)
    for layer in range(2):
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            n = f"model.layers.{layer}.mlp.experts.{name}"
            assert torch.equal(part.get_parameter(n), full.get_parameter(n)[rows]), n


def test_gpt_oss_ep2_equals_ep1_and_its_stacked_experts_gather_and_load(tmp_path):
    pytest.importorskip("transformers")
    from tests.model.test_gpt_oss import mxfp4_checkpoint

    path, _ = mxfp4_checkpoint(tmp_path)
    run_distributed(_gpt_oss_ep, 2, str(path))

"""Expert parallelism over 2 gloo processes equals the single-process model (fp32, 1e-5)."""
import pytest
import torch
import torch.distributed as dist

from moe_rl.model import MoEArch, MoEForCausalLM, expert_owner, iter_local_hf_tensors
from tests.distributed import run_distributed

ARCH = MoEArch(vocab_size=48, hidden_size=32, num_hidden_layers=3, num_experts=8, num_experts_per_tok=3,
               mlp_only_layers=[1], moe_intermediate_size=16, head_dim=8)


def _ep_equals_reference(rank, world, use_replay):
    torch.manual_seed(0)
    ids = torch.randint(0, ARCH.vocab_size, (4, 9), generator=torch.Generator().manual_seed(5))
    ref = MoEForCausalLM(ARCH).init_weights(11, std=0.2)
    ep = MoEForCausalLM(ARCH, ep_group=dist.group.WORLD).init_weights(11, std=0.2)
    assert ep.model.layers[0].mlp.num_local == 4

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
        grad = _grad_of(ep, name)
        if expert_owner(name, ARCH, world) is None:  # replicated: sum the data-parallel parts
            dist.all_reduce(grad)
        expected = _grad_of(ref, name)
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        assert torch.equal(t, ref_named[name])
        checked += 1
    assert checked > 0
    if use_replay:
        assert _grad_of(ep, "model.layers.0.mlp.gate.weight").abs().sum() > 0


def _grad_of(model, hf_name):
    """Gradient of the tensor behind an HF name (a slice of the stacked expert grad)."""
    from moe_rl.model import parse_expert_name

    parsed = parse_expert_name(hf_name)
    if parsed is None:
        return model.get_parameter(hf_name).grad.clone()
    layer, expert, proj = parsed
    moe = model.model.layers[layer].mlp
    return getattr(moe.experts, proj).grad[expert - moe.ep_rank * moe.num_local].clone()


@pytest.mark.parametrize("use_replay", [False, True], ids=["routed", "replayed"])
def test_ep2_equals_ep1(use_replay):
    run_distributed(_ep_equals_reference, 2, use_replay)

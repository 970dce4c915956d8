"""Routing record / replay (R3) on the native model."""
import pytest
import torch

from moe_rl.model import MoEArch, MoEForCausalLM, RoutingError

ARCH = MoEArch(vocab_size=40, hidden_size=32, num_hidden_layers=3, num_experts=8, num_experts_per_tok=3,
               mlp_only_layers=[1], moe_intermediate_size=16, head_dim=8)


@pytest.fixture
def model():
    return MoEForCausalLM(ARCH).init_weights(7, std=0.2)


def ids(B=2, T=6):
    return torch.randint(0, 40, (B, T), generator=torch.Generator().manual_seed(0))


def test_record_format(model):
    rec = []
    model(ids(), record=rec)
    assert len(rec) == len(ARCH.moe_layers) == 2
    for r in rec:
        assert r.shape == (12, 3) and r.dtype == torch.long
        assert r.min() >= 0 and r.max() < 8
        # top-k order: gate probabilities non-increasing along the row
    x = torch.randn(5, 32)
    moe = model.model.layers[0].mlp
    chosen, w = moe.route(x, None)
    assert (w[:, :-1] >= w[:, 1:]).all()


def test_replay_reproduces_record_exactly(model):
    rec = []
    with torch.no_grad():
        ref = model(ids(), record=rec)
        again = model(ids(), replay=rec)
    assert torch.equal(ref, again)


def test_replay_uses_recorded_experts_under_perturbed_router(model):
    rec = []
    with torch.no_grad():
        model(ids(), record=rec)
        for i in ARCH.moe_layers:
            model.model.layers[i].mlp.gate.weight.add_(torch.randn_like(model.model.layers[i].mlp.gate.weight))
        free = []
        model(ids(), record=free)
        assert any(not torch.equal(a, b) for a, b in zip(rec, free)), "perturbation should change routing"
        replayed = []
        model(ids(), replay=rec, record=replayed)
    for a, b in zip(rec, replayed):
        assert torch.equal(a, b)


def test_replay_gate_weights_are_renormalised_router_probs(model):
    moe = model.model.layers[0].mlp
    x = torch.randn(4, 32)
    chosen = torch.tensor([[0, 1, 2], [7, 3, 5], [4, 6, 0], [2, 5, 1]])
    _, w = moe.route(x, chosen)
    probs = torch.softmax(x @ moe.gate.weight.t(), dim=-1)
    expect = probs.gather(1, chosen)
    expect = expect / expect.sum(-1, keepdim=True)  # norm_topk_prob=True
    torch.testing.assert_close(w, expect, atol=1e-6, rtol=0)


def test_router_gets_gradients_under_replay(model):
    rec = []
    with torch.no_grad():
        model(ids(), record=rec)
    model.zero_grad()
    model(ids(), replay=rec).logsumexp(-1).sum().backward()
    for i in ARCH.moe_layers:
        g = model.model.layers[i].mlp.gate.weight.grad
        assert g is not None and g.abs().sum() > 0


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r: r[:1], "replay record has 1 layers"),
        (lambda r: [r[0][:-1], r[1]], "shape"),
        (lambda r: [r[0][:, :2], r[1]], "shape"),
        (lambda r: [r[0].clone().fill_(8), r[1]], "out of range"),
        (lambda r: [r[0] * 0 - 1, r[1]], "out of range"),
        (lambda r: [torch.cat([r[0][:, :1]] * 3, dim=1), r[1]], "duplicate expert id"),
        (lambda r: [r[0].float(), r[1]], "integer tensor"),
    ],
)
def test_bad_records_raise(model, mutate, match):
    rec = []
    with torch.no_grad():
        model(ids(), record=rec)
    with pytest.raises(RoutingError, match=match):
        model(ids(), replay=mutate(rec))

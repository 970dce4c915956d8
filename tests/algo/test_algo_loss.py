import math

import pytest
import torch

from moe_rl.algo import k3, loss_normalisers, mismatch_metrics, policy_loss
from moe_rl.config import AlgoConfig

PLAIN = dict(clip_low=0.2, clip_high=0.28, tis_cap=None, icepop_low=None, icepop_high=None)


def cfg(**kw):
    return AlgoConfig(**{**PLAIN, **kw})


def t(xs, grad=False):
    x = torch.tensor(xs, dtype=torch.float64)
    return x.requires_grad_(grad)


def test_clipping_both_sides_both_signs():
    r = [1.5, 0.5, 0.5, 1.5, 1.1]
    A = t([1.0, 1.0, -1.0, -1.0, 2.0])
    logp = t([math.log(x) for x in r], grad=True)
    zero = t([0.0] * 5)
    loss, m = policy_loss(logp, zero, zero, A, torch.ones(5), torch.arange(5), cfg())
    # per token: max(-A r, -A clip(r, 0.8, 1.28))
    #  A=+1 r=1.5 -> -1.28 (clipped), A=+1 r=0.5 -> -0.5, A=-1 r=0.5 -> 0.8 (clipped),
    #  A=-1 r=1.5 -> 1.5, A=2 r=1.1 -> -2.2
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5 - 2.2) / 5)
    loss.backward()
    # d/dlogp (-A r) = -A r where unclipped, 0 where clipped
    assert torch.allclose(logp.grad, t([0.0, -0.5, 0.0, 1.5, -2.2]) / 5)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["ratio_mean"] == pytest.approx(sum(r) / 5)
    assert m["pg_loss"] == pytest.approx(loss.item())


def test_tis_truncates_detached_behaviour_weight():
    logp = t([0.0, 0.0], grad=True)
    prox = t([0.0, 0.0], grad=True)
    behav = t([-math.log(3.0), math.log(2.0)])  # w = 3 (-> cap 2), 0.5
    loss, m = policy_loss(logp, prox, behav, t([1.0, 1.0]), torch.ones(2), torch.arange(2), cfg(tis_cap=2.0))
    assert loss.item() == pytest.approx((-2.0 - 0.5) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, t([-2.0, -0.5]) / 2)
    assert prox.grad is None  # proximal and behaviour log-probs never get gradients
    assert m["tis_frac"] == pytest.approx(0.5)
    # no cap: the full weight
    loss, m = policy_loss(logp, prox, behav, t([1.0, 1.0]), torch.ones(2), torch.arange(2), cfg(tis_cap=None))
    assert loss.item() == pytest.approx((-3.0 - 0.5) / 2) and m["tis_frac"] == 0


def test_icepop_masks_tokens_outside_band_but_keeps_them_in_the_normaliser():
    w = [0.4, 1.0, 2.5, 1.9]
    logp = t([0.0] * 4, grad=True)
    behav = t([-math.log(x) for x in w])
    c = cfg(icepop_low=0.5, icepop_high=2.0, tis_cap=1.5)
    loss, m = policy_loss(logp, t([0.0] * 4), behav, t([1.0] * 4), torch.ones(4), torch.arange(4), c)
    # tokens 0 and 2 masked; token 3 truncated 1.9 -> 1.5
    assert loss.item() == pytest.approx((-1.0 - 1.5) / 4)
    loss.backward()
    assert torch.allclose(logp.grad, t([0.0, -1.0, 0.0, -1.5]) / 4)
    assert m["icepop_frac"] == pytest.approx(0.5)
    assert m["tis_frac"] == pytest.approx(0.25)
    assert m["mismatch_max_ratio"] == pytest.approx(2.5)


def test_masked_garbage_tokens_do_not_leak_or_nan():
    logp = t([0.0, 50.0, 0.0], grad=True)
    prox = t([0.0, -50.0, 0.0])
    behav = t([0.0, -200.0, 0.0])
    loss, _ = policy_loss(logp, prox, behav, t([1.0, -1.0, 1.0]), torch.tensor([1, 0, 1]), torch.arange(3),
                          AlgoConfig(kl_coef=0.5), ref_logp=t([0.0, 300.0, 0.0]))
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    assert torch.isfinite(logp.grad).all() and logp.grad[1] == 0


def test_token_vs_sequence_aggregation():
    # at ratio 1 the per-token loss is -A: seq 0 -> [1, 2, 3], seq 1 -> [5]
    A = t([-1.0, -2.0, -3.0, -5.0])
    z = t([0.0] * 4)
    seq = torch.tensor([10, 10, 10, 42])
    tok, _ = policy_loss(z, z, z, A, torch.ones(4), seq, cfg(loss_agg="token"))
    sq, _ = policy_loss(z, z, z, A, torch.ones(4), seq, cfg(loss_agg="sequence"))
    assert tok.item() == pytest.approx(11 / 4)
    assert sq.item() == pytest.approx((2 + 5) / 2)
    # a masked token leaves its sequence's mean and the counts
    mask = torch.tensor([1, 1, 0, 1])
    sq, _ = policy_loss(z, z, z, A, mask, seq, cfg(loss_agg="sequence"))
    assert sq.item() == pytest.approx((1.5 + 5) / 2)
    assert loss_normalisers(mask, seq) == (3, 2)
    assert loss_normalisers(torch.tensor([1, 1, 1, 0]), seq) == (3, 1)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    lens = [3, 5, 1, 4, 6, 2, 3, 4]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    T = len(seq)
    logp = (-torch.rand(T, generator=g, dtype=torch.float64) * 3)
    prox = logp + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)  # some clipping
    behav = prox + 0.5 * torch.randn(T, generator=g, dtype=torch.float64)  # some TIS / IcePop
    adv = torch.randn(len(lens), generator=g, dtype=torch.float64)[seq]
    mask = (torch.rand(T, generator=g) > 0.2).long()
    mask[seq == 2] = 0  # a sequence with no counted token
    ref = logp + 0.2 * torch.randn(T, generator=g, dtype=torch.float64)
    ent = torch.rand(T, generator=g, dtype=torch.float64)
    return lens, seq, logp, prox, behav, adv, mask, ref, ent


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_split_over_ranks_and_micro_batches_sums_to_whole_batch(agg):
    lens, seq, logp0, prox, behav, adv, mask, ref, ent0 = _batch(0)
    c = AlgoConfig(loss_agg=agg, clip_low=0.2, clip_high=0.28, tis_cap=1.5, icepop_low=0.5,
                   icepop_high=2.0, kl_coef=0.05, entropy_coef=0.01)

    def run(idx, **norm):
        logp = logp0[idx].clone().requires_grad_(True)
        ent = ent0[idx].clone().requires_grad_(True)
        loss, m = policy_loss(logp, prox[idx], behav[idx], adv[idx], mask[idx], seq[idx], c,
                              ref_logp=ref[idx], entropy=ent, **norm)
        loss.backward()
        return loss, logp.grad, ent.grad, m

    whole = torch.arange(len(seq))
    loss_w, g_w, ge_w, m = run(whole)
    assert 0 < m["clip_frac"] and 0 < m["tis_frac"] and 0 < m["icepop_frac"]  # all paths exercised

    # 2 ranks x 2 micro-batches, split by sequences
    chunks = [[0, 1], [2, 3], [4], [5, 6, 7]]
    idxs = [torch.cat([torch.nonzero(seq == s).flatten() for s in ch]) for ch in chunks]
    n_tok = sum(loss_normalisers(mask[i], seq[i])[0] for i in idxs)
    n_seq = sum(loss_normalisers(mask[i], seq[i])[1] for i in idxs)
    assert n_seq == 7
    total, g, ge = 0.0, torch.zeros_like(logp0), torch.zeros_like(ent0)
    for i in idxs:
        loss, gi, gei, _ = run(i, num_tokens_global=n_tok, num_seqs_global=n_seq)
        total += loss.item()
        g[i] += gi
        ge[i] += gei
    assert total == pytest.approx(loss_w.item(), rel=1e-10)
    assert torch.allclose(g, g_w, rtol=1e-10, atol=1e-14)
    assert torch.allclose(ge, ge_w, rtol=1e-10, atol=1e-14)


def test_on_policy_gradient_is_plain_policy_gradient():
    _, seq, logp0, _, _, adv, mask, _, _ = _batch(1)
    logp = logp0.clone().requires_grad_(True)
    loss, m = policy_loss(logp, logp, logp, adv, mask, seq, AlgoConfig())  # defaults: TIS+IcePop on
    loss.backward()
    N = int(mask.sum())
    assert torch.allclose(logp.grad, -adv * mask / N)
    assert m["clip_frac"] == 0 and m["tis_frac"] == 0 and m["icepop_frac"] == 0
    assert m["mismatch_k3"] == 0 and m["mismatch_max_ratio"] == 1


def test_k3_kl_term_and_entropy_bonus():
    logp = t([0.0, -1.0], grad=True)
    ref = logp.detach() + t([math.log(2.0), 0.0])
    ent = t([0.7, 0.3], grad=True)
    c = cfg(kl_coef=0.1, entropy_coef=0.01)
    loss, m = policy_loss(logp, logp, logp, t([0.0, 0.0]), torch.ones(2), torch.arange(2), c,
                          ref_logp=ref, entropy=ent)
    kl0 = 1 - math.log(2.0)  # exp(ln 2) - ln 2 - 1
    assert loss.item() == pytest.approx((0.1 * kl0 - 0.01 * 1.0) / 2)
    assert m["kl"] == pytest.approx(kl0 / 2)
    loss.backward()
    # d/dlogp k3(ref - logp) = 1 - exp(ref - logp)
    assert torch.allclose(logp.grad, t([0.1 * (1 - 2.0), 0.0]) / 2)
    assert torch.allclose(ent.grad, t([-0.01, -0.01]) / 2)


def test_k3_nonnegative_zero_iff_equal_and_mismatch_metrics():
    d = torch.linspace(-5, 5, 101, dtype=torch.float64)
    v = k3(d)
    assert (v >= 0).all() and (v[d != 0] > 0).all() and k3(torch.zeros(3)).abs().max() == 0
    p = t([0.0, -1.0, -2.0])
    mm = mismatch_metrics(p, p.clone(), torch.ones(3))
    assert mm["mismatch_k3"] == 0 and mm["mismatch_max_ratio"] == 1
    b = t([math.log(2.0), -1.0, -2.0])
    mm = mismatch_metrics(p, b, torch.tensor([1, 1, 0]))
    assert mm["mismatch_k3"] == pytest.approx((1 - math.log(2.0)) / 2)  # exp(b-p) - (b-p) - 1
    assert mm["mismatch_max_ratio"] == pytest.approx(1.0)
    assert mm["mismatch_min_ratio"] == pytest.approx(0.5)
    assert mm["num_tokens"] == 2
    assert mismatch_metrics(p, b, torch.zeros(3))["num_tokens"] == 0


def test_empty_mask_gives_zero_loss_with_graph():
    logp = t([-1.0, -2.0], grad=True)
    loss, m = policy_loss(logp, logp, logp, t([1.0, 1.0]), torch.zeros(2), torch.arange(2), AlgoConfig())
    loss.backward()
    assert loss.item() == 0 and (logp.grad == 0).all() and m["num_tokens"] == 0


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(t([0.0, 0.0]), t([0.0, 0.0]), t([0.0, 0.0]), t([1.0]), torch.ones(2), torch.arange(2), AlgoConfig())

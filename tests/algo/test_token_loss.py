"""TokenLoss (the policy loss as per-token terms, for the fused LM-head loss) against the plain
policy_loss, for every option it claims: the loss value and the gradients with respect to the
log-probs and the entropy, the terms evaluated slab by slab as the fused op does."""
import itertools

import pytest
import torch

from moe_rl.algo import policy_loss
from moe_rl.algo.token_loss import TokenLoss, fused_loss_unsupported
from moe_rl.config import AlgoConfig

T = 41
SLABS = [slice(0, 16), slice(16, 32), slice(32, T)]  # ragged, and cutting through sequences


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    # proximal / behaviour log-probs around logp: ratios on both sides of every clip and IcePop
    # bound, TIS caps hit
    prox = logp + 0.5 * torch.randn(T, generator=g, dtype=torch.float64)
    behav = prox + 0.6 * torch.randn(T, generator=g, dtype=torch.float64)
    adv = torch.randn(T, generator=g, dtype=torch.float64)
    mask = (torch.rand(T, generator=g) > 0.2).float()
    seq_ids = torch.repeat_interleave(torch.arange(6), torch.tensor([7, 9, 3, 11, 5, 6]))
    ref = logp + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
    ent = torch.rand(T, generator=g, dtype=torch.float64) * 2
    return logp, prox, behav, adv, mask, seq_ids, ref, ent


WEIGHTS = {
    "plain": dict(tis_cap=None, icepop_low=None, icepop_high=None),
    "tis_icepop": dict(tis_cap=1.5, icepop_low=0.5, icepop_high=2.0),
}
GRID = [c for c in itertools.product(["ppo", "cispo"], ["token", "sequence", "token_sum_norm"],
                                     ["self", "given", "behaviour"], sorted(WEIGHTS), ["token", "sequence"],
                                     [0.0, 0.3], [0.0, 0.05])
        if not (c[2] == "self" and c[4] == "sequence")]


@pytest.mark.parametrize("loss,agg,prox_kind,weights,tis_level,kl,ent_coef", GRID)
def test_token_loss_matches_policy_loss(loss, agg, prox_kind, weights, tis_level, kl, ent_coef):
    logp0, prox, behav, adv, mask, seq_ids, ref, ent0 = _inputs()
    cfg = AlgoConfig(policy_loss=loss, loss_agg=agg, ratio_anchor="behaviour" if prox_kind == "behaviour" else "proximal",
                     tis_level=tis_level, kl_coef=kl, entropy_coef=ent_coef, loss_norm_tokens=64, clip_low=0.2,
                     clip_high=0.28, **WEIGHTS[weights])
    assert fused_loss_unsupported(cfg) is None or (prox_kind == "given" and tis_level == "sequence")
    n_tok, n_seq = 57, 9  # the step's global counts (other micro-batches and ranks)

    logp, ent = logp0.clone().requires_grad_(), ent0.clone().requires_grad_()
    want, _ = policy_loss(logp, logp.detach() if prox_kind == "self" else prox, behav, adv, mask, seq_ids, cfg,
                          ref_logp=ref, entropy=ent, num_tokens_global=n_tok, num_seqs_global=n_seq)
    want.backward()

    tl = TokenLoss(cfg, behav, adv, mask, seq_ids, proximal_logp=None if prox_kind == "self" else prox,
                   ref_logp=ref, num_tokens_global=n_tok, num_seqs_global=n_seq)
    logp2, ent2 = logp0.clone().requires_grad_(), ent0.clone().requires_grad_()
    got = sum(tl(logp2[s], ent2[s], s).sum() for s in SLABS)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(logp2.grad, logp.grad, rtol=1e-12, atol=1e-14)
    zeros = torch.zeros(T, dtype=torch.float64)
    torch.testing.assert_close(zeros if ent2.grad is None else ent2.grad, zeros if ent.grad is None else ent.grad,
                               rtol=1e-12, atol=1e-14)
    assert logp.grad.abs().sum() > 0


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_local_normalisers_by_default(agg):
    # Without the global counts, the micro-batch's own (as policy_loss)
    logp0, prox, behav, adv, mask, seq_ids, ref, ent0 = _inputs(1)
    cfg = AlgoConfig(loss_agg=agg)
    logp = logp0.clone().requires_grad_()
    want, _ = policy_loss(logp, prox, behav, adv, mask, seq_ids, cfg)
    want.backward()
    logp2 = logp0.clone().requires_grad_()
    got = TokenLoss(cfg, behav, adv, mask, seq_ids, proximal_logp=prox)(logp2, None, slice(0, T)).sum()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(logp2.grad, logp.grad, rtol=1e-12, atol=1e-14)


def test_what_is_not_per_token_is_named():
    assert "algo.policy_loss=gspo" in fused_loss_unsupported(AlgoConfig(policy_loss="gspo"))
    assert "algo.tis_level=sequence" in fused_loss_unsupported(AlgoConfig(tis_level="sequence",
                                                                           ratio_anchor="proximal"))
    assert fused_loss_unsupported(AlgoConfig(tis_level="sequence", ratio_anchor="behaviour")) is None
    assert fused_loss_unsupported(AlgoConfig(policy_loss="cispo", loss_agg="sequence")) is None
    _, prox, behav, adv, mask, seq_ids, _, _ = _inputs()
    with pytest.raises(ValueError, match="gspo"):
        TokenLoss(AlgoConfig(policy_loss="gspo"), behav, adv, mask, seq_ids, proximal_logp=prox)
    with pytest.raises(ValueError, match="tis_level=sequence"):
        TokenLoss(AlgoConfig(tis_level="sequence"), behav, adv, mask, seq_ids)
    with pytest.raises(ValueError, match="advantages"):
        TokenLoss(AlgoConfig(), behav, adv[:-1], mask, seq_ids)

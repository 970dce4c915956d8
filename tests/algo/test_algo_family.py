"""GSPO, CISPO, Dr. GRPO, RLOO, token_sum_norm and DAPO overlong shaping against references
written a second time here in the plainest form: Python loops over sequences and tokens, one
scalar at a time (formulas from the GSPO, CISPO, Dr. GRPO, RLOO and DAPO papers; cross-read
against verl's core_algos and slime's ppo_utils, not copied)."""
import math

import pytest
import torch

from moe_rl.algo import compute_advantages, constant_groups, overlong_penalty, policy_loss
from moe_rl.config import AlgoConfig, ConfigError, load_config

PLAIN = dict(clip_low=0.2, clip_high=0.28, tis_cap=None, icepop_low=None, icepop_high=None)


def cfg(**kw):
    return AlgoConfig(**{**PLAIN, **kw})


# --- advantages ---------------------------------------------------------------------------
def ref_advantages(rewards, gids, kind, std_normalize=True):
    out = []
    for i, r in enumerate(rewards):
        mates = [rewards[j] for j in range(len(rewards)) if gids[j] == gids[i]]
        if len(mates) == 1 or all(m == mates[0] for m in mates):
            out.append(0.0)
            continue
        mean = sum(mates) / len(mates)
        if kind == "grpo":
            a = r - mean
            if std_normalize:
                a /= math.sqrt(sum((m - mean) ** 2 for m in mates) / len(mates)) + 1e-6
        elif kind == "drgrpo":
            a = r - mean
        else:  # rloo: minus the mean of the others
            a = r - (sum(mates) - r) / (len(mates) - 1)
        out.append(a)
    return out


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("std", [True, False])
def test_advantages_match_plain_reference_on_ragged_groups(kind, std):
    g = torch.Generator().manual_seed(0)
    # ragged: sizes 1, 2, 3, 5 and a constant group, ids unordered and interleaved
    gids = [7, 3, 3, 9, 9, 9, 2, 2, 2, 2, 2, 5, 5, 5]
    rewards = torch.rand(len(gids), generator=g, dtype=torch.float64)
    rewards[11:] = 0.37  # constant group
    got = compute_advantages(rewards, torch.tensor(gids), cfg(advantage=kind, std_normalize=std))
    want = ref_advantages(rewards.tolist(), gids, kind, std)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert got[0] == 0 and (got[11:] == 0).all()  # a group of one, a constant group: exact zeros
    if kind == "drgrpo":  # never divided by a std, whatever std_normalize says
        assert torch.allclose(got[1:3], rewards[1:3] - rewards[1:3].mean())


def test_rloo_is_n_over_n_minus_1_times_centred():
    r = torch.tensor([1.0, 0.0, 0.0, 0.5])
    got = compute_advantages(r, torch.zeros(4, dtype=torch.long), cfg(advantage="rloo"))
    assert torch.allclose(got, (r - r.mean()) * 4 / 3)


def test_constant_groups_are_found():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.2, 0.2, 0.5])
    ids = torch.tensor([4, 4, 1, 1, 8, 8, 6])
    assert constant_groups(r, ids).tolist() == [4, 6, 8]


def test_overlong_penalty_matches_dapo_formula():
    c = cfg(overlong_buffer=4, overlong_penalty=0.5)
    lengths = torch.tensor([0, 5, 12, 13, 14, 16, 20])
    got = overlong_penalty(lengths, 16, c)

    def ref(L, Lmax=16, b=4, p=0.5):
        if L <= Lmax - b:
            return 0.0
        return -(min(L, Lmax) - (Lmax - b)) / b * p

    assert got.tolist() == pytest.approx([ref(int(L)) for L in lengths])
    assert got[5] == -0.5 and got[2] == 0.0  # cut at L_max: full penalty; at the buffer's edge: none
    assert (overlong_penalty(lengths, 16, cfg()) == 0).all()  # buffer 0 = off


# --- policy losses ------------------------------------------------------------------------
def ref_loss(logp, prox, behav, adv, mask, seq, c, norm_tokens=None):
    """Scalar-at-a-time loss; logp is a list of 0-d tensors with grad."""
    lo, hi = 1 - c.clip_low, 1 + c.clip_high
    if c.ratio_anchor == "behaviour":  # coupled PPO: ratios against the sampler, no behaviour weight
        prox = behav
    seqs = sorted(set(seq))
    token_terms, per_seq = [], {}
    for s in seqs:
        toks = [t for t in range(len(seq)) if seq[t] == s and mask[t]]
        if c.policy_loss == "gspo" and toks:
            log_s = sum(float(logp[t].detach()) - prox[t] for t in toks) / len(toks)

        def dropped(t):  # IcePop
            w = math.exp(prox[t] - behav[t])
            return c.icepop_low is not None and (w < c.icepop_low or w > c.icepop_high)

        W = 1.0  # tis_level=sequence: the product of the sequence's kept tokens' weights
        for t in toks:
            if not dropped(t):
                W *= math.exp(prox[t] - behav[t])
        for t in toks:
            if dropped(t):
                continue
            w = W if c.tis_level == "sequence" else math.exp(prox[t] - behav[t])
            if c.tis_cap is not None:
                w = min(w, c.tis_cap)
            A = adv[t]
            if c.policy_loss == "cispo":
                u = math.exp(float(logp[t].detach()) - prox[t])
                l = -min(max(u, lo), hi) * A * logp[t]
            else:
                if c.policy_loss == "gspo":
                    r = math.exp(log_s) * torch.exp(logp[t] - float(logp[t].detach()))
                else:
                    r = torch.exp(logp[t] - prox[t])
                l = torch.maximum(-A * r, -A * torch.clamp(r, lo, hi))
            token_terms.append(w * l)
            per_seq.setdefault(s, []).append(w * l)
        if toks:
            per_seq.setdefault(s, [])
    zero = logp[0] * 0.0
    if c.loss_agg == "token":
        n = sum(1 for m in mask if m)
        return sum(token_terms, zero) / max(n, 1)
    if c.loss_agg == "token_sum_norm":
        return sum(token_terms, zero) / norm_tokens
    n_seq = len(per_seq)
    total = zero
    for s, terms in per_seq.items():
        n_tok = sum(1 for t in range(len(seq)) if seq[t] == s and mask[t])
        total = total + sum(terms, zero) / n_tok
    return total / max(n_seq, 1)


def batch(seed=0):
    """Four sequences of ragged lengths (one fully masked), mixed-sign advantages, ratios far
    enough from 1 that tokens (and whole GSPO sequences) clip on both sides."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 6, 2]
    seq = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])
    T = len(seq)
    prox = -torch.rand(T, generator=g, dtype=torch.float64) * 2 - 0.1
    shift = torch.tensor([0.4, -0.5, 0.05, 0.3], dtype=torch.float64)[seq]  # per-sequence drift
    logp = prox + shift + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
    behav = prox + 0.6 * torch.randn(T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.7, 0.5, 2.0], dtype=torch.float64)[seq]
    mask = torch.ones(T)
    mask[[1, 9]] = 0  # masked tokens inside sequences
    mask[seq == 3] = 0  # a sequence with no unmasked token
    logp[mask == 0] = 50.0  # garbage at masked tokens must not leak
    return logp, prox, behav, adv, mask, seq


CASES = [
    dict(policy_loss=p, loss_agg=a, **extra)
    for p in ("ppo", "gspo", "cispo")
    for a in ("token", "sequence", "token_sum_norm")
    for extra in ({}, dict(tis_cap=1.5, icepop_low=0.5, icepop_high=2.0),
                  dict(tis_level="sequence"), dict(tis_level="sequence", tis_cap=1.2, icepop_low=0.5, icepop_high=2.0))
] + [dict(policy_loss=p, loss_agg=a, ratio_anchor="behaviour", tis_cap=1.5, icepop_low=0.5, icepop_high=2.0)
     for p in ("ppo", "gspo", "cispo") for a in ("token", "sequence")]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_policy_loss_matches_plain_reference(kw):
    c = cfg(**kw, **({"loss_norm_tokens": 64} if kw["loss_agg"] == "token_sum_norm" else {}))
    logp, prox, behav, adv, mask, seq = batch()
    x = logp.clone().requires_grad_(True)
    loss, m = policy_loss(x, prox, behav, adv, mask, seq, c)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()

    xs = [logp[t].clone().requires_grad_(True) for t in range(len(seq))]
    ref = ref_loss(xs, prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist(), seq.tolist(), c, 64)
    ref.backward()
    ref_grad = torch.stack([v.grad if v.grad is not None else torch.zeros((), dtype=torch.float64) for v in xs])

    assert loss.item() == pytest.approx(ref.item(), rel=1e-9, abs=1e-12)
    assert torch.nn.functional.cosine_similarity(x.grad, ref_grad, dim=0) >= 0.999
    assert torch.allclose(x.grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert (x.grad[mask == 0] == 0).all()  # masked tokens: exactly zero
    assert 0 < m["clip_frac"] < 1  # the batch clips some tokens, not all
    if c.icepop_low is not None and c.ratio_anchor == "proximal":  # and the behaviour correction acts on some
        assert m["icepop_frac"] > 0 and m["tis_frac"] > 0


def test_gspo_ratio_is_one_value_per_sequence_with_token_gradients():
    # one sequence, two tokens; log-ratios 0.1 and 0.3 -> s = exp(0.2) for both tokens
    prox = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    x = (prox + torch.tensor([0.1, 0.3], dtype=torch.float64)).requires_grad_(True)
    c = cfg(policy_loss="gspo", loss_agg="sequence", clip_low=0.5, clip_high=0.5)
    loss, _ = policy_loss(x, prox, prox, torch.ones(2, dtype=torch.float64), torch.ones(2), torch.zeros(2), c)
    s = math.exp(0.2)
    assert loss.item() == pytest.approx(-s)
    loss.backward()
    assert torch.allclose(x.grad, torch.full((2,), -s / 2, dtype=torch.float64))
    # with GSPO's typical tiny clip range the whole sequence is clipped: no gradient anywhere
    x.grad = None
    c = cfg(policy_loss="gspo", loss_agg="sequence", clip_low=3e-4, clip_high=4e-4)
    loss, m = policy_loss(x, prox, prox, torch.ones(2, dtype=torch.float64), torch.ones(2), torch.zeros(2), c)
    loss.backward()
    assert (x.grad == 0).all() and m["clip_frac"] == 1.0 and m["clip_frac_seq"] == 1.0


def test_cispo_keeps_gradient_on_clipped_tokens():
    prox = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    x = (prox + torch.tensor([1.0, -1.0], dtype=torch.float64)).requires_grad_(True)  # ratios e, 1/e
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, m = policy_loss(x, prox, prox, adv, torch.ones(2), torch.arange(2), cfg(policy_loss="cispo"))
    loss.backward()
    # both tokens are outside [0.8, 1.28]: PPO would zero both gradients; CISPO weighs them
    assert torch.allclose(x.grad, torch.tensor([-1.28, 0.8], dtype=torch.float64) / 2)
    assert m["clip_frac"] == 1.0


def test_only_masked_tokens_gives_zero_loss_and_no_nan():
    for p in ("ppo", "gspo", "cispo"):
        for a in ("token", "sequence", "token_sum_norm"):
            x = torch.full((3,), 80.0, dtype=torch.float64, requires_grad=True)
            z = torch.zeros(3, dtype=torch.float64)
            c = cfg(policy_loss=p, loss_agg=a, loss_norm_tokens=10)
            loss, _ = policy_loss(x, z, z, torch.ones(3), torch.zeros(3), torch.tensor([0, 0, 1]), c)
            loss.backward()
            assert loss.item() == 0.0 and (x.grad == 0).all()


def test_token_sum_norm_needs_its_constant():
    z = torch.zeros(2)
    with pytest.raises(ValueError, match="algo.loss_norm_tokens"):
        policy_loss(z, z, z, z, torch.ones(2), torch.arange(2), cfg(loss_agg="token_sum_norm"))


# --- config -------------------------------------------------------------------------------
@pytest.mark.parametrize("override, expected", [
    ("algo.advantage=ppo", "algo.advantage: Input should be 'grpo', 'drgrpo' or 'rloo'"),
    ("algo.policy_loss=grpo", "algo.policy_loss: Input should be 'ppo', 'gspo' or 'cispo'"),
    ("algo.loss_agg=mean", "algo.loss_agg: Input should be 'token', 'sequence' or 'token_sum_norm'"),
    ("algo.loss_norm_tokens=0", "algo.loss_norm_tokens: Input should be greater than or equal to 1"),
    ("algo.overlong_buffer=-1", "algo.overlong_buffer: Input should be greater than or equal to 0"),
    ("algo.overlong_buffer=17", "algo.overlong_buffer=17 exceeds rollout.max_new_tokens=16"),
    ("algo.overlong_penalty=-0.5", "algo.overlong_penalty: Input should be greater than or equal to 0"),
    ("rollout.dynamic_sampling=maybe", "rollout.dynamic_sampling: Input should be a valid boolean"),
    ("rollout.max_sampling_rounds=0", "rollout.max_sampling_rounds: Input should be greater than or equal to 1"),
    ("algo.tis_level=seq", "algo.tis_level: Input should be 'token' or 'sequence'"),
    ("algo.ratio_anchor=engine", "algo.ratio_anchor: Input should be 'proximal' or 'behaviour'"),
    ("train.minibatches=0", "train.minibatches: Input should be greater than or equal to 1"),
    ("train.minibatches=33", "train.minibatches=33 exceeds the samples of a step"),
])
def test_bad_algo_values_name_their_key(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", [override])
    assert expected in str(e.value)


def test_every_choice_validates():
    for kv in ("algo.advantage=drgrpo", "algo.advantage=rloo", "algo.policy_loss=gspo", "algo.policy_loss=cispo",
               "algo.loss_agg=token_sum_norm", "algo.loss_norm_tokens=512", "rollout.dynamic_sampling=true",
               "rollout.max_sampling_rounds=5", "algo.overlong_buffer=4", "algo.overlong_penalty=0.5", "algo.tis_level=sequence"):
        load_config("configs/tiny.yaml", [kv])
    c = load_config("configs/tiny.yaml")
    assert c.rollout.max_sampling_rounds == 3 and not c.rollout.dynamic_sampling and c.algo.overlong_buffer == 0


def test_behaviour_anchor_clips_what_the_sampler_already_moved():
    """Coupled PPO at one update per batch (logp = prox): a stale token whose probability rose
    past 1 + clip_high since it was sampled gets no gradient for A > 0; the decoupled loss
    with the raw weight gives it w times the on-policy gradient; a token within the range
    gets the same gradient from both."""
    prox = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    behav = torch.tensor([-1.5, -1.05], dtype=torch.float64)  # w = e^0.5 = 1.65 (past 1.28), e^0.05
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    args = (behav, adv, torch.ones(2), torch.tensor([0, 1]))
    grads = {}
    for anchor in ("proximal", "behaviour"):
        x = prox.clone().requires_grad_(True)
        policy_loss(x, prox, *args, cfg(ratio_anchor=anchor, tis_cap=None, icepop_low=None, icepop_high=None))[0].backward()
        grads[anchor] = x.grad
    w = (prox - behav).exp()
    assert torch.allclose(grads["proximal"], -w / 2)  # token mean over 2 tokens
    assert grads["behaviour"][0] == 0 and torch.isclose(grads["behaviour"][1], -w[1] / 2)

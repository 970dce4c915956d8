"""Seeded sampling that does not depend on the batch (moe_rl.kernels.exact.seeded_sample): a
request's token is a function of its log-probs, seed and position only; the draws follow the
distribution; the CPU kernel's noise equals the torch (GPU) path's bit for bit."""
from __future__ import annotations

import pytest
import torch

import moe_rl.kernels.exact as E
from moe_rl.kernels.exact import sampling as S

from .exact_cases import threads


def _logp(R, V, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(R, V, generator=g) * scale, -1)


def test_a_request_draws_the_same_alone_or_batched():
    V = 64
    seed, steps = 1234, 40
    rows = _logp(steps, V, seed=1)
    for t in (1, 2, 3):
        with threads(t):
            for p in range(steps):
                alone = E.seeded_sample(rows[p:p + 1], torch.tensor([seed]), torch.tensor([p + 10]))
                others = _logp(20, V, seed=100 + p)
                batch = torch.cat([others[:7], rows[p:p + 1], others[7:]])
                seeds = torch.cat([torch.arange(7), torch.tensor([seed]), torch.arange(7, 20)])
                pos = torch.cat([torch.randint(0, 99, (7,)), torch.tensor([p + 10]), torch.randint(0, 99, (13,))])
                assert E.seeded_sample(batch, seeds, pos)[7] == alone[0], (t, p)
    # the same comparison for one generator drawing for the whole batch: the request's tokens
    # change with its batch-mates
    def multinomial(lp, seed=0):
        return torch.multinomial(lp.exp(), 1, generator=torch.Generator().manual_seed(seed))[:, 0]
    moved = sum(multinomial(rows[p:p + 1])[0] != multinomial(torch.cat([_logp(7, V, seed=p), rows[p:p + 1]]))[7]
                for p in range(steps))
    assert moved > 0


def test_cpu_noise_equals_the_torch_path_and_samples_agree():
    seeds = torch.tensor([0, 1, 2 ** 40 + 7, 2 ** 62, 99])
    pos = torch.tensor([0, 5, 3, 2 ** 33, 123456])
    u_cpu = E.gumbel_uniform(seeds, pos, 1000)
    u_torch = S._uniform_torch(seeds, pos, 1000)
    assert torch.equal(u_cpu, u_torch)
    assert (u_cpu > 0).all() and (u_cpu < 1).all()
    # the GPU path's arithmetic, run on CPU tensors: the same tokens (the logs may differ in an
    # ulp between libm and torch, which moves no argmax here)
    lp = _logp(300, 200, seed=3)
    sd, ps = torch.arange(300) * 7919, torch.arange(300) + 11
    g = -torch.log(-torch.log(S._uniform_torch(sd, ps, 200)))
    assert torch.equal(E.seeded_sample(lp, sd, ps), (lp + g).argmax(-1))


def test_draws_follow_the_distribution():
    """30000 draws (one seed, consecutive positions) of a 6-token distribution: each token's
    count within 4.5 standard deviations of its expectation; and the counts differ from those
    of a planted biased sampler by far more."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    n = 30000
    lp = probs.log().expand(n, -1).contiguous()
    toks = E.seeded_sample(lp, torch.full((n,), 42), torch.arange(n))
    counts = torch.bincount(toks, minlength=6).double()
    expect, sd = n * probs.double(), (n * probs.double() * (1 - probs.double())).sqrt()
    assert ((counts - expect).abs() <= 4.5 * sd).all(), counts
    biased = E.seeded_sample((probs * torch.tensor([1.2, 1, 1, 1, 1, 1])).log().expand(n, -1).contiguous(),
                             torch.full((n,), 42), torch.arange(n))
    assert ((torch.bincount(biased, minlength=6).double() - expect).abs() > 4.5 * sd).any()


def test_excluded_tokens_seeds_and_positions():
    V = 50
    lp = _logp(200, V, seed=4)
    keep = torch.rand(200, V, generator=torch.Generator().manual_seed(5)) < 0.3
    keep[:, 0] = True
    masked = lp.masked_fill(~keep, float("-inf"))
    toks = E.seeded_sample(masked, torch.arange(200), torch.arange(200))
    assert keep.gather(1, toks[:, None]).all()
    assert E.seeded_sample(torch.full((1, V), float("-inf")), torch.tensor([3]), torch.tensor([4])).item() == 0
    same = lp[:1].expand(200, -1).contiguous()
    by_pos = E.seeded_sample(same, torch.full((200,), 9), torch.arange(200))
    by_seed = E.seeded_sample(same, torch.arange(200), torch.full((200,), 9))
    assert by_pos.unique().numel() > 10 and by_seed.unique().numel() > 10
    again = E.seeded_sample(same, torch.arange(200), torch.full((200,), 9))
    assert torch.equal(by_seed, again)


def test_bad_input():
    lp = _logp(2, 8, seed=1)
    with pytest.raises(ValueError, match="seeds must be int64"):
        E.seeded_sample(lp, torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="float32"):
        E.seeded_sample(lp.double(), torch.tensor([1, 2]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="positions must be int64 \\[2\\]"):
        E.seeded_sample(lp, torch.tensor([1, 2]), torch.tensor([0]))

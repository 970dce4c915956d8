"""The engine's sampler draws tokens with the probabilities softmax(logits / T) says."""
import types

import torch

from moe_rl.engine.engine import Engine
from moe_rl.engine.protocol import SamplingParams
from moe_rl.engine.sampling import Uniforms


def _reqs(n, seed0=0, **sp):
    params = SamplingParams.parse({"temperature": 1.0, **sp})
    return [types.SimpleNamespace(params=params, uniforms=Uniforms(torch.Generator().manual_seed(seed0 + i))) for i in range(n)]


def test_batched_sampling_matches_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    logits = probs.clamp_min(1e-30).log().expand(4000, -1).contiguous()
    logits[:, [1, 5]] = -float("inf")
    logp = torch.log_softmax(logits, dim=-1)
    tokens = Engine._sample_batch(_reqs(4000), logits, logp)
    freq = torch.bincount(tokens, minlength=6).float() / 4000
    assert freq[1] == 0 and freq[5] == 0  # zero-probability tokens are never drawn
    # 4000 draws: binomial std <= 0.008; 4 sigma
    assert (freq - probs).abs().max() < 0.032, freq


def test_a_requests_tokens_depend_on_its_seed_not_its_batch():
    logits = torch.randn(3, 50)
    logp = torch.log_softmax(logits, dim=-1)
    alone = Engine._sample_batch(_reqs(1, seed0=7), logits[1:2], logp[1:2])
    batched = Engine._sample_batch(_reqs(3, seed0=6), logits, logp)
    assert batched[1] == alone[0]


def test_top_k_and_greedy_rows_mixed_with_plain_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0], [9.0, 0.0, 0.0]])
    logp = torch.log_softmax(logits, dim=-1)
    reqs = _reqs(1, top_k=1) + _reqs(1, seed0=3) + [types.SimpleNamespace(
        params=SamplingParams.parse({"temperature": 0.0}), uniforms=Uniforms(torch.Generator()))]
    tokens = Engine._sample_batch(reqs, logits, logp)
    assert tokens[0] == 1 and tokens[2] == 0 and 0 <= tokens[1] < 3


def test_a_requests_uniforms_are_its_generators_scalar_draws_in_order():
    """Drawn a block at a time (here blocks of 5, 64 and 1), the uniforms are the floats one
    ``torch.rand(())`` per token would give: a seed samples the same tokens as before."""
    for block in (5, 64, 1):
        g = torch.Generator().manual_seed(11)
        want = [torch.rand((), generator=g).item() for _ in range(130)]
        u = Uniforms(torch.Generator().manual_seed(11), block)
        assert [u.next() for _ in range(130)] == want

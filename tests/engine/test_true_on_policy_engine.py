"""true_on_policy in the embedded engine: a request's tokens, log-probs and routing are the same
bits alone or batched among many others of other lengths (joining before, with and after it),
a decode step's log-prob equals the one a full forward of the sequence gives (the engine's own
prefill and the model's forward), and the seeded sampler draws a token from its request's seed
and its position only. Each comparison is also made without the key, where it differs."""
import pytest
import torch

from moe_rl.config import load_config
from moe_rl.engine import decode_routed_experts
from moe_rl.engine.server import build_engine
from moe_rl.kernels import exact as exact_kernels
from moe_rl.model.ops import EXACT, TORCH, tempered

from tests.engine.helpers import CONFIG, OVERRIDES, K, L, _submit, generate, wait_for

PROMPT = [5, 17, 3, 60, 22, 9, 41]
NEW = 36  # > 30 decode steps
TEMP = 0.8


def _engine(exact: bool, *extra):
    cfg = load_config(CONFIG, [*OVERRIDES, "engine.max_running_requests=24", "model.init_std=0.2",
                               f"true_on_policy={str(exact).lower()}", *extra])
    return build_engine(cfg).start()


def _body(prompt, seed, new, temperature=TEMP, **kw):
    return {"input_ids": list(prompt), "return_logprob": True, "return_routed_experts": True, **kw,
            "sampling_params": {"temperature": temperature, "max_new_tokens": new, "sampling_seed": seed,
                                "ignore_eos": True}}


def _others(n, seed0):
    g = torch.Generator().manual_seed(seed0)
    out = []
    for i in range(n):
        length = 2 + (7 * i + 3) % 41  # 2 .. 42 tokens, none of the target's 7
        out.append(_body(torch.randint(0, 64, (length,), generator=g).tolist(), seed0 + i, 4 + (11 * i) % 45,
                         temperature=[0.0, 0.7, 1.0, 1.3][i % 4]))
    return out


def _view(out):
    """(tokens, output log-probs, input log-probs, routing rows) as tensors, for torch.equal."""
    meta = out["meta_info"]
    return (torch.tensor(out["output_ids"]),
            torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]], dtype=torch.float64),
            torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"] if lp is not None], dtype=torch.float64),
            torch.tensor(decode_routed_experts(out, L, K)))


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(_view(a), _view(b)))


def _alone_and_batched(exact: bool, *extra):
    target = _body(PROMPT, 123, NEW, logprob_start_len=0)
    engine = _engine(exact, *extra)
    try:
        alone = generate(engine, [target])[0]
        # 8 requests running first, the target joins their decode, 10 more join the target's
        before, after = _others(8, 100), _others(10, 200)
        base = engine.stats["output_tokens"]
        wait_first = _submit(engine, before)
        assert wait_for(lambda: engine.stats["output_tokens"] >= base + 16)
        wait_target = _submit(engine, [target])
        assert wait_for(lambda: engine.stats["output_tokens"] >= base + 40)
        wait_after = _submit(engine, after)
        batched = wait_target(120)[0]
        wait_first(120), wait_after(120)
    finally:
        engine.stop()
    return alone, batched, dict(engine.stats)


@pytest.mark.parametrize("extra", [(), ("engine.static_decode=true",)], ids=["eager", "static_decode"])
def test_alone_equals_batched_among_others(extra):
    alone, batched, stats = _alone_and_batched(True, *extra)
    assert len(alone["output_ids"]) == NEW and batched["meta_info"]["completion_tokens"] == NEW
    assert _same(alone, batched)
    assert (stats.get("decode_static_steps", 0) > 0) == bool(extra)  # the padded static decode step was taken


def test_without_the_key_alone_and_batched_differ():
    alone, batched, _ = _alone_and_batched(False)
    a, b = _view(alone), _view(batched)
    assert not torch.equal(a[1], b[1])  # torch's kernels: the batch changes a row's log-probs' bits
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-4)  # by ulps, not more


def _decode_vs_prefill(exact: bool):
    """(decode-step log-probs of NEW sampled tokens, the engine's own prefill log-probs of those
    tokens, the model's full forward's), all at temperature 1."""
    engine = _engine(exact)
    try:
        out = generate(engine, [_body(PROMPT, 7, NEW, temperature=1.0)])[0]
        seq = PROMPT + out["output_ids"]
        again = generate(engine, [_body(seq, 7, 1, temperature=1.0, logprob_start_len=0)])[0]
        model = engine.model
        ops = EXACT if exact else TORCH
        with torch.no_grad():
            logits = model(torch.tensor([seq]))[0]
            logp = ops.log_softmax(tempered(logits, 1.0))
        forward = logp[len(PROMPT) - 1 : -1].gather(1, torch.tensor(out["output_ids"])[:, None]).squeeze(1)
    finally:
        engine.stop()
    decode = _view(out)[1]
    prefill = _view(again)[2][len(PROMPT) - 1 :]  # input log-prob of token p sits at p - 1 (token 0 has none)
    return decode, prefill, forward.double()


def test_decode_equals_prefill_and_the_forward():
    decode, prefill, forward = _decode_vs_prefill(True)
    assert decode.numel() == NEW == prefill.numel()
    assert torch.equal(decode, prefill)
    assert torch.equal(decode, forward)


def test_without_the_key_decode_and_prefill_differ():
    decode, prefill, forward = _decode_vs_prefill(False)
    assert not (torch.equal(decode, prefill) and torch.equal(decode, forward))
    torch.testing.assert_close(decode, prefill, rtol=0, atol=1e-4)


def _continued(exact: bool, cut: int = 12):
    """A request, and the same request (same seed) restarted from its prompt plus its first
    ``cut`` tokens: (the first's tokens after ``cut``, the continuation's)."""
    engine = _engine(exact)
    try:
        full = generate(engine, [_body(PROMPT, 99, NEW, temperature=1.0)])[0]["output_ids"]
        rest = generate(engine, [_body(PROMPT + full[:cut], 99, NEW - cut, temperature=1.0)])[0]["output_ids"]
    finally:
        engine.stop()
    return torch.tensor(full[cut:]), torch.tensor(rest)


def test_seeded_sample_is_keyed_by_position_so_a_restart_continues_alike():
    """The exact sampler's token is a function of (log-probs, seed, position): a request that is
    restarted from its own prefix (a partial rollout resumed, a retraction) draws the same
    tokens; torch's per-request generator starts its stream again and draws others."""
    a, b = _continued(True)
    assert torch.equal(a, b)
    a, b = _continued(False)
    assert not torch.equal(a, b)


def test_seeded_sample_alone_equals_batched_rows():
    """The engine's exact sampler on one row alone and among 15 others (other seeds, positions,
    temperatures, top-k / top-p rows), through ``sample_seeded``."""
    from moe_rl.engine.protocol import SamplingParams
    from moe_rl.engine.sampling import sample_seeded

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 64, generator=g) * 3
    params = [SamplingParams.parse({"temperature": 1.0, **({"top_k": 8} if i % 3 == 0 else {}),
                                    **({"top_p": 0.8} if i % 5 == 1 else {})}) for i in range(16)]
    logp = exact_kernels.log_softmax(logits)
    seeds, pos = list(range(40, 56)), [3 + 2 * i for i in range(16)]
    batched = sample_seeded(params, seeds, pos, logits, logp)
    for i in range(16):
        alone = sample_seeded(params[i : i + 1], seeds[i : i + 1], pos[i : i + 1], logits[i : i + 1], logp[i : i + 1])
        assert torch.equal(alone, batched[i : i + 1]), i
        if params[i].top_k > 0:  # the truncation holds: a drawn token is among the row's 8 best
            assert batched[i] in logits[i].topk(8).indices

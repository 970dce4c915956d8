"""SGLang's penalties and min_p in the embedded engine: the processed logits against SGLang's
own penaltylib, and the engine's tokens and returned log-probs against a plain-torch
recomputation (full forward, penalties applied token by token)."""
import types

import pytest
import torch

from moe_rl.engine import output_logprobs
from moe_rl.engine.engine import Engine, apply_penalties
from moe_rl.engine.protocol import GenerateRequest, RequestError, SamplingParams
from moe_rl.engine.sampling import Uniforms
from moe_rl.engine.server import build_engine, build_model

from .helpers import ARCH, CFG, generate

V = ARCH.vocab_size
EOS = 5


def _parse(sp, eos=frozenset({EOS})):
    return GenerateRequest.parse({"input_ids": [1, 2], "sampling_params": sp}, vocab_size=V,
                                 max_context=64, eos_token_ids=eos).sampling_params


def reference_process(row: torch.Tensor, sp: dict, out: list[int], stop: set[int]) -> torch.Tensor:
    """Plain torch, one token at a time: what SGLang's documentation says each parameter does."""
    x = row.clone()
    for tok in set(out):
        x[tok] -= sp.get("frequency_penalty", 0.0) * out.count(tok) + sp.get("presence_penalty", 0.0)
    if len(out) < sp.get("min_new_tokens", 0):
        for tok in stop:
            x[tok] = -float("inf")
    rep = sp.get("repetition_penalty", 1.0)
    for tok in set(out):
        x[tok] = x[tok] * rep if x[tok] < 0 else x[tok] / rep
    return x


# --- against SGLang's penaltylib ------------------------------------------------------------
class _Batch:  # what BatchedPenalizerOrchestrator reads of a ScheduleBatch (weak-referenced)
    def __init__(self, reqs):
        self.reqs, self.device = reqs, "cpu"


def test_processed_logits_match_sglang_penaltylib():
    from tests.sglang.conftest import require_sglang

    require_sglang("sglang.srt.sampling.penaltylib")  # skipped only where the sglang wheel is absent
    import torch._dynamo
    from sglang.srt.sampling import penaltylib as pl
    from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

    rows = [
        {"frequency_penalty": 0.7},
        {"presence_penalty": -1.3},
        {"repetition_penalty": 1.8},
        {"repetition_penalty": 0.6, "frequency_penalty": -0.4, "presence_penalty": 0.9},
        {"min_new_tokens": 3, "stop_token_ids": [7, 9]},
        {"min_new_tokens": 2, "ignore_eos": True},  # SGLang masks the model's EOS even so
        {},  # a neutral row in the same batch
    ]
    ours = [_parse(dict(sp)) for sp in rows]
    sg_reqs = [types.SimpleNamespace(
        sampling_params=types.SimpleNamespace(
            frequency_penalty=sp.get("frequency_penalty", 0.0), presence_penalty=sp.get("presence_penalty", 0.0),
            repetition_penalty=sp.get("repetition_penalty", 1.0), min_new_tokens=sp.get("min_new_tokens", 0),
            stop_token_ids=set(sp.get("stop_token_ids", []))),
        eos_token_ids={EOS}, tokenizer=types.SimpleNamespace(additional_stop_token_ids=None, eos_token_id=None))
        for sp in rows]
    batch = _Batch(sg_reqs)
    orch = pl.BatchedPenalizerOrchestrator(V, batch, {pl.BatchedFrequencyPenalizer, pl.BatchedMinNewTokensPenalizer,
                                                      pl.BatchedPresencePenalizer, pl.BatchedRepetitionPenalizer})
    g = torch.Generator().manual_seed(0)
    outputs = [[] for _ in rows]
    was = torch._dynamo.config.disable
    torch._dynamo.config.disable = True  # apply_scaling_penalties is torch.compile'd for the GPU
    try:
        for step in range(6):
            logits = torch.randn(len(rows), V, generator=g) * 3
            # SGLang's SamplingBatchInfo (overlap scheduler): additive penalties summed, then scaling
            additive = torch.zeros(len(rows), V)
            orch.accumulate_additive_penalties(additive)
            expected = logits + additive
            scaling = orch.accumulate_scaling_penalties()
            if scaling is not None:
                apply_scaling_penalties(expected, scaling)
            got = logits.clone()
            apply_penalties(got, ours, outputs)
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
            assert torch.isinf(got).sum() == torch.isinf(expected).sum()
            # a few tokens repeat, stop tokens and EOS among them
            nxt = torch.tensor([[3, 7, EOS, 3, 9, 3][step]] * len(rows)) + torch.arange(len(rows)) % 2
            orch.cumulate_output_tokens(nxt)
            for o, t in zip(outputs, nxt.tolist()):
                o.append(t)
    finally:
        torch._dynamo.config.disable = was


# --- validation (SGLang's SamplingParams.verify ranges) --------------------------------------
def test_ranges_are_sglangs():
    for sp, field in [({"min_p": 1.5}, "min_p"), ({"frequency_penalty": 2.5}, "frequency_penalty"),
                      ({"presence_penalty": -3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                      ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens")]:
        with pytest.raises(RequestError, match="sampling_params." + field):
            SamplingParams.parse(sp)
    sp = _parse({"min_new_tokens": 2, "stop_token_ids": [3], "ignore_eos": True})
    assert sp.stop_token_ids == {3} and sp.min_new_tokens_ids == {3, EOS} and sp.penalized


# --- the sampler --------------------------------------------------------------------------
def _reqs(sp, n, seed0=0):
    params = SamplingParams.parse(sp)
    return [types.SimpleNamespace(params=params, uniforms=Uniforms(torch.Generator().manual_seed(seed0 + i))) for i in range(n)]


def test_min_p_draws_from_the_kept_tokens_in_proportion():
    probs = torch.tensor([0.45, 0.3, 0.15, 0.06, 0.04])  # min_p 0.2: keep p >= 0.09
    n = 3000
    logits = probs.log().expand(n, -1).contiguous()
    logp = torch.log_softmax(logits, dim=-1)
    tokens = Engine._sample_batch(_reqs({"temperature": 1.0, "min_p": 0.2}, n), logits, logp)
    freq = torch.bincount(tokens, minlength=5).float() / n
    want = torch.tensor([0.45, 0.3, 0.15, 0.0, 0.0]) / 0.9
    assert freq[3] == 0 and freq[4] == 0
    assert (freq - want).abs().max() < 0.04, freq  # 4 sigma of 3000 draws


def test_penalized_rows_sample_the_processed_distribution():
    sp = {"temperature": 0.7, "frequency_penalty": 0.8, "presence_penalty": 0.3, "repetition_penalty": 1.5}
    base = torch.tensor([2.0, 1.5, -0.5, 0.0, 1.0])
    out = [0, 0, 2]
    n = 3000
    reqs = _reqs(sp, n)
    logits = base.expand(n, -1).contiguous()
    apply_penalties(logits, [r.params for r in reqs], [out] * n)
    logp = torch.log_softmax(logits / 0.7, dim=-1)
    tokens = Engine._sample_batch(reqs, logits, logp)
    want = torch.softmax(reference_process(base, sp, out, set()) / 0.7, dim=-1)
    freq = torch.bincount(tokens, minlength=5).float() / n
    assert (freq - want).abs().max() < 0.04, (freq, want)


# --- the engine end to end ----------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    e = build_engine(CFG, model=build_model(CFG)).start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def model():
    return build_model(CFG).eval()


def _generate(engine, bodies):
    return generate(engine, [{"return_logprob": True, **body} for body in bodies])


def _check(model, prompt, sp, out):
    """Each output token and its log-prob from a fresh forward of prompt + output[:j]."""
    ids = out["output_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids]))[0].float()
    t = sp.get("temperature", 1.0)
    got = output_logprobs(out["meta_info"])
    stop = set(sp.get("stop_token_ids", []))
    for j, tok in enumerate(ids):
        x = reference_process(logits[len(prompt) - 1 + j], sp, ids[:j], stop)
        lp = torch.log_softmax(x / (t if t > 0 else 1.0), dim=-1)
        if t == 0:
            assert tok == int(x.argmax()), (j, sp)
        else:
            assert lp[tok] > -float("inf")
            if sp.get("min_p"):
                assert lp[tok].exp() >= sp["min_p"] * lp.exp().max()
        assert abs(got[j] - float(lp[tok])) < 1e-4, (j, sp, got[j], float(lp[tok]))


def test_engine_tokens_and_logprobs_follow_the_processed_logits(engine, model):
    prompt = [3, 14, 15, 9, 2, 6]
    plain = _generate(engine, [{"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 12}}])[0]
    first = plain["output_ids"][0]
    cases = [
        {"temperature": 0, "repetition_penalty": 1.9},
        {"temperature": 0, "frequency_penalty": 1.5},
        {"temperature": 0, "presence_penalty": 2.0},
        # the greedy first token is a stop token: without min_new_tokens the answer is 1 token
        {"temperature": 0, "min_new_tokens": 4, "stop_token_ids": [first]},
        {"temperature": 0.8, "min_p": 0.3, "sampling_seed": 1},
        {"temperature": 0.8, "repetition_penalty": 0.5, "frequency_penalty": -1.0, "min_p": 0.05, "sampling_seed": 2},
        {"temperature": 1.0, "sampling_seed": 3},  # a plain row batched with the others
    ]
    outs = _generate(engine, [{"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, **sp}} for sp in cases])
    for sp, out in zip(cases, outs):
        _check(model, prompt, sp, out)
    assert outs[0]["output_ids"] != plain["output_ids"]  # the penalty changed the greedy answer
    stopped = outs[3]
    assert len(stopped["output_ids"]) >= 4 and first not in stopped["output_ids"][:4]

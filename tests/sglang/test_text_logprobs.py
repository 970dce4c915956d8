"""``moe-rl serve``'s "text", input log-probs and top log-probs against SGLang's own code.

The values come from an independent reference (the plain model's log-softmax over one full
forward, computed here); the layout (keys, [logprob, token id, text] tuples, the None of the
first input token, the dropped last row, texts) comes from SGLang 0.5.23's own functions,
compiled from the installed source because their modules do not import on CPU (see
``conftest.sglang_methods``): the scheduler's ``SchedulerLogprobResultProcessor``
(``_process_input_token_logprobs``, ``_process_input_top_logprobs``), the tokenizer manager's
``add_logprob_to_meta_info`` and the detokenizer's ``_decode_batch_token_id_output``."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
import torch

from .conftest import require_sglang

require_sglang("sglang.utils")

from moe_rl.engine import EngineClient  # noqa: E402
from moe_rl.engine.server import build_model  # noqa: E402
from tests.engine.helpers import ARCH, CFG, ServerProc  # noqa: E402

from .conftest import EOS_ID, SPECIAL, sglang_methods, sglang_text  # noqa: E402

V = ARCH.vocab_size


# --- SGLang's own response-building code ---------------------------------------------------------
def _sglang_logprob_code():
    tm = sglang_methods("srt/managers/tokenizer_manager.py", "TokenizerManager",
                        ("detokenize_logprob_tokens", "detokenize_top_logprobs_tokens", "add_logprob_to_meta_info"),
                        logger=logging.getLogger("sglang-ref"))
    sched = sglang_methods("srt/managers/scheduler_components/logprob_result_processor.py",
                           "SchedulerLogprobResultProcessor",
                           ("_process_input_token_logprobs", "_process_input_top_logprobs"), MIS_DELIMITER_TOKEN_ID=-1)
    TM = type("TokenizerManagerRef", (), tm)
    Sched = type("SchedulerRef", (), {**sched, "_uses_scoring_positions": lambda self, req: False,
                                      "_scoring_positions": lambda self, req: None})
    return TM, Sched


def sglang_meta(prompt, output, *, temperature, start, top_n, tokenizer, model, return_text):
    """meta_info's log-prob keys as SGLang builds them, from the plain model's log-softmax:
    the logits processor's raw values for positions [start, len) (target: the next input
    token, 0 for the last: it is the sampled token's row and SGLang drops it), then SGLang's
    scheduler and tokenizer-manager code."""
    TM, Sched = _sglang_logprob_code()
    seq = list(prompt) + list(output)
    with torch.no_grad():
        logits = model(torch.tensor([seq]))[0].float()
    in_lp = torch.log_softmax(logits, dim=-1)  # SGLang's input log-probs: temperature 1
    out_lp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    P = len(prompt)
    req = SimpleNamespace(origin_input_ids=list(prompt), logprob_start_len=start,
                          logprob=SimpleNamespace(top_logprobs_num=top_n))
    if start < P:
        targets = list(prompt[start + 1 :]) + [0]
        raw = [in_lp[p, t].item() for p, t in zip(range(start, P), targets)]
        top = in_lp[start:P].topk(max(top_n, 1), dim=-1)
        req.temp_input_top_logprobs_val = [top.values[:, :top_n].tolist()]
        req.temp_input_top_logprobs_idx = [top.indices[:, :top_n].tolist()]
        sched = Sched()
        sched.model_config = SimpleNamespace(vocab_size=V)
        sched._process_input_token_logprobs(req, raw)
        sched._process_input_top_logprobs(req)
        lg = req.logprob
    else:  # no input log-prob rows: SGLang's _initialize_empty_logprob_containers
        lg = SimpleNamespace(input_token_logprobs_val=[], input_token_logprobs_idx=[], input_top_logprobs_val=[],
                             input_top_logprobs_idx=[])
    rows = range(P - 1, P - 1 + len(output))
    otop = out_lp[P - 1 : P - 1 + len(output)].topk(max(top_n, 1), dim=-1)
    state = SimpleNamespace(
        input_token_logprobs_val=lg.input_token_logprobs_val, input_token_logprobs_idx=lg.input_token_logprobs_idx,
        output_token_logprobs_val=[out_lp[p, t].item() for p, t in zip(rows, output)],
        output_token_logprobs_idx=list(output),
        input_top_logprobs_val=getattr(lg, "input_top_logprobs_val", None) or [],
        input_top_logprobs_idx=getattr(lg, "input_top_logprobs_idx", None) or [],
        output_top_logprobs_val=otop.values[:, :top_n].tolist(), output_top_logprobs_idx=otop.indices[:, :top_n].tolist(),
        input_token_logprobs=[], output_token_logprobs=[], input_top_logprobs=[], output_top_logprobs=[],
        obj=SimpleNamespace(return_flat_raw_top_logprobs=False, return_flat_raw_output_top_logprobs=False),
        input_top_logprobs_scheduler_flat=None)
    tm = TM()
    tm.tokenizer = tokenizer
    meta: dict = {}
    tm.add_logprob_to_meta_info(meta, state, top_n, None, return_text and tokenizer is not None, finished=True)
    return meta


def assert_same(got, want, where="meta_info"):
    """Same structure (None where SGLang has None, same ids and texts), log-probs within 1e-5."""
    if want is None or isinstance(want, (str, bool)):
        assert got == want, f"{where}: {got!r} != {want!r}"
    elif isinstance(want, float):
        assert isinstance(got, float) and abs(got - want) <= 1e-5, f"{where}: {got} != {want}"
    elif isinstance(want, int):
        assert got == want and not isinstance(got, bool), f"{where}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        assert set(want) <= set(got), f"{where}: missing {sorted(set(want) - set(got))}"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    else:
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} vs {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")


@pytest.fixture(scope="module")
def model():
    return build_model(CFG)


@pytest.fixture(scope="module")
def server():
    s = ServerProc()
    yield s
    s.stop()


def _post(url, body):
    async def run():
        async with EngineClient(url, timeout_s=60) as c:
            return await c.request("POST", "/generate", payload=body)
    return asyncio.run(run())


PROMPT = [8, 9, 10, 11, 12, 13, 14]


@pytest.mark.parametrize("start,top_n", [(-1, 0), (0, 3), (2, 2), (len(PROMPT) - 1, 1), (len(PROMPT), 2)])
def test_input_and_top_logprobs_match_sglang_and_the_native_model(server, model, start, top_n):
    """No tokenizer (SGLang with --skip-tokenizer-init): texts are None even when asked for."""
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0.8, "max_new_tokens": 5, "sampling_seed": 3},
            "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": top_n,
            "return_text_in_logprobs": True}
    out = _post(server.url, body)
    want = sglang_meta(PROMPT, out["output_ids"], temperature=0.8, start=len(PROMPT) if start == -1 else start,
                       top_n=top_n, tokenizer=None, model=model, return_text=True)
    got = out["meta_info"]
    assert_same(got, want)
    assert ("input_top_logprobs" in got) == (top_n > 0) and "text" not in out
    assert list(want)[:3] == ["input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"]


def test_batch_form_takes_per_prompt_logprob_fields(server, model):
    prompts = [PROMPT, [20, 21, 22, 23]]
    body = {"input_ids": prompts, "sampling_params": {"temperature": 1.0, "max_new_tokens": 3},
            "return_logprob": True, "logprob_start_len": [0, 1], "top_logprobs_num": [2, 0]}
    outs = _post(server.url, body)
    for p, s, k, out in zip(prompts, [0, 1], [2, 0], outs):
        assert_same(out["meta_info"], sglang_meta(p, out["output_ids"], temperature=1.0, start=s, top_n=k,
                                                  tokenizer=None, model=model, return_text=False))
    # return_logprob is per prompt too; routed_experts_start_len is one value for all in SGLang
    outs = _post(server.url, {**body, "return_logprob": [True, False], "logprob_start_len": 0, "top_logprobs_num": 0})
    assert "input_token_logprobs" in outs[0]["meta_info"] and "output_token_logprobs" not in outs[1]["meta_info"]
    with pytest.raises(Exception, match="routed_experts_start_len"):
        _post(server.url, {**body, "routed_experts_start_len": [0, 1]})


def test_the_logprob_check_catches_a_wrong_layout(model):
    """The reference is strict: an input log-prob list without SGLang's leading None fails."""
    want = sglang_meta(PROMPT, [5], temperature=1.0, start=0, top_n=0, tokenizer=None, model=model, return_text=False)
    bad = {**want, "input_token_logprobs": want["input_token_logprobs"][1:] + [[0.0, 1, None]]}
    with pytest.raises(AssertionError):
        assert_same(bad, want)


def test_logprob_start_len_beyond_the_prompt_is_a_400(server):
    with pytest.raises(Exception, match="logprob_start_len"):
        _post(server.url, {"input_ids": [3, 4], "return_logprob": True, "logprob_start_len": 3})


# --- "text" ----------------------------------------------------------------------------------
def test_text_is_sglangs_detokenized_output(tok_server, tokenizer):
    base = {"input_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}}
    first = _post(tok_server.url, base)
    assert list(first)[:1] == ["text"]
    assert first["text"] == sglang_text(tokenizer, PROMPT, first["output_ids"], first["meta_info"]["finish_reason"])
    # a matched stop token is trimmed from the text unless no_stop_trim
    stop = first["output_ids"][3]
    for nst in (False, True):
        sp = {**base["sampling_params"], "stop_token_ids": [stop], "no_stop_trim": nst}
        out = _post(tok_server.url, {**base, "sampling_params": sp})
        reason = out["meta_info"]["finish_reason"]
        assert reason == {"type": "stop", "matched": stop}
        assert out["text"] == sglang_text(tokenizer, PROMPT, out["output_ids"], reason, no_stop_trim=nst)
    trimmed = sglang_text(tokenizer, PROMPT, out["output_ids"], reason, no_stop_trim=False)
    assert trimmed != sglang_text(tokenizer, PROMPT, out["output_ids"], reason, no_stop_trim=True)



def test_text_codec_decodes_with_sglangs_context(tokenizer):
    """Outputs that start with a word: decoded alone they would lose their leading space;
    SGLang decodes them after 5 prompt tokens of context (so does TextCodec)."""
    from moe_rl.engine.text import TextCodec

    codec = TextCodec(tokenizer)
    cases = [([9, 40, 10], None), ([9, 1], {"type": "stop", "matched": 1}), ([3, 9, 4], None), ([40, 9], None)]
    for prompt in (PROMPT, [12], []):
        for output, reason in cases:
            for skip, spaces, nst in [(True, True, False), (False, False, True), (False, True, False)]:
                want = sglang_text(tokenizer, prompt or [0], output, reason, skip=skip, spaces=spaces, no_stop_trim=nst)
                got = codec.output_text(prompt or [0], output, reason, skip, spaces, nst)
                assert got == want, (prompt, output, reason, skip, spaces, nst)
    assert codec.output_text(PROMPT, [9, 40], None, True, True, False) == " w9p40" != tokenizer.decode([9, 40])


def test_text_honours_special_token_flags(tok_server, tokenizer):
    specials = set(range(len(SPECIAL)))
    for seed in range(12):  # a seed whose output holds a special token (other than EOS: it would stop)
        sp = {"temperature": 1.0, "max_new_tokens": 24, "sampling_seed": seed, "ignore_eos": True}
        out = _post(tok_server.url, {"input_ids": PROMPT, "sampling_params": sp})
        if specials & set(out["output_ids"]):
            break
    else:
        pytest.fail("no output with a special token in 12 seeds")
    texts = {}
    for skip in (True, False):
        for spaces in (True, False):
            o = _post(tok_server.url, {"input_ids": PROMPT, "sampling_params": {
                **sp, "skip_special_tokens": skip, "spaces_between_special_tokens": spaces}})
            assert o["output_ids"] == out["output_ids"]
            texts[skip, spaces] = o["text"]
            assert o["text"] == sglang_text(tokenizer, PROMPT, o["output_ids"], o["meta_info"]["finish_reason"],
                                            skip=skip, spaces=spaces)
    assert texts[True, True] != texts[False, True]


def test_eos_of_the_model_stops_and_is_trimmed(tok_server, tokenizer):
    """generation_config's eos_token_id ends a request (SGLang) and the text drops it."""
    for seed in range(40):
        out = _post(tok_server.url, {"input_ids": PROMPT, "sampling_params": {
            "temperature": 1.0, "max_new_tokens": 48, "sampling_seed": seed}})
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            break
    else:
        pytest.skip("no EOS sampled in 40 seeds")
    assert out["output_ids"][-1] == EOS_ID and out["meta_info"]["finish_reason"]["matched"] == EOS_ID
    assert out["text"] == sglang_text(tokenizer, PROMPT, out["output_ids"], out["meta_info"]["finish_reason"])


def test_text_prompts_are_tokenized_like_sglang(tok_server, tokenizer):
    text = "w8 w9 w10 w11"
    ids = tokenizer(text)["input_ids"]  # SGLang's fast-tokenizer path: tokenizer(texts)["input_ids"]
    sp = {"temperature": 0.0, "max_new_tokens": 4}
    by_text = _post(tok_server.url, {"text": text, "sampling_params": sp})
    by_ids = _post(tok_server.url, {"input_ids": ids, "sampling_params": sp})
    assert by_text["meta_info"]["prompt_tokens"] == len(ids) and by_text["output_ids"] == by_ids["output_ids"]
    batch = _post(tok_server.url, {"text": [text, "w12 w13"], "sampling_params": sp})
    assert [b["output_ids"] for b in batch][0] == by_ids["output_ids"]
    assert batch[1]["meta_info"]["prompt_tokens"] == len(tokenizer("w12 w13")["input_ids"])


def test_text_in_logprobs_with_a_tokenizer(tok_server, tokenizer, model):
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 1.0, "max_new_tokens": 4, "sampling_seed": 1},
            "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    out = _post(tok_server.url, body)
    want = sglang_meta(PROMPT, out["output_ids"], temperature=1.0, start=1, top_n=2, tokenizer=tokenizer,
                       model=model, return_text=True)
    assert_same(out["meta_info"], want)
    assert out["meta_info"]["output_token_logprobs"][0][2] == tokenizer.decode([out["output_ids"][0]])


def test_without_a_tokenizer_text_is_absent_and_text_prompts_are_refused(server):
    out = _post(server.url, {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})
    assert "text" not in out  # SGLang with --skip-tokenizer-init answers output_ids and meta_info only
    with pytest.raises(Exception, match="cannot accept text prompts"):
        _post(server.url, {"text": "w8 w9"})


def test_stream_snapshots_carry_text_and_logprobs(tok_server, tokenizer):
    """Streamed (cumulative, SGLang's default): each snapshot carries the text so far; the last
    one's text and log-prob keys are those of the same request answered at once."""
    import json
    import urllib.request

    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True}
    req = urllib.request.Request(tok_server.url + "/generate", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    whole = _post(tok_server.url, body)
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]
    for c in chunks:
        assert c["text"] == tokenizer.decode(PROMPT[-5:] + c["output_ids"])[len(tokenizer.decode(PROMPT[-5:])) :]
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert_same(chunks[-1]["meta_info"], {k: whole["meta_info"][k] for k in
                                          ("input_token_logprobs", "output_token_logprobs")})


# --- stop strings (with a tokenizer) -------------------------------------------------------------
def _sglang_stop_len(tokenizer, output, stops):
    """SGLang's scheduler on ``output`` token by token (Req.update_finish_state's string check,
    compiled from the installed source; stop_str_max_len from its SamplingParams.normalize):
    the output length and finish reason at the first match, or None."""
    import re
    from http import HTTPStatus

    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(stop=list(stops))
    sp.normalize(tokenizer)
    fin = SimpleNamespace(FINISH_MATCHED_STR=lambda matched: {"type": "stop", "matched": matched})
    m = sglang_methods("srt/managers/schedule_batch.py", "Req",
                       ("_stop_match_tail_len", "tail_str", "_locate_str_stop_finished_len", "_check_str_based_finish"),
                       re=re, HTTPStatus=HTTPStatus, logger=logging.getLogger("sglang-ref"),
                       FINISH_MATCHED_STR=fin.FINISH_MATCHED_STR, FINISH_ABORT=None, FINISHED_MATCHED_REGEX=None)
    Req = type("ReqRef", (), m)
    for j in range(1, len(output) + 1):
        r = Req()
        r.sampling_params, r.tokenizer, r.output_ids, r.decoded_text = sp, tokenizer, list(output[:j]), ""
        r.finished_reason = r.finished_len = None
        if r._check_str_based_finish(1):
            return (r.finished_len or j), r.finished_reason
    return None


def test_stop_strings_end_and_trim_like_sglang(tok_server, tokenizer):
    sp = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    plain = _post(tok_server.url, {"input_ids": PROMPT, "sampling_params": sp})["output_ids"]
    # a stop string made of the text of output tokens 5 and 6 (it may also occur earlier)
    stop = tokenizer.decode(plain[5:7]).strip()[1:]
    n, reason = _sglang_stop_len(tokenizer, plain, [stop, "no such text"])
    assert n < len(plain)
    for no_trim in (False, True):
        out = _post(tok_server.url, {"input_ids": PROMPT, "sampling_params": {
            **sp, "stop": ["no such text", stop], "no_stop_trim": no_trim}})
        assert out["output_ids"] == plain[:n]
        assert out["meta_info"]["finish_reason"] == reason == {"type": "stop", "matched": stop}
        assert out["text"] == sglang_text(tokenizer, PROMPT, plain[:n], reason, no_stop_trim=no_trim)
        assert out["text"].endswith(stop) == no_trim


def test_stop_strings_without_a_tokenizer_are_refused(server):
    with pytest.raises(Exception, match="no tokenizer"):
        _post(server.url, {"input_ids": [3, 4], "sampling_params": {"stop": ["x"]}})
    out = _post(server.url, {"input_ids": [3, 4], "sampling_params": {"stop": [], "max_new_tokens": 1}})
    assert len(out["output_ids"]) == 1

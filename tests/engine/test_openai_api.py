"""The OpenAI-compatible endpoints (moe_rl/engine/openai_api.py) driven by the official
``openai`` client: chat with tools, streaming, logprobs equal to /generate's for the same ids,
completions, errors in OpenAI's shape. Tool-call parsing is checked against SGLang's own
detectors."""
from __future__ import annotations

import json

import pytest
import requests

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.engine.openai_server import EXAMPLE, InProcessServer  # noqa: E402

MESSAGES = [{"role": "user", "content": "guess 0 to 3"}]


@pytest.fixture(scope="module")
def server():
    s = InProcessServer()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(EXAMPLE / "tokenizer")


def _tools():
    from guess_tools import TOOLS

    return TOOLS


def _generate(server, ids, max_new_tokens, seed, top=0):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "sampling_seed": seed},
            "return_logprob": True, "top_logprobs_num": top}
    r = requests.post(server.url + "/generate", json=body, timeout=60)
    r.raise_for_status()
    return r.json()


def test_models(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["default"] and models[0].max_model_len == server.engine.max_context


def test_chat_prompt_is_the_template_and_logprobs_equal_generate(client, server, tok):
    """The prompt is transformers' own rendering of the chat template; output ids, log-probs
    and top log-probs are exactly /generate's for those ids and that seed."""
    tools = _tools()
    r = client.chat.completions.create(model="x", messages=MESSAGES, tools=tools, max_tokens=5, seed=7, logprobs=True,
                                       top_logprobs=3, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    want_prompt = tok.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
    assert choice.prompt_token_ids == list(want_prompt)
    ref = _generate(server, choice.prompt_token_ids, 5, 7, top=3)
    assert choice.response_token_ids == ref["output_ids"]
    lps = [c.logprob for c in choice.logprobs.content]
    assert lps == [t[0] for t in ref["meta_info"]["output_token_logprobs"]]
    assert [c.token for c in choice.logprobs.content] == [tok.decode([i]) for i in ref["output_ids"]]
    for c, row in zip(choice.logprobs.content, ref["meta_info"]["output_top_logprobs"]):
        assert [(t.logprob, t.token) for t in c.top_logprobs] == [(lp, tok.decode([i])) for lp, i, _ in row]
    n_out = len(ref["output_ids"])
    assert r.usage.prompt_tokens == len(want_prompt) and r.usage.completion_tokens == n_out
    assert r.usage.total_tokens == len(want_prompt) + n_out
    assert choice.finish_reason in ("stop", "length", "tool_calls")


def test_tool_calls_n_and_seed(client, server, tok):
    """n choices sampled with seed + i (each equals /generate with that seed); a choice whose
    output is a tool call carries it parsed (name, JSON arguments), the others plain content."""
    tools = _tools()
    r = client.chat.completions.create(model="x", messages=MESSAGES, tools=tools, max_tokens=1, seed=100, n=24,
                                       extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == list(range(24))
    calls = plain = 0
    for j, c in enumerate(r.choices):
        assert c.response_token_ids == _generate(server, c.prompt_token_ids, 1, 100 + j)["output_ids"]
        text = tok.decode(c.response_token_ids, skip_special_tokens=False)
        if text.startswith("<tool_call>"):
            body = json.loads(text[len("<tool_call>"):-len("</tool_call>")])
            assert len(c.message.tool_calls) == 1 and c.message.content == ""
            call = c.message.tool_calls[0]
            assert call.type == "function" and call.id.startswith("call_")
            assert (call.function.name, json.loads(call.function.arguments)) == (body["name"], body["arguments"])
            calls += 1
        else:
            assert not c.message.tool_calls
            assert c.message.content == tok.decode(c.response_token_ids, skip_special_tokens=False).replace(
                "<|im_end|>", "").replace("<|endoftext|>", "")
            plain += 1
    assert calls and plain, (calls, plain)
    none = client.chat.completions.create(model="x", messages=MESSAGES, tools=tools, tool_choice="none", max_tokens=1,
                                          seed=100, n=24)
    assert not any(c.message.tool_calls for c in none.choices)


@pytest.mark.parametrize("declared", ["both", "compare"])
def test_streaming_equals_non_streaming(client, tok, declared):
    """The streamed content, tool calls, finish reasons and log-probs equal the non-streamed
    answer's. With only ``compare`` declared, an ``answer`` call is dropped and its text is
    in neither content (SGLang's detector gives the same content)."""
    tools = [t for t in _tools() if declared == "both" or t["function"]["name"] == declared]
    kw = dict(model="x", messages=MESSAGES, tools=tools, max_tokens=4, seed=100, n=24, logprobs=True,
              extra_body={"return_token_ids": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    content = {i: "" for i in range(24)}
    calls, finish, lps = {i: [] for i in range(24)}, {}, {i: [] for i in range(24)}
    for ch in chunks:
        assert ch.object == "chat.completion.chunk"
        for c in ch.choices:
            content[c.index] += c.delta.content or ""
            calls[c.index] += c.delta.tool_calls or []
            if c.logprobs:
                lps[c.index] += [t.logprob for t in c.logprobs.content]
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert chunks[-1].usage.model_dump() == full.usage.model_dump() | {"completion_tokens_details": None,
                                                                       "prompt_tokens_details": None}
    dropped = 0
    for c in full.choices:
        text = tok.decode(c.response_token_ids, skip_special_tokens=False)
        if "<tool_call>" in text:  # the text before a call, stripped when parsed whole (as SGLang)
            assert content[c.index].strip() == c.message.content == _sglang_content(text, tools)
            dropped += not c.message.tool_calls
        else:
            assert content[c.index] == c.message.content
        assert finish[c.index] == c.finish_reason
        # the two requests batched their choices differently: fp32 rounding may differ
        assert lps[c.index] == pytest.approx([t.logprob for t in c.logprobs.content], abs=1e-5)
        want = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        assert [(t.function.name, t.function.arguments) for t in calls[c.index]] == want
    assert (dropped > 0) == (declared == "compare"), dropped


def _sglang_content(text: str, tools: list[dict]) -> str:
    """The content SGLang's hermes detector leaves of an output (its end-of-turn token cut)."""
    pytest.importorskip("partial_json_parser")
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.hermes_detector import HermesDetector

    text = text.replace("<|im_end|>", "").replace("<|endoftext|>", "")
    return HermesDetector().detect_and_parse(text, [Tool(**t) for t in tools]).normal_text


def test_completions(client, server, tok):
    prompt = tok.encode("guess 0 to", add_special_tokens=False)
    r = client.completions.create(model="x", prompt=prompt, max_tokens=4, logprobs=2, n=2, seed=3,
                                  extra_body={"return_token_ids": True})
    for j, c in enumerate(r.choices):
        ref = _generate(server, prompt, 4, 3 + j, top=2)
        assert c.token_ids == ref["output_ids"]
        # the two choices shared a batch, the reference ran alone: fp32 rounding may differ
        assert c.logprobs.token_logprobs == pytest.approx([t[0] for t in ref["meta_info"]["output_token_logprobs"]],
                                                          abs=1e-5)
        assert c.logprobs.tokens == [tok.decode([i]) for i in ref["output_ids"]]
        assert [len(d) for d in c.logprobs.top_logprobs] == [2] * len(ref["output_ids"])
        assert c.text == tok.decode(ref["output_ids"], skip_special_tokens=True)
    text = client.completions.create(model="x", prompt="guess 0 to", max_tokens=3, seed=3)
    assert text.usage.prompt_tokens == len(prompt) and text.choices[0].finish_reason in ("stop", "length")


def test_errors_in_openai_shape(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=MESSAGES, logit_bias={"3": 5})
    assert e.value.body["param"] == "logit_bias" and e.value.body["type"] == "invalid_request_error"
    raw = requests.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "n": 0}, timeout=30)
    assert raw.status_code == 400
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"} and raw.json()["error"]["param"] == "n"
    raw = requests.post(server.url + "/v1/completions", json={"prompt": [1] * 400, "max_tokens": 1}, timeout=30)
    assert raw.status_code == 400 and "context length" in raw.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.url + "/episodes/nope/v1", api_key="x", max_retries=0).chat.completions.create(
            model="x", messages=MESSAGES)


@pytest.mark.parametrize("fmt", ["hermes", "glm45"])
def test_tool_call_parsers_match_sglang(fmt):
    """moe_rl's parser of each family's format against SGLang's own detector."""
    pytest.importorskip("partial_json_parser")
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.glm4_moe_detector import Glm4MoeDetector
    from sglang.srt.function_call.hermes_detector import HermesDetector

    from moe_rl.engine.chat import parse_tool_calls

    tools = [{"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "put", "parameters": {"type": "object", "properties": {}}}}]
    if fmt == "hermes":
        texts = ['hi <tool_call>\n{"name": "get", "arguments": {"city": "x", "n": 2}}\n</tool_call>',
                 '<tool_call>{"name": "get", "arguments": {"city": "a"}}</tool_call>\n<tool_call>{"name": "put", '
                 '"arguments": {}}</tool_call>', "no call here", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "put", "arguments": {}}']
        det = HermesDetector
    else:
        texts = ["ok<tool_call>get\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>n</arg_key>\n"
                 "<arg_value>3</arg_value>\n</tool_call>", "<tool_call>put\n</tool_call><tool_call>get\n<arg_key>city"
                 "</arg_key>\n<arg_value>12</arg_value>\n</tool_call>", "plain text",
                 "<tool_call>nope\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"]
        det = Glm4MoeDetector
    sg_tools = [Tool(**t) for t in tools]
    for text in texts:
        ref = det().detect_and_parse(text, sg_tools)
        content, calls = parse_tool_calls(text, fmt, tools)
        assert content == ref.normal_text, text
        assert [(c.name, json.loads(c.arguments)) for c in calls] == \
            [(c.name, json.loads(c.parameters)) for c in ref.calls], text


def test_a_family_without_a_tool_parser_serves_chat_and_refuses_tools():
    """gpt-oss, whose tool calls (its own channel format) are not parsed here: the server starts
    and answers chat; a request with tools is a 400 naming ``tools`` and the family."""
    s = InProcessServer(["model.model_type=gpt_oss", "model.mlp_only_layers=[]", "model.sliding_window=4",
                         "model.attention_bias=true"])
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        out = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=3)
        assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="x", messages=MESSAGES, tools=_tools(), max_tokens=3)
        assert e.value.body["param"] == "tools" and "gpt_oss" in e.value.body["message"]
    finally:
        s.stop()


def test_episodes_registered_and_collected_together(server):
    """``POST /episodes`` with id and seed lists registers a group; each episode records its
    own calls (its seed drives its sampling, as one registered alone); ``/episodes/collect``
    returns and forgets them, naming unknown ids; a clash registers none."""
    url = server.url
    sp = {"temperature": 1.0}
    ids = [f"grp-a-{i}" for i in range(3)]
    assert requests.post(url + "/episodes", json={"id": ids, "seed": [7, 8, 7], "sampling_params": sp},
                         timeout=10).json() == {"id": ids}
    requests.post(url + "/episodes", json={"id": "solo", "seed": 8, "sampling_params": sp},
                  timeout=10).raise_for_status()
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True}
    for eid in [*ids, "solo"]:
        requests.post(f"{url}/episodes/{eid}/v1/completions", json=body, timeout=60).raise_for_status()
    out = requests.post(url + "/episodes/collect", json={"ids": [*ids, "solo", "nope"]}, timeout=10).json()["episodes"]
    assert [e["id"] for e in out] == [*ids, "solo", "nope"] and "error" in out[-1] and "records" not in out[-1]
    got = [[r["output_ids"] for r in e["records"]] for e in out[:4]]
    assert all(len(g) == 1 and len(g[0]) == 6 for g in got)
    assert got[0] == got[2] and got[1] == got[3]  # same seed, same call: same tokens
    assert requests.get(f"{url}/episodes/{ids[0]}", timeout=10).status_code == 404  # forgotten
    requests.post(url + "/episodes", json={"id": "held"}, timeout=10).raise_for_status()
    clash = requests.post(url + "/episodes", json={"id": ["free", "held"]}, timeout=10)
    assert clash.status_code == 400 and "held" in clash.json()["error"]["message"]
    assert requests.get(f"{url}/episodes/free", timeout=10).status_code == 404
    for bad, param in [({"id": ["x", "x"]}, "id"), ({"id": ["x", "y"], "seed": [1]}, "seed"),
                       ({"id": []}, "id"), ({"ids": "x"}, None)]:
        r = requests.post(url + ("/episodes/collect" if "ids" in bad else "/episodes"), json=bad, timeout=10)
        assert r.status_code == 400 and (param is None or r.json()["error"]["param"] == param), (bad, r.text)
    requests.delete(f"{url}/episodes/held", timeout=10)


def test_a_repeated_conversation_is_rendered_once(client, tok, monkeypatch):
    """The fresh render of a conversation is kept: asked again (a group's episodes open with
    the same messages), the prompt is the kept one, still transformers' rendering; other tools
    or messages are rendered anew."""
    from moe_rl.engine import chat

    renders, render = [], chat.render
    monkeypatch.setattr(chat, "render", lambda *a, **k: renders.append(1) or render(*a, **k))
    cases = [(MESSAGES, _tools()), (MESSAGES, _tools()[:1]), ([{"role": "user", "content": "guess 1 to 2"}], None)]
    for rnd in range(2):
        for messages, tools in cases:
            r = client.chat.completions.create(model="x", messages=messages, tools=tools, max_tokens=1,
                                               extra_body={"return_token_ids": True})
            want = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
            assert r.choices[0].prompt_token_ids == list(want)
        if rnd == 0:
            first = len(renders)  # 3, or fewer where earlier tests asked the same
            assert 1 <= first <= 3
    assert len(renders) == first


"""Qwen3.5's tool calls (``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>...``)
in the OpenAI-compatible chat endpoint: parsed as SGLang's own ``qwen3_coder`` detector parses
them (content, names, arguments typed by the tools' schemas), read back from what Qwen3.5's chat
template writes, and served to the official ``openai`` client by a qwen3_5_moe_text engine
whose tokenizer writes that form (tests/engine/qwen35_tokenizer.py): calls, streaming, and a
tool result continuing the episode token for token."""
from __future__ import annotations

import json

import pytest
import requests

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from moe_rl.engine import chat  # noqa: E402
from tests.engine.openai_server import InProcessServer  # noqa: E402
from tests.engine.qwen35_tokenizer import write_tokenizer, xml_call  # noqa: E402

MESSAGES = [{"role": "user", "content": "guess 0 to 2"}]
QWEN35 = ["model.model_type=qwen3_5_moe_text", "model.shared_expert_intermediate_size=16",
          "model.layer_types=[linear_attention,full_attention]", "engine.max_context=512"]
TYPED = {"type": "function", "function": {"name": "typed", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array", "items": {"type": "integer"}},
    "opt": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "e": {"enum": [1, 2]}, "u": {},
    "m": {"oneOf": [{"type": "integer"}, {}]}, "al": {"allOf": [{"type": "number"}]}, "en": {"enum": ["a", 1]},
    "ty": {"type": ["null", "boolean"]}, "ob": {"properties": {"k": {}}}, "ar": {"items": {}}}}}}
GET = {"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}}}}}
PUT = {"type": "function", "function": {"name": "put", "parameters": {"type": "object", "properties": {}}}}


def _tools():
    from guess_tools import TOOLS

    return TOOLS


def _sglang(text: str, tools: list[dict]):
    """SGLang's qwen3_coder detector on ``text``: (content, [(name, arguments)])."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.qwen3_coder_detector import Qwen3CoderDetector

    ref = Qwen3CoderDetector().detect_and_parse(text, [Tool(**t) for t in tools])
    return ref.normal_text, [(c.name, json.loads(c.parameters)) for c in ref.calls]


def _ours(text: str, tools: list[dict]):
    content, calls = chat.parse_tool_calls(text, "qwen3_coder", tools)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_xml_calls_parse_as_sglangs_detector():
    """Each text (calls with and without text before them, several calls, an undeclared tool,
    a call cut off mid-value, a parameter missing its end tag, a block without a function, no
    call, every schema type and values that do not convert) gives SGLang's content and calls."""
    tools = [GET, PUT, TYPED]
    texts = [
        "hi " + xml_call("get", {"city": "Paris", "n": 3}),
        xml_call("get", {"city": "12"}) + "\n" + xml_call("put", {}),
        "plain text",
        xml_call("nope", {"a": 1}),
        "<tool_call>\n<function=get>\n<parameter=city>\nRo",
        "<tool_call>\n<function=get>\n<parameter=city>\nOslo\n<parameter=n>\n2\n</function>\n</tool_call>",
        "ok <tool_call>garbage</tool_call>",
        xml_call("typed", {"s": "two\nlines", "i": "-4", "x": "2.5", "b": "True", "o": '{"k": [1, 2]}',
                           "a": "[3, 4]", "opt": "null", "e": "2", "u": "7", "extra": "8", "m": "9", "al": "0.5",
                           "en": "1", "ty": "false", "ob": '{"k": 2}', "ar": "[5]"}),
        xml_call("typed", {"i": "three", "x": "1e3", "b": "no", "o": "{'k': 1}", "a": "nope", "opt": "5"}),
        xml_call("typed", {"x": "4", "s": "null"}),
    ]
    pytest.importorskip("partial_json_parser")
    for text in texts:
        assert _ours(text, tools) == _sglang(text, tools), text
    # the values typed as the schema says (not merely equal to SGLang's: these are the point)
    _, [(_, args)] = _ours(texts[7], tools)
    assert args == {"s": "two\nlines", "i": -4, "x": 2.5, "b": True, "o": {"k": [1, 2]}, "a": [3, 4], "opt": None,
                    "e": 2, "u": "7", "extra": "8", "m": 9, "al": 0.5, "en": "1", "ty": False, "ob": {"k": 2}, "ar": [5]}
    assert _ours(texts[8], tools)[1][0][1] == {"i": "three", "x": 1000.0, "b": False, "o": {"k": 1}, "a": "nope",
                                                "opt": 5}


def test_the_template_writes_what_the_parser_reads(tmp_path):
    """Qwen3.5's form of a conversation with tools, a call (arguments sent as a JSON string, as
    the OpenAI API carries them) and its result, as the template renders it; the call it
    writes parses back to the call sent, its arguments typed by the schema."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "tok"))
    tools = [_tools()[0], TYPED]
    args = {"s": "a b", "i": 3, "b": False, "o": {"k": "v"}, "a": [1, 2]}
    messages = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "compare", "arguments": '{"n": 1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "typed", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "higher"},
        {"role": "tool", "tool_call_id": "call_2", "content": "ok"}]
    text = chat.render(tok, chat.template_messages(messages), tools, add_generation_prompt=True)
    calls = ('<tool_call>\n<function=compare>\n<parameter=n>\n1\n</parameter>\n</function>\n</tool_call>\n'
             '<tool_call>\n<function=typed>\n<parameter=s>\na b\n</parameter>\n<parameter=i>\n3\n</parameter>\n'
             '<parameter=b>\nFalse\n</parameter>\n<parameter=o>\n{"k": "v"}\n</parameter>\n'
             '<parameter=a>\n[1, 2]\n</parameter>\n</function>\n</tool_call>')
    want = ("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
            + "\n".join(json.dumps(t) for t in tools) + "\n</tools><|im_end|>\n"
            "<|im_start|>user\nguess 0 to 2<|im_end|>\n"
            "<|im_start|>assistant\n" + calls + "<|im_end|>\n"
            "<|im_start|>user\n<tool_response>\nhigher\n</tool_response>\n<tool_response>\nok\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n")
    assert text == want
    content, parsed = _ours(calls + "<|im_end|>", tools)
    assert content == "" and parsed == [("compare", {"n": 1}), ("typed", args)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    path = write_tokenizer(tmp_path_factory.mktemp("qwen35") / "tok")
    s = InProcessServer([*QWEN35, f"model.tokenizer_path={path}"])
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    yield s, client, AutoTokenizer.from_pretrained(path)
    s.stop()


def test_served_calls_are_sglangs(served):
    """n choices of one token: those that are a whole XML call carry SGLang's parse of it
    (name, arguments typed by the schema: n an integer), finish_reason tool_calls once
    stopped; the others are plain content."""
    pytest.importorskip("partial_json_parser")
    server, client, tok = served
    assert server.engine.arch.model_type == "qwen3_5_moe_text"
    tools = _tools()
    r = client.chat.completions.create(model="x", messages=MESSAGES, tools=tools, max_tokens=2, seed=100, n=24,
                                       extra_body={"return_token_ids": True})
    calls = plain = 0
    for c in r.choices:
        text = tok.decode(c.response_token_ids, skip_special_tokens=False)
        got = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []]
        if "<tool_call>" in text:
            content, want = _sglang(text.replace("<|im_end|>", "").replace("<|endoftext|>", ""), tools)
            assert got == want and c.message.content == content, text
            assert all(isinstance(a["n"], int) for _, a in got)
            if text.endswith("<|im_end|>") and got:
                assert c.finish_reason == "tool_calls"
            calls += bool(got)
        else:
            assert not got and c.message.content == text.replace("<|im_end|>", "").replace("<|endoftext|>", "")
            plain += 1
    assert calls and plain, (calls, plain)


def test_streaming_equals_non_streaming(served):
    """Streamed content, tool calls and finish reasons equal the non-streamed answer's; a call
    is never streamed as content."""
    _, client, tok = served
    kw = dict(model="x", messages=MESSAGES, tools=_tools(), max_tokens=3, seed=100, n=24,
              extra_body={"return_token_ids": True})
    full = client.chat.completions.create(**kw)
    content, calls, finish = {i: "" for i in range(24)}, {i: [] for i in range(24)}, {}
    for ch in client.chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            content[c.index] += c.delta.content or ""
            calls[c.index] += c.delta.tool_calls or []
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert any(c.message.tool_calls for c in full.choices)
    for c in full.choices:
        assert content[c.index] == c.message.content and "<tool_call>" not in content[c.index]
        assert finish[c.index] == c.finish_reason
        assert [(t.function.name, t.function.arguments) for t in calls[c.index]] == \
            [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]


def test_a_tool_result_continues_the_episode_token_for_token(served):
    """An episode's call returns an XML tool call; the next request (the messages, the returned
    assistant message, the tool's result) is prompted with the first prompt + the sampled ids +
    the template's text after them: the template's full rendering, never a re-tokenised turn."""
    server, client, tok = served
    tools = _tools()
    for seed in range(100, 140):  # the first seed whose one token is a call
        eid = f"q35-{seed}"
        requests.post(server.url + "/episodes", json={"id": eid, "seed": seed}, timeout=10).raise_for_status()
        ep = openai.OpenAI(base_url=f"{server.url}/episodes/{eid}/v1", api_key="none", max_retries=0)
        first = ep.chat.completions.create(model="x", messages=MESSAGES, tools=tools, max_tokens=1,
                                           extra_body={"return_token_ids": True}).choices[0]
        if first.message.tool_calls:
            break
        requests.delete(f"{server.url}/episodes/{eid}", timeout=10)
    else:
        pytest.fail("no seed in 100..139 sampled a tool call")
    call = first.message.tool_calls[0]
    messages = [*MESSAGES, first.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "higher"}]
    second = ep.chat.completions.create(model="x", messages=messages, tools=tools, max_tokens=1,
                                        extra_body={"return_token_ids": True}).choices[0]
    done = first.prompt_token_ids + first.response_token_ids
    assert second.prompt_token_ids[:len(done)] == done
    want = tok.apply_chat_template(chat.template_messages(messages), tools=tools, add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    assert second.prompt_token_ids == list(want)
    records = requests.delete(f"{server.url}/episodes/{eid}", timeout=10).json()["records"]
    assert [r["output_ids"] for r in records] == [first.response_token_ids, second.response_token_ids]


def test_the_served_form_follows_the_family_and_its_template():
    """Qwen3.5: the XML form; Qwen3-Next (and Qwen3-MoE): hermes, unless the checkpoint's chat
    template writes ``<function=`` calls (the Qwen3-Coder releases); a family without a parser:
    none (its requests with tools are refused)."""
    from tests.engine.qwen35_tokenizer import TEMPLATE
    from tests.engine.openai_server import EXAMPLE

    hermes = (EXAMPLE / "tokenizer" / "chat_template.jinja").read_text()
    assert chat.tool_format("qwen3_5_moe_text", None) == "qwen3_coder"
    assert chat.tool_format("qwen3_next", hermes) == chat.tool_format("qwen3_moe", hermes) == "hermes"
    assert chat.tool_format("qwen3_next", TEMPLATE) == "qwen3_coder"
    assert chat.tool_format("qwen3_moe", {"default": hermes, "tool_use": TEMPLATE}) == "qwen3_coder"
    assert chat.tool_format("glm4_moe", TEMPLATE) == "glm45" and chat.tool_format("gpt_oss", TEMPLATE) is None

"""Continuing an episode's conversation (moe_rl/engine/chat.py, ``continuation``): the ids
are the earlier prompt's ids + the sampled ids + the ids of the text the template puts after
them, equal to what the two-render reference (transformers' own rendering of the conversation
up to the model's turn and of the whole conversation) gives, whether the one-render path
(the template writes the output as sampled) or the turn-end path (it rewrites it) is taken;
a template that does not extend the earlier prompt is not continued."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from moe_rl.engine import chat  # noqa: E402
from tests.engine.openai_server import EXAMPLE  # noqa: E402

CALL = '<tool_call>\n{"name": "compare", "arguments": {"n": 1}}\n</tool_call>'  # one token of the example vocabulary


@pytest.fixture
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(EXAMPLE / "tokenizer")


def _tools():
    from guess_tools import TOOLS

    return TOOLS


def _reference(tok, prompt_ids, output_ids, messages, k, tools):
    """Two renders with transformers (the conversation to the model's turn, and all of it): the
    text after the model's output, cut at the turn's end token where the template rewrote it."""
    def render(ms, gen):
        return tok.apply_chat_template(chat.template_messages(ms), tools=tools, add_generation_prompt=gen,
                                       tokenize=False)

    a, p, f = render(messages[:k], True), render(messages[: k + 1], False), render(messages, True)
    assert p.startswith(a) and f.startswith(p)
    out = tok.decode(output_ids, skip_special_tokens=False)
    written = p[len(a):]
    closing = written[len(out):] if written.startswith(out) else written[written.rfind("<|im_end|>") + len("<|im_end|>"):]
    return list(prompt_ids) + list(output_ids) + tok.encode(closing + f[len(p):], add_special_tokens=False), f


def _count_renders(monkeypatch):
    renders, render = [], chat.render
    monkeypatch.setattr(chat, "render", lambda *a, **k: renders.append(1) or render(*a, **k))
    return renders


def _assistant(tok, output_ids, tools):
    content, calls = chat.parse_tool_calls(tok.decode(output_ids, skip_special_tokens=True), "hermes", tools or [])
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [{"id": "call_x", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in calls]
    return msg


def _play(tok, monkeypatch, tools, turns):
    """Continues a conversation over ``turns`` (output ids, the message that follows) as the
    engine does; checks each prompt against the reference; returns the renders per turn."""
    messages = [{"role": "user", "content": "guess 0 to 2"}]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    renders, counts = _count_renders(monkeypatch), []
    for output_ids, after in turns:
        ask = chat.Ask(list(messages), tools)
        reply = _assistant(tok, output_ids, tools)
        turn = chat.Turn.answered(ask, prompt, output_ids, reply, prompt_text=text)
        messages += [reply, after]
        before = len(renders)
        found = chat.continuation(tok, turn, chat.Ask(list(messages), tools), ["<|im_end|>", "<|endoftext|>"])
        counts.append(len(renders) - before)
        assert found is not None
        want_ids, want_text = _reference(tok, prompt, output_ids, messages, len(messages) - 2, tools)
        assert found == (want_ids, want_text)
        assert found[0][: len(prompt) + len(output_ids)] == prompt + output_ids  # the sampled ids, never re-encoded
        if counts[-1] == 1:  # written as sampled: after the earlier prompt's text, the ids spell the template's
            after = tok.decode(output_ids + found[0][len(prompt) + len(output_ids):], skip_special_tokens=False)
            assert text + after == want_text
        prompt, text = found
    return counts


def test_a_continuation_written_as_sampled_is_rendered_once(tok, monkeypatch):
    call, end = tok.convert_tokens_to_ids(CALL), tok.convert_tokens_to_ids("<|im_end|>")
    counts = _play(tok, monkeypatch, _tools(), [
        ([call], {"role": "tool", "content": "higher"}),  # a tool call, cut by max_tokens before its end token
        ([call, end], {"role": "tool", "content": "equal"}),  # one that ended with the end token
        (tok.encode("2", add_special_tokens=False) + [end], {"role": "user", "content": "guess"}),  # plain text
    ])
    assert counts == [1, 1, 1]


def test_a_rewritten_turn_is_cut_at_its_end_token(tok, monkeypatch):
    """A template that writes the assistant's text otherwise than sampled (here: stripped) takes
    the turn-end render: two renders, the same ids as the reference."""
    tok.chat_template = tok.chat_template.replace("(m.content or '')", "(m.content or '') | trim")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = tok.encode(" 1", add_special_tokens=False) + [end]
    counts = _play(tok, monkeypatch, None, [(out, {"role": "user", "content": "guess"}),
                                            (tok.encode("2", add_special_tokens=False) + [end],
                                             {"role": "user", "content": "higher"})])
    assert counts == [2, 1]  # " 1" is written "1"; "2" as sampled


@pytest.mark.parametrize("head", ["{{- messages | length }}", "{{- messages[-1].role }}"])
def test_a_template_that_does_not_extend_the_earlier_prompt_is_not_continued(tok, head):
    """A template whose text of a longer conversation does not start with the earlier prompt's
    text: no continuation (the engine renders the request afresh, a new sequence)."""
    tok.chat_template = head + tok.chat_template
    messages = [{"role": "user", "content": "guess 0 to 2"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    out = tok.encode("1", add_special_tokens=False)
    reply = {"role": "assistant", "content": "1"}
    turn = chat.Turn.answered(chat.Ask(list(messages)), prompt, out, reply, prompt_text=text)
    later = chat.Ask([*messages, reply, {"role": "tool", "content": "lower"}])
    assert chat.continuation(tok, turn, later, ["<|im_end|>"]) is None
    other = chat.Ask([*messages, {"role": "assistant", "content": "2"}, {"role": "user", "content": "x"}])
    assert chat.continuation(tok, turn, other, ["<|im_end|>"]) is None  # not the message returned


@pytest.mark.parametrize("which", ["example", "qwen35"])
def test_encode_gives_transformers_ids(tok, tmp_path, which):
    """chat.encode (the Rust backend called directly where the wrapper adds nothing) gives
    transformers' own ``encode(text, add_special_tokens=False)`` for template text with special
    tokens, tool calls, unicode and blanks; with truncation or padding set on the backend, or
    special tokens split, it gives the wrapper's ids too (the wrapper's settings, not the backend's)."""
    from transformers import AutoTokenizer

    from tests.engine.qwen35_tokenizer import write_tokenizer

    if which == "qwen35":
        tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "tok"))
    texts = ["", " ", "\n\n", "<|im_start|>user\nguess 0 to 2<|im_end|>\n<|im_start|>assistant\n", CALL + "<|im_end|>",
             "<tool_response>\nhigher\n</tool_response><|im_end|>\n<|im_start|>assistant\n", "héllo wörld ✓ 数字",
             tok.apply_chat_template([{"role": "user", "content": "a b"}], tools=_tools(), add_generation_prompt=True,
                                     tokenize=False)]
    for text in texts:
        assert chat.encode(tok, text) == tok.encode(text, add_special_tokens=False), text

    long = texts[3] * 3
    tok.backend_tokenizer.enable_truncation(3)  # a tokenizer.json with truncation: the wrapper turns it off
    assert len(chat.encode(tok, long)) > 3
    assert chat.encode(tok, long) == tok.encode(long, add_special_tokens=False)
    tok.backend_tokenizer.enable_padding(length=200)
    assert chat.encode(tok, long) == tok.encode(long, add_special_tokens=False)
    tok.split_special_tokens = True  # special tokens as text: the wrapper's setting decides
    split = chat.encode(tok, texts[3])
    assert split == tok.encode(texts[3], add_special_tokens=False)
    assert split != tok.encode(texts[3], add_special_tokens=False, split_special_tokens=False)

"""Chat messages to prompt ids and model output to tool calls, as SGLang's OpenAI serving does
them (read from sglang 0.5.23's ``serving_chat.py`` and ``function_call/``); no HTTP here.

* **Template**: the tokenizer's chat template renders the messages to text
  (``apply_chat_template(..., tokenize=False)``, ``tools`` as the request's
  ``[{"type": "function", "function": {...}}]``), which is encoded without special tokens
  added (the template holds them). Before rendering, as SGLang: a ``None`` content is ``""``,
  a tool message's list of text parts is joined, and an assistant's tool-call ``arguments``
  (a JSON string on the wire) is parsed to an object.
* **Tool calls** in the model family's format (SGLang's ``--tool-call-parser``): Qwen3-MoE
  writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (``hermes``), GLM-4.5
  ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`` (``glm45``;
  a value is JSON unless the tool's schema says string). The content is the text before the
  first ``<tool_call>`` (stripped); calls naming a tool the request did not declare are
  dropped; a call that does not parse leaves the whole text as content and no call.
  Qwen3.5 and the Qwen3-Coder releases write an XML form (``qwen3_coder``)::

      <tool_call>
      <function=NAME>
      <parameter=ARG>
      VALUE
      </parameter>
      </function>
      </tool_call>

  each VALUE typed by the tool's JSON schema (string as written; integer, number, boolean,
  null; object / array as JSON, else a Python literal; a value that does not convert, or an
  argument the schema does not name, stays a string). As SGLang's ``qwen3_coder`` detector:
  the content is the text before the first ``<tool_call>``, not stripped; calls are kept
  whatever name they give; a ``<tool_call>`` with no ``<function=`` parses to no call and the
  text before it. A family served in hermes form whose chat template writes ``<function=``
  (Qwen3-Coder-30B-A3B on qwen3_moe, Qwen3-Coder-Next on qwen3_next) is parsed in this form.
* **Continuing an episode's conversation** (:func:`continuation`): when a request's messages
  repeat an earlier request's messages plus the assistant message that was returned for it,
  the prompt is that earlier prompt's ids + the ids the model sampled + the ids of the text
  the template puts after them; the model's turn is never re-tokenised from its text. Only
  that new text is encoded, and the conversation is rendered once (twice where the template
  rewrites the model's turn).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# SGLang's parser of each model family (what --tool-call-parser names for its checkpoints)
# (Qwen3-Next's instruct and thinking releases write Qwen3's hermes form, Qwen3.5 the XML form;
# a family not here is served, with requests that carry tools refused)
TOOL_FORMATS = {"qwen3_moe": "hermes", "glm4_moe": "glm45", "qwen3_next": "hermes", "qwen3_5_moe_text": "qwen3_coder"}


def tool_format(model_type: str, chat_template: Any) -> str | None:
    """The tool-call format served for ``model_type`` with this chat template (a string, a
    dict of named templates, or None): the family's, except that a hermes family whose
    template writes ``<function=`` calls (the Qwen3-Coder releases) is parsed in that form."""
    fmt = TOOL_FORMATS.get(model_type)
    texts = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    if fmt == "hermes" and any(isinstance(t, str) and "<function=" in t for t in texts):
        return "qwen3_coder"
    return fmt


# --- messages and the template --------------------------------------------------------------
def template_messages(messages: list[dict]) -> list[dict]:
    """Copies of ``messages`` ready for a chat template (module docstring)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("role") == "tool" and isinstance(m["content"], list) and all(
                isinstance(p, str) or (isinstance(p, dict) and p.get("type") == "text") for p in m["content"]):
            m["content"] = " ".join(p if isinstance(p, str) else p.get("text", "") for p in m["content"])
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = []
            for c in m["tool_calls"]:
                c = dict(c)
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError as e:
                        raise ValueError(f"an assistant tool call's function.arguments is not valid JSON: {e}") from None
                c["function"] = fn
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out


def render(tokenizer, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool,
           template_kwargs: dict | None = None) -> str:
    """The chat template's text of ``messages`` (already through :func:`template_messages`)."""
    text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **(template_kwargs or {}))
    if not isinstance(text, str):
        raise ValueError("the chat template did not render to a string")
    return text


def encode(tokenizer, text: str) -> list[int]:
    """Ids of rendered template text (its special tokens parsed, none added).

    A fast tokenizer's Rust backend is called directly where transformers' wrapper would add
    nothing to it (no truncation or padding set, special tokens not split): the same ids, at a
    fifth of the wrapper's cost on a chat turn's few tokens (6 against 28 µs)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and not getattr(tokenizer, "split_special_tokens", True) and backend.truncation is None
            and backend.padding is None and not backend.encode_special_tokens):
        return backend.encode(text, add_special_tokens=False).ids
    return list(tokenizer.encode(text, add_special_tokens=False))


_COMPARABLE = json.JSONEncoder(sort_keys=True, default=str)  # one encoder: json.dumps with options builds one a call


def canonical(message: dict) -> str:
    """A message as a comparable string: what a template can render of it (tool-call ids,
    which the model never wrote, left out; arguments parsed)."""
    m = template_messages([message])[0]
    calls = [{"name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")}
             for c in m.get("tool_calls") or []]
    keep = {k: v for k, v in m.items() if k not in ("tool_calls",) and v not in (None, [], "")}
    keep["content"] = m.get("content") or ""
    if calls:
        keep["tool_calls"] = calls
    return _COMPARABLE.encode(keep)


# --- tool calls ------------------------------------------------------------------------------
@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as the OpenAI API carries it


def _tool_parameters(tools: list[dict], name: str) -> dict | None:
    """The parameters schema of tool ``name`` ({} when it has none), None for an undeclared tool."""
    for t in tools:
        fn = t.get("function") or {}
        if fn.get("name") == name:
            return fn.get("parameters") or {}
    return None


def _schema_type(tools: list[dict], name: str, key: str) -> Any:
    params = _tool_parameters(tools, name)
    if params is None:
        return None
    return ((params.get("properties") or {}).get(key) or {}).get("type")


def _glm_calls(text: str, tools: list[dict]) -> list[dict]:
    import re

    calls = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        head, sep, rest = body.partition("\n")
        if not sep:
            head, rest = body, ""
        name = head.strip()
        args: dict[str, Any] = {}
        for key, value in re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", rest, re.DOTALL):
            key = key.strip()
            if _schema_type(tools, name, key) == "string":
                args[key] = value
                continue
            try:
                args[key] = json.loads(value)
            except json.JSONDecodeError:
                args[key] = value
        calls.append({"name": name, "arguments": args})
    return calls


def _hermes_calls(text: str) -> list[dict]:
    import re

    calls = []
    for closed, open_ in re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL):
        raw = (closed or open_).strip()
        if not raw:
            continue
        parsed = json.loads(raw)
        for c in parsed if isinstance(parsed, list) else [parsed]:
            calls.append({"name": c.get("name"), "arguments": c.get("parameters") or c.get("arguments") or {}})
    return calls


def _schema_kind(schema: Any) -> str | None:
    """The JSON type an argument's schema asks for, None when it does not say: its ``type``
    (the first non-null of a list), the type of its ``anyOf`` / ``oneOf`` branches (one type;
    an optional type: the non-null one; mixed: string if among them, else the first), its
    ``enum`` values' type (mixed: string), the first non-string type of its ``allOf``
    branches, ``properties``: object, ``items``: array."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, str):
        return t
    if isinstance(t, list) and t:
        return next((x for x in t if x != "null"), "string")
    branches = schema.get("anyOf") or schema.get("oneOf")
    kinds = [k for k in map(_schema_kind, branches if isinstance(branches, list) else []) if k]
    if kinds:
        rest = set(kinds) - {"null"}
        if len(set(kinds)) == 1 or (len(set(kinds)) == 2 and len(rest) == 1):
            return (rest or {"null"}).pop()
        return "string" if "string" in kinds else kinds[0]
    if isinstance(schema.get("enum"), list):
        names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
        kinds = {names.get(type(v), "null") for v in schema["enum"]}
        return kinds.pop() if len(kinds) == 1 else "string"
    if isinstance(schema.get("allOf"), list):
        return next((k for k in map(_schema_kind, schema["allOf"]) if k and k != "string"), "string")
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def _typed_value(raw: str, schema: Any) -> Any:
    """An XML-form argument's text as the value its schema's type asks for (module docstring)."""
    import ast

    if raw.lower() == "null":
        return None
    if schema is None:  # an argument the tool's schema does not name
        return raw
    kind = (_schema_kind(schema) or "string").lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return raw
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(raw)
        if kind.startswith(("num", "float")):
            x = float(raw)
            return int(x) if x.is_integer() and "." not in raw and "e" not in raw.lower() else x
    except ValueError:
        return raw
    if kind in ("boolean", "bool", "binary"):
        return raw.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            pass
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw


def _tool_properties(tools: list[dict], name: str) -> dict | None:
    """The argument schemas of tool ``name`` (its parameters' ``properties``, or those of
    their ``anyOf`` / ``oneOf`` / ``allOf`` branches), None for an undeclared tool."""
    def props(schema):
        if not isinstance(schema, dict):
            return {}
        if isinstance(schema.get("properties"), dict):
            return schema["properties"]
        merged: dict = {}
        for key in ("anyOf", "oneOf", "allOf"):
            for branch in schema.get(key) or []:
                for k, v in props(branch).items():
                    merged.setdefault(k, v)
        return merged

    params = _tool_parameters(tools, name)
    return None if params is None else props(params)


def _xml_calls(text: str, tools: list[dict]) -> list[dict]:
    """Qwen3.5 / Qwen3-Coder's ``<function=NAME><parameter=K>V</parameter>...</function>``
    calls in ``text``'s ``<tool_call>`` blocks (an unclosed last function or parameter is read
    to the end; a parameter also ends where the next one or the function's end begins)."""
    import re

    blocks = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
    if not blocks and "<function=" in text:  # the block never closed: the calls are read to the end
        blocks = [text]
    calls = []
    for block in blocks:
        for closed, open_ in re.findall(r"<function=(.*?)</function>|<function=(.*)$", block, re.DOTALL):
            name, sep, body = (closed or open_).partition(">")
            if not sep:
                continue
            props = _tool_properties(tools, name)
            args: dict[str, Any] = {}
            for param in re.findall(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", body,
                                    re.DOTALL):
                key, sep, value = param.partition(">")
                if not sep:
                    continue
                value = value[1:] if value.startswith("\n") else value  # the lines around the value
                value = value[:-1] if value.endswith("\n") else value
                args[key] = _typed_value(value, None if props is None else props.get(key))
            calls.append({"name": name, "arguments": args})
    return calls


def parse_tool_calls(text: str, fmt: str, tools: list[dict]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a model's output text in format ``fmt`` (module docstring)."""
    idx = text.find(TOOL_CALL_START)
    if idx == -1:
        return text, []
    if fmt == "qwen3_coder":  # SGLang keeps every call and the content unstripped
        return text[:idx], [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                            for c in _xml_calls(text, tools)]
    try:
        found = _hermes_calls(text) if fmt == "hermes" else _glm_calls(text, tools)
    except (json.JSONDecodeError, AttributeError, TypeError):
        return text, []
    declared = {(t.get("function") or {}).get("name") for t in tools}
    calls = [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in found
             if c["name"] in declared]
    return text[:idx].strip(), calls


# --- an episode's conversation, continued token for token ------------------------------------
@dataclass
class Ask:
    """A chat request's conversation, with the comparable forms that continuing it checks and
    recording it keeps (each computed once per request)."""

    messages: list[dict]
    tools: list[dict] | None = None
    template_kwargs: dict | None = None

    @cached_property
    def canonical(self) -> list[str]:
        return [canonical(m) for m in self.messages]

    @cached_property
    def tools_key(self) -> str:
        return fingerprint(self.tools)

    @cached_property
    def kwargs_key(self) -> str:
        return fingerprint(self.template_kwargs)


@dataclass
class Turn:
    """One answered chat request of an episode: what it was asked and what it returned."""

    messages: list[str]  # canonical() of each message
    tools: str
    template_kwargs: str
    prompt_ids: list[int]
    output_ids: list[int]
    returned: str  # canonical() of the assistant message returned for it
    record: int  # index of its record in the episode
    prompt_text: str | None = None  # the template's text of its messages (with the generation prompt)

    @classmethod
    def answered(cls, ask: Ask, prompt_ids: list[int], output_ids: list[int], returned: dict, record: int = 0,
                 prompt_text: str | None = None) -> "Turn":
        return cls(ask.canonical, ask.tools_key, ask.kwargs_key, prompt_ids, output_ids, canonical(returned), record,
                   prompt_text)


def continuation(tokenizer, turn: Turn, ask: Ask, stop_texts: list[str]) -> tuple[list[int], str] | None:
    """The prompt ids of ``ask``'s messages continuing ``turn`` token for token (and the
    template's text of them), or None when they do not continue it (other history, other
    tools) or the template renders them in a way that does not extend the earlier prompt's text.

    ``messages[:k]`` must be ``turn``'s messages and ``messages[k]`` the assistant message it
    returned. With A = render(messages[:k], generation prompt) (``turn.prompt_text``) and
    F = render(messages, generation prompt), F must extend A; the ids are turn.prompt_ids +
    turn.output_ids + encode(rest), rest being the text the template puts after the model's
    output. Where F continues A with the output's text itself, rest is the remainder of F (one
    render). Where the template writes the model's turn otherwise (re-serialised calls,
    dropped text), P = render(messages[:k+1]) must extend A and F extend P; the turn is cut at
    its end token in P (``stop_texts``: the text of the tokens that end a model turn) and rest
    is what follows it there, then F after P."""
    k, messages, tools, kwargs = len(turn.messages), ask.messages, ask.tools, ask.template_kwargs
    if len(messages) <= k or turn.tools != ask.tools_key or turn.template_kwargs != ask.kwargs_key:
        return None
    if ask.canonical[:k] != turn.messages or ask.canonical[k] != turn.returned:
        return None
    tm = template_messages(messages)
    a = turn.prompt_text
    if a is None:
        a = render(tokenizer, tm[:k], tools, add_generation_prompt=True, template_kwargs=kwargs)
    f = render(tokenizer, tm, tools, add_generation_prompt=True, template_kwargs=kwargs)
    if not f.startswith(a):
        return None
    out_text = tokenizer.decode(turn.output_ids, skip_special_tokens=False)
    if f.startswith(out_text, len(a)):  # the template writes the output as sampled: the rest is new text
        return list(turn.prompt_ids) + list(turn.output_ids) + encode(tokenizer, f[len(a) + len(out_text):]), f
    p = render(tokenizer, tm[: k + 1], tools, add_generation_prompt=False, template_kwargs=kwargs)
    if not (p.startswith(a) and f.startswith(p)):
        return None
    written = p[len(a):]  # the assistant turn as the template writes it: cut at its end token
    ends = [(written.rfind(s), s) for s in stop_texts if s and s in written]
    if not ends:
        return None
    pos, stop = max(ends)
    closing = written[pos + len(stop):] if out_text.endswith(stop) else written[pos:]
    return list(turn.prompt_ids) + list(turn.output_ids) + encode(tokenizer, closing + f[len(p):]), f


def fingerprint(v: Any) -> str:
    """A comparable string of tools / template arguments."""
    return _COMPARABLE.encode(v)

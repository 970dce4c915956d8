"""OpenAI-compatible endpoints of the embedded engine, as SGLang serves them, and the
per-episode recording that agent rollouts are built from (DESIGN.md contract 10).

Endpoints (field names and behaviour read from sglang 0.5.23's ``entrypoints/openai``):

* ``GET /v1/models``: the one model served (its id: model.path, or ``default``).
* ``POST /v1/chat/completions``: messages through the tokenizer's chat template (``chat``),
  ``tools`` rendered by the template and tool calls parsed in the model family's format
  (Qwen3-MoE, Qwen3-Next: hermes ``<tool_call>`` JSON; GLM-4.5: its ``<arg_key>/<arg_value>``
  form; Qwen3.5 and the Qwen3-Coder releases: ``<function=...><parameter=...>`` XML);
  ``stream`` (server-sent events, ``stream_options.include_usage``), ``logprobs`` /
  ``top_logprobs``, ``n``, ``stop``, ``max_tokens`` / ``max_completion_tokens`` (default: the
  rest of the context), ``seed`` (choice i of n samples with seed + i), ``temperature``,
  ``top_p`` and SGLang's ``top_k``, ``min_p``, penalties, ``stop_token_ids``, ``ignore_eos``,
  ``return_token_ids`` / ``return_prompt_token_ids`` (choices' ``response_token_ids`` /
  ``prompt_token_ids``). Unset sampling fields take the model's generation_config.json
  values, then OpenAI's defaults. ``finish_reason`` is ``tool_calls`` when a call was parsed
  from a stopped output.
* ``POST /v1/completions``: ``prompt`` as text, texts, ids or lists of ids; ``logprobs: k``
  (tokens, token_logprobs, top_logprobs, text_offset); ``max_tokens`` default 16.
* Errors: HTTP 400 / 404 / 503 with OpenAI's body ``{"error": {"message", "type", "param",
  "code"}}``; constraints this engine cannot honour (``response_format`` other than text,
  ``logit_bias``, ``tool_choice`` other than auto/none, ``echo``, ``suffix``, ``best_of``)
  are refused, never ignored.

Episodes: ``POST /episodes`` registers an episode (its sampling settings, seed, token budgets,
whether to record routing), or several with the same settings (``id`` and ``seed`` lists: a
GRPO group in one request); ``/episodes/{id}/v1/...`` then serves the same endpoints and
records every call: prompt ids, output ids, log-probs, the weight version of each token and
the routing rows (``meta_info.routed_experts``, from ``routing_start``). ``GET`` / ``DELETE
/episodes/{id}`` return the records (DELETE forgets the episode); ``POST /episodes/collect``
with ``{"ids": [...]}`` returns and forgets several. With the records comes ``engine_errors``:
the messages of the episode's calls that failed on the engine's side (a 5xx: the engine not
running or unreachable, its queue full), so the runner can keep new episodes off it. Inside an
episode:

* sampling is the run's (temperature, top_p, top_k; no penalties); the agent's ``max_tokens``
  is capped by the episode's per-call and whole-episode budgets; its ``seed`` is replaced by
  the episode's (seed, call, choice), so a run is reproducible;
* a chat request that repeats an earlier request's messages plus the assistant message
  returned for it continues that prompt token for token (``chat.continuation``): the record
  names that earlier call as its ``parent`` and its routing starts where the parent's ended;
* a call cut short by a weight update (pause mode ``abort``) is resubmitted with its partial
  output once the engine continues, so the agent sees one answer and the record one call
  whose tokens carry the versions that produced them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import chat
from . import protocol as P
from .protocol import BODY, RequestError

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default"  # SGLang's name when no model path is served
# the abort messages of a weight update (Engine.pause, the server's update endpoints): an
# episode's call resumes after them; any other abort ends the call
_UPDATE_ABORTS = ("Aborted by pause_generation", "Aborted for a weight")
_GEN_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_IDS = random.Random()  # seeded from os.urandom; ids need uniqueness, not secrecy (uuid4 is a syscall a call)


def _hex_id(digits: int) -> str:
    """A random id of ``digits`` hex digits (response, request and tool-call ids)."""
    return f"{_IDS.getrandbits(4 * digits):0{digits}x}"


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(status, "server_error")
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status=status)


# --- requests ------------------------------------------------------------------------------
class _Request(BaseModel):
    """Fields both endpoints share (OpenAI's, then SGLang's extensions). Unknown fields that
    change nothing here (``user``, ``metadata``, ``store`` ...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = DEFAULT_MODEL_NAME
    max_tokens: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    # SGLang's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    return_token_ids: bool = False
    return_prompt_token_ids: bool = False
    # constraints: refused unless neutral
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    response_format: dict | None = None


class ChatRequest(_Request):
    messages: list[dict] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=0)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    chat_template_kwargs: dict | None = None
    functions: list | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def _parse(cls, body: Any):
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise OpenAIError(400, f"{param}: {err['msg']}" if param else err["msg"], param) from None
    refuse = []
    if req.logit_bias:
        refuse.append("logit_bias")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        refuse.append("response_format")
    refuse += [k for k in ("regex", "ebnf", "json_schema") if getattr(req, k)]
    if isinstance(req, ChatRequest):
        if req.functions:
            refuse.append("functions")
        if req.tool_choice not in (None, "auto", "none"):
            refuse.append("tool_choice")
    else:
        if req.echo:
            refuse.append("echo")
        if req.suffix:
            refuse.append("suffix")
        if req.best_of not in (None, 1):
            refuse.append("best_of")
    if refuse:
        raise OpenAIError(400, f"{refuse[0]}: {getattr(req, refuse[0])!r} is not supported by the embedded engine "
                          "(moe-rl serve)", refuse[0])
    return req


# --- episodes --------------------------------------------------------------------------------
@dataclass
class Episode:
    """One agent episode's settings and records (the module docstring's "Episodes")."""

    id: str
    sampling: dict  # temperature, top_p, top_k the episode samples with
    seed: int
    routing: bool  # record routed_experts
    max_tokens: int | None  # per call
    max_total: int | None  # prompt + output of any one call
    expires: float
    records: list[dict] = field(default_factory=list)
    turns: list[chat.Turn] = field(default_factory=list)
    calls: int = 0
    engine_errors: list[str] = field(default_factory=list)  # calls that failed with a 5xx

    @classmethod
    def parse(cls, body: Any) -> list["Episode"]:
        """The episodes of a ``POST /episodes`` body: one (``id`` a string, ``seed`` an int) or
        several sharing the settings (``id`` a list of strings, ``seed`` a list as long)."""
        ids = body.get("id") if isinstance(body, dict) else None
        many = isinstance(ids, list)
        ids = ids if many else [ids]
        if not ids or not all(isinstance(i, str) and i for i in ids) or len(set(ids)) < len(ids):
            raise OpenAIError(400, "id: required (a string, or a list of distinct strings)", "id")
        seeds = body.get("seed")
        if not many or seeds is None:
            seeds = [seeds] * len(ids)
        if not isinstance(seeds, list) or len(seeds) != len(ids) or not all(
                s is None or (isinstance(s, int) and not isinstance(s, bool)) for s in seeds):
            raise OpenAIError(400, "seed: an integer (a list of one per id when id is a list)", "seed")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict) or set(sp) - {"temperature", "top_p", "top_k"}:
            raise OpenAIError(400, "sampling_params: an object with temperature, top_p, top_k", "sampling_params")
        for key in ("max_tokens", "max_total_tokens"):
            v = body.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise OpenAIError(400, f"{key}: a positive integer or null", key)
        expires = time.monotonic() + float(body.get("ttl_s") or 3600.0)
        return [cls(id=i, sampling=dict(sp), seed=int(seed or 0), routing=bool(body.get("return_routed_experts")),
                    max_tokens=body.get("max_tokens"), max_total=body.get("max_total_tokens"), expires=expires)
                for i, seed in zip(ids, seeds)]

    def call_seed(self, call: int, choice: int) -> int:
        return int(np.random.SeedSequence([self.seed, call, choice]).generate_state(1)[0] & 0x7FFFFFFF)


# --- one choice's output, over the segments a weight update may cut it into -------------------
@dataclass
class _Output:
    prompt: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list] = field(default_factory=list)  # per token: [[lp, id, None], ...]
    versions: list[str] = field(default_factory=list)
    finish: dict | None = None
    segments: list[dict] = field(default_factory=list)  # routing: {"start", "meta_info"}

    def add(self, res: dict, start: int, final: bool) -> "_Output":
        """This output with segment ``res`` (an engine response) appended; ``final``: in place."""
        out = self if final else dataclasses.replace(self, output_ids=list(self.output_ids), logprobs=list(self.logprobs),
                                                     top=list(self.top), versions=list(self.versions))
        meta = res["meta_info"]
        new = list(res["output_ids"])
        out.output_ids += new
        out.logprobs += P.output_logprobs(meta)[: len(new)]
        out.top += (meta.get("output_top_logprobs") or [])[: len(new)]
        out.versions += list(P.token_weight_versions(meta) or [meta["weight_version"]] * len(new))[: len(new)]
        if final:
            out.finish = meta.get("finish_reason")
            if new and "routed_experts" in meta:
                out.segments.append({"start": start, "meta_info": {k: meta[k] for k in (
                    "routed_experts", "prompt_tokens", "completion_tokens")}})
        return out

    def engine_dict(self) -> dict:
        """The SGLang-shaped answer of the whole output (for the text codec)."""
        return {"output_ids": self.output_ids, "meta_info": {
            "finish_reason": self.finish,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(self.logprobs, self.output_ids)],
            "output_top_logprobs": self.top}}


def _is_update_abort(finish: dict | None, messages: tuple[str, ...]) -> bool:
    return bool(finish) and finish.get("type") == "abort" and not finish.get("status_code") and \
        str(finish.get("message", "")).startswith(messages)


FRESH_RENDERS = 256  # conversations whose fresh render is kept (a few steps' prompts)


# --- the endpoints ---------------------------------------------------------------------------
class OpenAIServer:
    """The OpenAI-compatible handlers of one ``EngineServer`` (see the module docstring)."""

    def __init__(self, server):
        self.server = server
        self.engine = server.engine
        # the abort messages a weight update gives (an engine behind HTTP names its server's too)
        self.update_aborts = getattr(self.engine, "update_aborts", _UPDATE_ABORTS)
        self.text = server.text  # TextCodec or None
        self.tokenizer = self.text.tokenizer if self.text is not None else None
        self.model_name = self.engine.model_path or DEFAULT_MODEL_NAME
        # None: a family whose tool-call format is not parsed here (chat without tools still works)
        self.tool_format = chat.tool_format(self.engine.arch.model_type,
                                            getattr(self.tokenizer, "chat_template", None))
        self.defaults = _generation_defaults([self.engine.model_path, getattr(self.engine, "tokenizer_path", None)])
        self.stop_texts = ([self.tokenizer.decode([t], skip_special_tokens=False) for t in sorted(server.eos_token_ids)]
                           if self.tokenizer is not None else [])
        self.episodes: dict[str, Episode] = {}
        # conversation -> (prompt ids, text) of a fresh render: a GRPO group's episodes all open
        # with the same messages and tools, rendered and encoded once instead of group_size times
        self.fresh: OrderedDict[str, tuple[list[int], str]] = OrderedDict()

    def register(self, app: web.Application) -> None:
        r = app.router
        for prefix in ("", "/episodes/{eid}"):
            r.add_get(prefix + "/v1/models", self.models)
            r.add_post(prefix + "/v1/chat/completions", self.chat_completions)
            r.add_post(prefix + "/v1/completions", self.completions)
        r.add_post("/episodes", self.register_episode)
        r.add_post("/episodes/collect", self.collect_episodes)
        r.add_get("/episodes/{eid}", self.episode_records)
        r.add_delete("/episodes/{eid}", self.episode_records)

    # --- episodes --------------------------------------------------------------------------
    async def register_episode(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            eps = Episode.parse(body)
        except OpenAIError as e:
            return error_response(e.status, e.message, e.param)
        now = time.monotonic()
        for eid in [k for k, v in self.episodes.items() if v.expires < now]:  # never collected: dropped
            log.warning("episode %s expired with %d records never collected", eid, len(self.episodes[eid].records))
            del self.episodes[eid]
        taken = [ep.id for ep in eps if ep.id in self.episodes]
        if taken:  # none of them is registered then
            return error_response(400, f"episode {taken[0]!r} is already registered", "id")
        self.episodes.update((ep.id, ep) for ep in eps)
        return web.json_response({"id": body["id"]})

    async def episode_records(self, request: web.Request) -> web.Response:
        eid = request.match_info["eid"]
        ep = self.episodes.pop(eid, None) if request.method == "DELETE" else self.episodes.get(eid)
        if ep is None:
            return error_response(404, f"no episode {eid!r} (never registered, or already collected)")
        return web.json_response({"id": ep.id, "records": ep.records, "engine_errors": ep.engine_errors})

    async def collect_episodes(self, request: web.Request) -> web.Response:
        """``POST /episodes/collect {"ids": [...]}``: the records of several episodes, which are
        then forgotten (DELETE for many); an unknown id gets an ``error`` instead of records."""
        try:
            ids = (await _body(request)).get("ids")
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise OpenAIError(400, "ids: a list of episode ids", "ids")
        except (OpenAIError, AttributeError) as e:
            e = e if isinstance(e, OpenAIError) else OpenAIError(400, "the body must be a JSON object")
            return error_response(e.status, e.message, e.param)
        out = []
        for eid in ids:
            ep = self.episodes.pop(eid, None)
            out.append({"id": eid, "records": ep.records, "engine_errors": ep.engine_errors} if ep is not None else
                       {"id": eid, "error": f"no episode {eid!r} (never registered, or already collected)"})
        return web.json_response({"episodes": out})

    def _episode(self, request: web.Request) -> Episode | None:
        eid = request.match_info.get("eid")
        if eid is None:
            return None
        ep = self.episodes.get(eid)
        if ep is None:
            raise OpenAIError(404, f"no episode {eid!r} (register it with POST /episodes)")
        return ep

    # --- /v1/models ------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        try:
            self._episode(request)
        except OpenAIError as e:
            return error_response(e.status, e.message, e.param)
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "moe-rl",
            "root": self.model_name, "parent": None, "max_model_len": self.engine.max_context}]})

    # --- /v1/chat/completions ----------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            ep = self._episode(request)
            req = _parse(ChatRequest, await _body(request))
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                raise OpenAIError(400, "the engine has no tokenizer with a chat template (model.path / "
                                  "model.tokenizer_path); use /v1/completions with token ids or /generate", "messages")
            use_tools = bool(req.tools) and req.tool_choice != "none"
            if use_tools and self.tool_format is None:
                raise OpenAIError(400, f"tool calls of model_type={self.engine.arch.model_type!r} are not parsed "
                                  f"(supported: {sorted(chat.TOOL_FORMATS)}); send the request without tools", "tools")
            tools = req.tools if use_tools else None
            ask = chat.Ask(req.messages, tools, req.chat_template_kwargs)
            prompt, parent, prompt_text = self._chat_prompt(ep, ask)
            gens = self._requests(req, [prompt], ep, parent, max_tokens=req.max_completion_tokens or req.max_tokens,
                                  top_n=(req.top_logprobs or 0) if req.logprobs else 0,
                                  skip_special=False if use_tools else req.skip_special_tokens)
        except OpenAIError as e:
            return error_response(e.status, e.message, e.param)
        shape = _ChatShape(self, req, tools)
        shape.ask, shape.prompt_text = ask, prompt_text
        return await self._respond(request, req, gens, ep, parent, shape)

    def _chat_prompt(self, ep: Episode | None, ask: chat.Ask) -> tuple[list[int], int | None, str]:
        """(prompt ids, the record it continues or None, the template's text of the messages)."""
        messages, tools, kwargs = ask.messages, ask.tools, ask.template_kwargs
        try:
            if ep is not None:
                for turn in reversed(ep.turns):
                    found = chat.continuation(self.tokenizer, turn, ask, self.stop_texts)
                    if found is not None:
                        return found[0], turn.record, found[1]
            key = chat.fingerprint([messages, tools, kwargs])
            if key in self.fresh:
                self.fresh.move_to_end(key)
                ids, text = self.fresh[key]
                return list(ids), None, text
            text = chat.render(self.tokenizer, chat.template_messages(messages), tools, add_generation_prompt=True,
                               template_kwargs=kwargs)
        except (ValueError, TypeError, KeyError) as e:
            raise OpenAIError(400, f"messages: the chat template failed: {type(e).__name__}: {e}", "messages") from None
        except Exception as e:  # jinja2's TemplateError (raise_exception in a template) is the request's fault
            if type(e).__module__.startswith("jinja2"):
                raise OpenAIError(400, f"messages: the chat template failed: {e}", "messages") from None
            raise
        ids = chat.encode(self.tokenizer, text)
        self.fresh[key] = (ids, text)
        if len(self.fresh) > FRESH_RENDERS:
            self.fresh.popitem(last=False)
        return list(ids), None, text

    # --- /v1/completions ---------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            ep = self._episode(request)
            req = _parse(CompletionRequest, await _body(request))
            p = req.prompt
            if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(x, str) for x in p)):
                if self.text is None:
                    raise OpenAIError(400, "prompt: the engine has no tokenizer; send token ids", "prompt")
                prompts = [self.text.encode(s) for s in ([p] if isinstance(p, str) else p)]
            elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
                prompts = [list(p)]
            elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
                prompts = [list(x) for x in p]
            else:
                raise OpenAIError(400, "prompt: a string, a list of strings, a list of token ids or a list of "
                                  "lists of token ids", "prompt")
            gens = self._requests(req, prompts, ep, None, max_tokens=req.max_tokens, top_n=req.logprobs or 0,
                                  skip_special=req.skip_special_tokens)
        except OpenAIError as e:
            return error_response(e.status, e.message, e.param)
        return await self._respond(request, req, gens, ep, None, _CompletionShape(self, req))

    # --- generation ------------------------------------------------------------------------
    def _requests(self, req: _Request, prompts: list[list[int]], ep: Episode | None, parent: int | None, *,
                  max_tokens: int | None, top_n: int, skip_special: bool) -> list[P.GenerateRequest]:
        """One engine request per (prompt, choice), validated as /generate validates its own."""
        server = self.server
        limits = dict(vocab_size=self.engine.arch.vocab_size, max_context=self.engine.max_context,
                      eos_token_ids=server.eos_token_ids, adapter=getattr(self.engine, "adapter_name", None),
                      token_count=self.text.token_count if self.text is not None else None)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        base = _hex_id(32)
        call = None
        if ep is not None:
            call, ep.calls = ep.calls, ep.calls + 1
        out = []
        for i, prompt in enumerate(prompts):
            room = self.engine.max_context - len(prompt)
            mt = room if max_tokens is None else max_tokens
            if ep is not None:
                mt = min(mt, ep.max_tokens or mt, (ep.max_total - len(prompt)) if ep.max_total else mt)
                if mt < 1:
                    raise OpenAIError(400, f"the episode's token budget is spent: the prompt has {len(prompt)} tokens "
                                      f"(env.max_episode_tokens={ep.max_total})", "messages")
            sp = {"max_new_tokens": max(0, min(mt, room)), "stop": stop, "stop_token_ids": req.stop_token_ids or [],
                  "ignore_eos": req.ignore_eos, "skip_special_tokens": skip_special, "no_stop_trim": req.no_stop_trim,
                  "min_new_tokens": min(req.min_tokens, max(0, mt))}
            if ep is not None:  # the run's sampling, no logit processing: the trainer's log-probs match
                sp.update(ep.sampling, min_new_tokens=0)
            else:
                for key in _GEN_CONFIG_KEYS:
                    v = getattr(req, key)
                    sp[key] = v if v is not None else self.defaults.get(key, _OPENAI_DEFAULTS[key])
                sp.update(presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty)
            for j in range(req.n):
                k = i * req.n + j
                seed = ep.call_seed(call, k) if ep is not None else (req.seed + j if req.seed is not None else None)
                body = {"input_ids": prompt, "sampling_params": {**sp, "sampling_seed": seed},
                        "rid": f"{base}-{k}", "return_logprob": True, "top_logprobs_num": top_n,
                        "return_routed_experts": ep is not None and ep.routing,
                        "routed_experts_start_len": self._routing_start(ep, parent)}
                try:
                    out.append(P.GenerateRequest.parse(body, **limits))
                except RequestError as e:
                    name = {"input_ids": "messages" if isinstance(req, ChatRequest) else "prompt"}.get(e.field, e.field)
                    raise OpenAIError(400, f"{name}: {e.message}", name) from None
        if not self.engine.alive:
            raise OpenAIError(503, f"engine is not running: {self.engine.error}")
        return out

    @staticmethod
    def _routing_start(ep: Episode | None, parent: int | None) -> int:
        """Routing rows before the parent's last token are in the parent's record."""
        if ep is None or parent is None or not ep.routing:
            return 0
        rec = ep.records[parent]
        return len(rec["prompt_ids"]) + len(rec["output_ids"]) - 1

    async def _run(self, req: P.GenerateRequest, ep: Episode | None, on_update=None) -> _Output:
        """One choice to its end; in an episode a weight update's abort is resubmitted with the
        partial output, and a failure on the engine's side is noted in ``ep.engine_errors``
        (module docstring). ``on_update(output so far)`` while streaming."""
        try:
            return await self._run_choice(req, ep is not None, on_update)
        except OpenAIError as e:
            if ep is not None and e.status >= 500:
                ep.engine_errors.append(e.message)
            raise

    async def _run_choice(self, req: P.GenerateRequest, resume: bool, on_update) -> _Output:
        loop = asyncio.get_running_loop()
        acc = _Output(prompt=list(req.input_ids))
        seg, start, k = req, req.routed_experts_start_len, 0
        while True:
            queue: asyncio.Queue = asyncio.Queue()

            def push(item, final=False, q=queue):
                loop.call_soon_threadsafe(q.put_nowait, (item, final))

            try:
                rid = self.engine.submit(seg, lambda res, p=push: p(res, True),
                                         on_update=push if on_update is not None else None)
            except RuntimeError as e:
                raise OpenAIError(503, str(e)) from None
            try:
                while True:
                    res, final = await queue.get()
                    if final:
                        break
                    on_update(acc.add(res, start, final=False))
            except asyncio.CancelledError:
                self.engine.abort(rid, "client disconnected")
                raise
            acc.add(res, start, final=True)
            finish = acc.finish or {}
            if finish.get("type") == "abort" and (finish.get("status_code") or 0) >= 400:
                raise OpenAIError(int(finish["status_code"]), str(finish.get("message")))
            left = req.sampling_params.max_new_tokens - len(acc.output_ids)
            if not (resume and _is_update_abort(finish, self.update_aborts) and left > 0):
                return acc
            k += 1
            if res["output_ids"]:
                start = len(acc.prompt) + len(acc.output_ids) - 1
            sp = dataclasses.replace(req.sampling_params, max_new_tokens=left,
                                     min_new_tokens=max(0, req.sampling_params.min_new_tokens - len(acc.output_ids)),
                                     sampling_seed=None if req.sampling_params.sampling_seed is None
                                     else req.sampling_params.sampling_seed + len(acc.output_ids))
            seg = dataclasses.replace(req, input_ids=acc.prompt + acc.output_ids, sampling_params=sp,
                                      rid=f"{req.rid}-r{k}", routed_experts_start_len=start)

    def _record(self, ep: Episode, out: _Output, parent: int | None, choice: int) -> int:
        ep.records.append({
            "prompt_ids": out.prompt, "output_ids": out.output_ids, "output_logprobs": out.logprobs,
            "output_versions": out.versions, "finish_reason": out.finish, "parent": parent, "choice": choice,
            "routing": out.segments if ep.routing else None})
        return len(ep.records) - 1

    async def _respond(self, request, req, gens, ep, parent, shape) -> web.StreamResponse:
        if req.stream:
            return await self._stream(request, req, gens, ep, parent, shape)
        try:
            outs = await asyncio.gather(*(self._run(g, ep) for g in gens))
        except OpenAIError as e:
            return error_response(e.status, e.message, e.param)
        body = shape.response(gens, outs)
        if ep is not None:
            self._keep(ep, req, shape, outs, parent)
        return web.json_response(body)

    def _keep(self, ep: Episode, req, shape, outs: list[_Output], parent) -> None:
        for i, out in enumerate(outs):
            rec = self._record(ep, out, parent, i)
            if isinstance(req, ChatRequest):
                ep.turns.append(chat.Turn.answered(shape.ask, out.prompt, out.output_ids, shape.messages[i], rec,
                                                   shape.prompt_text))

    async def _stream(self, request, req, gens, ep, parent, shape) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        events: asyncio.Queue = asyncio.Queue()

        async def one(i, g):
            try:
                out = await self._run(g, ep, on_update=lambda o: events.put_nowait((i, o, False)))
                events.put_nowait((i, out, True))
            except OpenAIError as e:
                events.put_nowait((i, e, True))

        tasks = [asyncio.create_task(one(i, g)) for i, g in enumerate(gens)]
        outs: list[_Output | None] = [None] * len(gens)
        try:
            for chunk in shape.start():
                await resp.write(_sse(chunk))
            while any(o is None for o in outs):
                i, item, final = await events.get()
                if isinstance(item, OpenAIError):
                    await resp.write(_sse({"error": {"message": item.message, "type": "server_error", "param": None,
                                                     "code": item.status}}))
                    break
                for chunk in shape.delta(i, gens[i], item, final):
                    await resp.write(_sse(chunk))
                if final:
                    outs[i] = item
            else:
                for chunk in shape.end(gens, outs):
                    await resp.write(_sse(chunk))
                if ep is not None:
                    self._keep(ep, req, shape, outs, parent)
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            for t in tasks:
                t.cancel()
            raise
        finally:
            for t in tasks:
                t.cancel()
        return resp


_OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def _generation_defaults(paths) -> dict:
    """Sampling defaults from a generation_config.json (SGLang's preferred sampling params)."""
    for p in paths:
        f = Path(p) / "generation_config.json" if p else None
        if f is not None and f.is_file():
            cfg = json.loads(f.read_text())
            return {k: cfg[k] for k in _GEN_CONFIG_KEYS if cfg.get(k) is not None}
    return {}


async def _body(request: web.Request) -> Any:
    """The body the server's middleware read and parsed (``limits``: size, time and JSON checks)."""
    if BODY in request:
        return request[BODY]
    raise OpenAIError(400, "the request has no JSON body")


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _usage(gens: list[P.GenerateRequest], outs: list[_Output], n: int) -> dict:
    prompt = sum(len(g.input_ids) for g in gens[::n])
    completion = sum(len(o.output_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(out: _Output) -> str | None:
    f = out.finish or {}
    return f.get("type")


# --- response shapes ---------------------------------------------------------------------------
class _Shape:
    """Builds one endpoint's bodies and stream chunks from the engine's outputs."""

    def __init__(self, api: OpenAIServer, req):
        self.api, self.req = api, req
        self.id = f"{self.prefix}-{_hex_id(32)}"
        self.created = int(time.time())
        self.sent: dict[int, int] = {}  # choice -> characters of text sent
        self.sent_tokens: dict[int, int] = {}

    def text(self, g: P.GenerateRequest, out: _Output, final: bool) -> str:
        if self.api.text is None:
            return ""
        sp = g.sampling_params
        return self.api.text.output_text(g.input_ids, out.output_ids, out.finish if final else None,
                                         sp.skip_special_tokens, sp.spaces_between_special_tokens, sp.no_stop_trim)

    def token_texts(self, ids: list[int]) -> list[str]:
        if self.api.tokenizer is None:
            return [str(i) for i in ids]
        return self.api.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.req.model,
                "choices": choices, **extra}

    def start(self) -> list[dict]:
        return []

    def streamable(self, g, out: _Output, final: bool) -> str:
        """The text of a choice that may be sent now: held back while it could still become
        a stop string or (chat with tools) a tool call, or ends inside a UTF-8 character."""
        text = self.text(g, out, final)
        if final:
            return text
        text = text.rstrip("\ufffd")
        hold = max((len(s) for s in g.sampling_params.stop_strs), default=1) - 1
        return text[: len(text) - hold] if hold else text

    def with_ids(self, choice: dict, g, out: _Output, output_key: str) -> dict:
        """A choice with SGLang's return_token_ids / return_prompt_token_ids fields."""
        if self.req.return_token_ids or self.req.return_prompt_token_ids:
            choice["prompt_token_ids"] = g.input_ids
        if self.req.return_token_ids:
            choice[output_key] = out.output_ids
        return choice

    def body(self, obj: str, gens, outs, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model, "choices": choices,
                "usage": _usage(gens, outs, self.req.n)}

    def end(self, gens, outs) -> list[dict]:
        opts = self.req.stream_options or {}
        if opts.get("include_usage"):
            return [self.chunk([], usage=_usage(gens, outs, self.req.n))]
        return []


class _ChatShape(_Shape):
    prefix, chunk_object = "chatcmpl", "chat.completion.chunk"

    def __init__(self, api, req: ChatRequest, tools):
        super().__init__(api, req)
        self.tools = tools
        self.messages: dict[int, dict] = {}  # choice -> the assistant message returned

    def message(self, g, out: _Output) -> tuple[dict, str | None]:
        text = self.text(g, out, True)
        finish = _finish_reason(out)
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools:  # as SGLang: the content is the text before the calls, also when no call parsed
            content, calls = chat.parse_tool_calls(text, self.api.tool_format, self.tools)
            msg["content"] = content
            if calls:
                msg = {"role": "assistant", "content": content, "tool_calls": [
                    {"id": f"call_{_hex_id(24)}", "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
                if finish == "stop":
                    finish = "tool_calls"
        return msg, finish

    def logprobs(self, out: _Output, lo: int, hi: int) -> dict:
        ids = out.output_ids[lo:hi]
        texts = self.token_texts(ids)
        tops = out.top[lo:hi] if self.req.top_logprobs else [[] for _ in ids]
        top_texts = self.token_texts([t[1] for row in tops for t in row or []])
        content, n = [], 0
        for tok, lp, row in zip(texts, out.logprobs[lo:hi], tops):
            top = []
            for t in row or []:
                top.append({"token": top_texts[n], "logprob": t[0], "bytes": list(top_texts[n].encode())})
                n += 1
            content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": top})
        return {"content": content}

    def response(self, gens, outs) -> dict:
        choices = []
        for i, (g, out) in enumerate(zip(gens, outs)):
            msg, finish = self.message(g, out)
            self.messages[i] = msg
            choice = {"index": i, "message": msg,
                      "logprobs": self.logprobs(out, 0, len(out.output_ids)) if self.req.logprobs else None,
                      "finish_reason": finish, "matched_stop": (out.finish or {}).get("matched")}
            choices.append(self.with_ids(choice, g, out, "response_token_ids"))
        return self.body("chat.completion", gens, outs, choices)

    def start(self) -> list[dict]:
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(self.req.n)]

    def streamable(self, g, out, final):
        text = super().streamable(g, out, final)
        if self.tools:  # a tool call is sent whole, at the end
            idx = text.find(chat.TOOL_CALL_START)
            if idx != -1:
                return text[:idx] if not final else text
            if not final:
                for k in range(len(chat.TOOL_CALL_START) - 1, 0, -1):
                    if text.endswith(chat.TOOL_CALL_START[:k]):
                        return text[:-k]
        return text

    def delta(self, i: int, g, out: _Output, final: bool) -> list[dict]:
        chunks = []
        text = self.streamable(g, out, final)
        finish = None
        if final:
            msg, finish = self.message(g, out)
            self.messages[i] = msg
            text = msg["content"] if self.tools else text  # the tool-call text is never streamed as content
        sent, lo = self.sent.get(i, 0), self.sent_tokens.get(i, 0)
        piece = text[sent:] if len(text) > sent else ""
        hi = len(out.output_ids)
        lps = self.logprobs(out, lo, hi) if self.req.logprobs and hi > lo else None
        if piece or lps:
            chunks.append(self.chunk([{"index": i, "delta": {"content": piece}, "logprobs": lps, "finish_reason": None}]))
            self.sent[i], self.sent_tokens[i] = sent + len(piece), hi
        if final:
            if msg.get("tool_calls"):
                calls = [{"index": j, **c} for j, c in enumerate(msg["tool_calls"])]
                chunks.append(self.chunk([{"index": i, "delta": {"tool_calls": calls}, "logprobs": None,
                                           "finish_reason": None}]))
            chunks.append(self.chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish,
                                       "matched_stop": (out.finish or {}).get("matched")}]))
        return chunks


class _CompletionShape(_Shape):
    prefix, chunk_object = "cmpl", "text_completion"

    def logprobs(self, out: _Output, lo: int, hi: int, offset: int) -> dict:
        ids = out.output_ids[lo:hi]
        texts = self.token_texts(ids)
        k = self.req.logprobs or 0
        tops = []
        for row in out.top[lo:hi] if k else []:
            names = self.token_texts([t[1] for t in row or []])
            tops.append({name: t[0] for name, t in zip(names, row or [])})
        offsets, pos = [], offset
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": texts, "token_logprobs": out.logprobs[lo:hi], "top_logprobs": tops if k else None,
                "text_offset": offsets}

    def response(self, gens, outs) -> dict:
        choices = []
        for i, (g, out) in enumerate(zip(gens, outs)):
            choice = {"index": i, "text": self.text(g, out, True),
                      "logprobs": self.logprobs(out, 0, len(out.output_ids), 0) if self.req.logprobs is not None else None,
                      "finish_reason": _finish_reason(out), "matched_stop": (out.finish or {}).get("matched")}
            choices.append(self.with_ids(choice, g, out, "token_ids"))
        return self.body("text_completion", gens, outs, choices)

    def delta(self, i: int, g, out: _Output, final: bool) -> list[dict]:
        text = self.streamable(g, out, final)
        sent, lo = self.sent.get(i, 0), self.sent_tokens.get(i, 0)
        piece = text[sent:] if len(text) > sent else ""
        hi = len(out.output_ids)
        lps = self.logprobs(out, lo, hi, sent) if self.req.logprobs is not None and hi > lo else None
        chunks = []
        if piece or lps or final:
            chunks.append(self.chunk([{"index": i, "text": piece, "logprobs": lps,
                                       "finish_reason": _finish_reason(out) if final else None,
                                       "matched_stop": (out.finish or {}).get("matched") if final else None}]))
            self.sent[i], self.sent_tokens[i] = sent + len(piece), hi
        return chunks


def register_routes(server, app: web.Application) -> OpenAIServer:
    """Adds the OpenAI-compatible and episode endpoints to an ``EngineServer``'s application."""
    api = OpenAIServer(server)
    api.register(app)
    server.openai = api
    return api


__all__ = ["OpenAIServer", "register_routes", "error_response", "Episode", "ChatRequest", "CompletionRequest"]

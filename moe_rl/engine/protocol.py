"""SGLang's native HTTP protocol: request validation, response encodings, shared helpers.

Field names and encodings follow SGLang's ``srt/managers/io_struct.py`` (checked against the
sglang 0.5.23 wheel). Nothing here imports torch, so the client can use it on any machine.

Encodings the rest of the stack relies on:

* ``meta_info.output_token_logprobs``: ``[[logprob, token_id, null], ...]`` (SGLang's tuples
  with no text), one per output token. Convention (SGLang's default, and the trainer's): the
  log-probability of the sampled token under ``softmax(logits / temperature)`` over the whole
  vocabulary, computed in fp32, *before* top-k / top-p / min-p truncation. A greedy request
  (``temperature == 0``) uses temperature 1, as SGLang does. ``logits`` are the processed
  ones, as SGLang's sampler takes them: after the penalties (frequency, presence, repetition,
  min_new_tokens), which SGLang applies to the logits in place before sampling.
* ``meta_info.routed_experts``: base64 of int32 ``[seqlen - 1, num_hidden_layers, top_k]``,
  one row per forwarded token (prompt and output, all but the last token), every decoder layer;
  rows of dense (non-MoE) layers are 0, as in SGLang (its capture buffer is zero-initialised and
  dense layers never write it). ``routed_experts_start_len`` = s returns rows ``[s, seqlen-1)``.
* ``meta_info.weight_versions``: SGLang's spans ``[{"version", "start", "end"}]`` over output
  token indices; ``meta_info.weight_version`` is the version of the last span (the engine's
  current version when there is no output). Our extension
  ``meta_info.output_token_weight_versions`` lists the version of each output token.
* ``meta_info.finish_reason``: ``{"type": "length", "length": n}``,
  ``{"type": "stop", "matched": token_id}`` or
  ``{"type": "abort", "message": ..., "status_code": null, "err_type": null}``.
"""
from __future__ import annotations

import base64
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from aiohttp import web

GREEDY_EPS = 1e-6  # temperature below this means greedy, as SGLang's _SAMPLING_EPS
MAX_STOP_COUNT = 32  # SGLang's limit on stop strings per request
PAUSE_MODES = ("abort", "retract", "in_place")


class RequestError(ValueError):
    """A malformed request; the message names the offending field (HTTP 400)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field, self.message = field_name, message


# where the server's limits middleware leaves a request's parsed body (aiohttp >= 3.12 types the key)
BODY = web.RequestKey("moe_rl.json_body", object) if hasattr(web, "RequestKey") else "moe_rl.json_body"


def json_body(request, *, optional: bool = False) -> Any:
    """The JSON value of an aiohttp request's body, as the server's middleware parsed it
    (``moe_rl.engine.limits``); ``{}`` when the request has none and ``optional``."""
    if BODY in request:
        return request[BODY]
    if optional:
        return {}
    raise RequestError("body", "required: a JSON object")


class QueueFull(RuntimeError):
    """The engine's waiting queue is at ``engine.max_waiting_requests``: the request is refused
    (HTTP 503 with Retry-After), as SGLang refuses one past ``--max-queued-requests``."""


# --- small typed readers that name the field on error ---------------------------------------
def _int(d: dict, key: str, default=None, *, lo: int | None = None, where: str = "") -> int | None:
    name = where + key
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise RequestError(name, f"expected an integer, got {v!r}")
    if lo is not None and v < lo:
        raise RequestError(name, f"must be >= {lo}, got {v}")
    return v


def _float(d: dict, key: str, default: float, where: str = "") -> float:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(where + key, f"expected a finite number, got {v!r}")
    return float(v)


def _bool(d: dict, key: str, default: bool = False, where: str = "") -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(where + key, f"expected true or false, got {v!r}")
    return v


def _str(d: dict, key: str, default: str | None = None, *, numbers: bool = False) -> str | None:
    v = d.get(key, default)
    if v is None:
        return default
    if numbers and isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v)
    if not isinstance(v, str):
        raise RequestError(key, f"expected a string, got {v!r}")
    return v


def _int_list(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise RequestError(name, "expected a list of integers")
    return v


# --- /generate ------------------------------------------------------------------------------
@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    max_new_tokens: int = 128  # SGLang's default
    stop_token_ids: frozenset[int] = frozenset()
    sampling_seed: int | None = None  # per-request torch.Generator seed
    # detokenization (SGLang's defaults; used only when the engine has a tokenizer)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    ignore_eos: bool = False  # GenerateRequest.parse leaves the model's EOS out of stop_token_ids
    # SGLang's logit processing (penaltylib and its sampler), over the request's output tokens
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    # the ids min_new_tokens masks: stop_token_ids plus the model's EOS even under ignore_eos
    # (SGLang's BatchedMinNewTokensPenalizer); GenerateRequest.parse fills in the EOS
    min_new_tokens_ids: frozenset[int] = frozenset()
    # stop strings, matched on the decoded tail of the output (needs a tokenizer); the tail
    # is stop_str_max_len + 1 tokens, stop_str_max_len the longest one's token count (SGLang's)
    stop_strs: tuple[str, ...] = ()
    stop_str_max_len: int = 0

    @property
    def penalized(self) -> bool:
        """Its logits are changed (by its output so far) before sampling and log-probs."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_new_tokens > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the distribution the returned log-probs are taken under."""
        return 1.0 if self.temperature < GREEDY_EPS else self.temperature

    def sglang_dict(self) -> dict:
        """These parameters as SGLang's ``sampling_params`` (what ``parse`` reads back to them,
        with the same EOS): for a request this engine parsed and another server runs."""
        d = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
             "max_new_tokens": self.max_new_tokens, "min_new_tokens": self.min_new_tokens,
             "stop_token_ids": sorted(self.stop_token_ids), "ignore_eos": self.ignore_eos,
             "skip_special_tokens": self.skip_special_tokens,
             "spaces_between_special_tokens": self.spaces_between_special_tokens, "no_stop_trim": self.no_stop_trim,
             "min_p": self.min_p, "frequency_penalty": self.frequency_penalty,
             "presence_penalty": self.presence_penalty, "repetition_penalty": self.repetition_penalty}
        if self.sampling_seed is not None:
            d["sampling_seed"] = self.sampling_seed
        if self.stop_strs:
            d["stop"] = list(self.stop_strs)
        return d

    _KNOWN = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed", "seed",
              "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "min_p",
              "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "stop", "ignore_eos"}
    # SGLang fields that are accepted when they hold their no-op value
    _NEUTRAL = {
        "n": 1, "stream_interval": None, "regex": None, "json_schema": None,
        "ebnf": None, "logit_bias": None, "stop_regex": None, "structural_tag": None,
        "beam_width": 1, "watermark": None,  # beam_width > 1: beam search
    }
    # SGLang fields with no effect here: custom_params feeds a custom logit processor (refused at
    # the request level)
    _NO_EFFECT = {"custom_params"}

    @classmethod
    def parse(cls, d: Any) -> "SamplingParams":
        w = "sampling_params."
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise RequestError("sampling_params", f"expected an object, got {type(d).__name__}")
        for key, value in d.items():
            if key in cls._KNOWN or key in cls._NO_EFFECT:
                continue
            if key in cls._NEUTRAL:
                neutral = cls._NEUTRAL[key]
                if value is None or value == neutral or (neutral is None and value in (False, [], "")):
                    continue
                raise RequestError(w + key, f"{value!r} is not supported by the embedded engine")
            raise RequestError(w + key, "unknown sampling parameter")
        t = _float(d, "temperature", 1.0, w)
        if t < 0:
            raise RequestError(w + "temperature", f"must be >= 0, got {t}")
        top_p = _float(d, "top_p", 1.0, w)
        if not 0.0 < top_p <= 1.0:
            raise RequestError(w + "top_p", f"must be in (0, 1], got {top_p}")
        top_k = _int(d, "top_k", -1, where=w)
        if top_k != -1 and top_k < 1:
            raise RequestError(w + "top_k", f"must be -1 (disabled) or >= 1, got {top_k}")
        mnt = _int(d, "max_new_tokens", 128, lo=0, where=w)
        stop = d.get("stop_token_ids") or []
        stop = frozenset(_int_list(list(stop) if isinstance(stop, (list, tuple, set)) else stop, w + "stop_token_ids"))
        seed = _int(d, "sampling_seed", None, where=w)
        if seed is None:
            seed = _int(d, "seed", None, where=w)
        # SGLang's SamplingParams.verify ranges
        min_p = _float(d, "min_p", 0.0, w)
        if not 0.0 <= min_p <= 1.0:
            raise RequestError(w + "min_p", f"must be in [0, 1], got {min_p}")
        pens = {}
        for key in ("frequency_penalty", "presence_penalty"):
            pens[key] = _float(d, key, 0.0, w)
            if not -2.0 <= pens[key] <= 2.0:
                raise RequestError(w + key, f"must be in [-2, 2], got {pens[key]}")
        rep = _float(d, "repetition_penalty", 1.0, w)
        if not 0.0 < rep <= 2.0:
            raise RequestError(w + "repetition_penalty", f"must be in (0, 2] (1.0 = no penalty), got {rep}")
        min_new = _int(d, "min_new_tokens", 0, lo=0, where=w)
        if min_new > mnt:
            raise RequestError(w + "min_new_tokens", f"must be in [0, max_new_tokens({mnt})], got {min_new}")
        stop_strs = d.get("stop")
        if stop_strs is None or stop_strs == "" or stop_strs == []:
            stop_strs = ()
        elif isinstance(stop_strs, str):
            stop_strs = (stop_strs,)
        elif isinstance(stop_strs, list) and all(isinstance(x, str) for x in stop_strs):
            if len(stop_strs) > MAX_STOP_COUNT:
                raise RequestError(w + "stop", f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stop_strs)}")
            stop_strs = tuple(stop_strs)
        else:
            raise RequestError(w + "stop", f"expected a string or a list of strings, got {stop_strs!r}")
        return cls(t, top_p, top_k, mnt, stop, seed,
                   skip_special_tokens=_bool(d, "skip_special_tokens", True, where=w),
                   spaces_between_special_tokens=_bool(d, "spaces_between_special_tokens", True, where=w),
                   no_stop_trim=_bool(d, "no_stop_trim", False, where=w),
                   ignore_eos=_bool(d, "ignore_eos", False, where=w),
                   min_p=min_p, repetition_penalty=rep, min_new_tokens=min_new, min_new_tokens_ids=stop,
                   stop_strs=stop_strs, **pens)


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    return_logprob: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    stream: bool = False
    # log-probs beyond the output tokens' (SGLang's semantics; see Engine._response)
    logprob_start_len: int = -1  # -1: no input_token_logprobs
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False

    # GenerateReqInput fields (sglang 0.5.23) that leave the output of a token-in/token-out
    # request unchanged: routing, disaggregation, bookkeeping, logging
    _IGNORED = {"log_metrics", "modalities", "session_params", "bootstrap_host",
                "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "data_parallel_rank", "priority",
                "extra_key", "custom_labels", "no_logs", "routing_key", "conversation_id", "routed_dp_rank",
                "disagg_prefill_dp_rank", "decode_tp_size", "http_worker_ipc", "received_time",
                "external_trace_header", "return_prompt_token_ids", "cache_salt", "session_id", "background",
                "num_items_assigned", "need_wait_for_mm_inputs", "kv_hints", "return_bytes", "use_audio_in_video"}
    # fields that would change the output: accepted only with their no-op value; otherwise a 400
    _NEUTRAL = {"image_data": None, "video_data": None, "audio_data": None, "input_embeds": None,
                "lora_id": None, "custom_logit_processor": None, "return_hidden_states": False,
                "return_indexer_topk": False, "token_ids_logprob": None, "return_entropy": False, "return_sampling_mask": False,
                "positional_embed_overrides": None, "mm_hashes": None, "mm_content_hashes": None,
                "video_config": None, "images_config": None, "mm_processor_kwargs": None, "watermark": None,
                "require_reasoning": False, "max_thinking_tokens": None, "sampling_logprobs_mode": None,
                "return_flat_raw_top_logprobs": False, "return_flat_raw_output_top_logprobs": False,
                "return_flat_raw_top_logprobs_b64": False, "encoder_urls": None, "max_dynamic_patch": None,
                "min_dynamic_patch": None, "image_max_dynamic_patch": None, "video_max_dynamic_patch": None,
                "multi_item_delimiter_indices": None, "token_indices_to_pool": None}

    @classmethod
    def parse(cls, body: Any, *, vocab_size: int, max_context: int,
              eos_token_ids: frozenset[int] = frozenset(), adapter: str | None = None,
              token_count: Callable[[str], int] | None = None) -> "GenerateRequest":
        """``token_count``: the tokenizer's token count of a string (without special tokens),
        None without a tokenizer (stop strings are then refused). ``eos_token_ids``: the model's EOS (its config / generation_config), which ends a
        sequence as in SGLang unless ``sampling_params.ignore_eos``. ``adapter``: the LoRA
        adapter the engine serves (moe_rl.engine.lora), the only ``lora_path`` it accepts."""
        if not isinstance(body, dict):
            raise RequestError("body", "expected a JSON object")
        known = {"input_ids", "sampling_params", "rid", "return_logprob", "return_routed_experts",
                 "routed_experts_start_len", "stream", "text", "logprob_start_len", "top_logprobs_num",
                 "return_text_in_logprobs"}
        for key, value in body.items():
            if key in known or key in cls._IGNORED:
                continue
            if key == "lora_path":
                names = value if isinstance(value, list) else [value]
                wrong = [n for n in names if n is not None and n != adapter]
                if wrong:
                    raise RequestError(key, f"adapter {wrong[0]!r} is not loaded (loaded: {adapter!r})")
                continue
            if key in cls._NEUTRAL:
                neutral = cls._NEUTRAL[key]
                if value is None or value == neutral or value in ([], {}, ""):
                    continue
                raise RequestError(key, f"{value!r} is not supported by the embedded engine (only {neutral!r})")
            raise RequestError(key, "unknown /generate field (not in SGLang's GenerateReqInput)")
        if body.get("input_ids") is None and body.get("text") is not None:
            # the server tokenizes ``text`` into input_ids when model.path has a tokenizer
            raise RequestError("text", "the engine has no tokenizer (model.path has none; SGLang's "
                               "skip_tokenizer_init=True) and cannot accept text prompts; send input_ids")
        if "input_ids" not in body:
            raise RequestError("input_ids", "required")
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            raise RequestError("input_ids", "a batch of prompts: use GenerateRequest.parse_batch")
        ids = _int_list(ids, "input_ids")
        if not ids:
            raise RequestError("input_ids", "empty prompt")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError("input_ids", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if len(ids) >= max_context:
            raise RequestError(
                "input_ids",
                f"the input ({len(ids)} tokens) is longer than the model's context length ({max_context} tokens)",
            )
        sp = SamplingParams.parse(body.get("sampling_params"))
        if sp.stop_strs:
            if token_count is None:
                raise RequestError("sampling_params.stop", "stop strings are matched on the decoded output and the "
                                   "engine has no tokenizer (model.path has none; SGLang with skip_tokenizer_init=True "
                                   "refuses them too); use stop_token_ids")
            sp.stop_str_max_len = max(token_count(s) for s in sp.stop_strs)
        sp.min_new_tokens_ids = sp.stop_token_ids | {t for t in eos_token_ids if 0 <= t < vocab_size}
        if eos_token_ids and not sp.ignore_eos:
            sp.stop_token_ids = sp.stop_token_ids | {t for t in eos_token_ids if 0 <= t < vocab_size}
        bad = [t for t in sp.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError("sampling_params.stop_token_ids", f"token id {bad[0]} is outside the vocabulary")
        rid = _str(body, "rid", numbers=True)
        start = _int(body, "routed_experts_start_len", 0, lo=0)
        if start > len(ids):
            raise RequestError("routed_experts_start_len", f"must be in [0, {len(ids)}] (the prompt length), got {start}")
        return_logprob = _bool(body, "return_logprob")
        lp_start = _int(body, "logprob_start_len", -1, lo=-1)
        if return_logprob and lp_start > len(ids):  # SGLang aborts it with a 400 too
            raise RequestError("logprob_start_len", f"logprob_start_len={lp_start} is higher than the number of "
                               f"input tokens ({len(ids)}); use a smaller logprob_start_len")
        top_n = _int(body, "top_logprobs_num", 0, lo=0)
        if top_n > vocab_size:
            raise RequestError("top_logprobs_num", f"must be <= the vocabulary size {vocab_size}, got {top_n}")
        return cls(
            input_ids=list(ids),
            sampling_params=sp,
            rid=rid,
            return_logprob=return_logprob,
            return_routed_experts=_bool(body, "return_routed_experts"),
            routed_experts_start_len=start,
            stream=_bool(body, "stream"),
            logprob_start_len=lp_start if return_logprob else -1,  # ignored without return_logprob, as SGLang
            top_logprobs_num=top_n if return_logprob else 0,
            return_text_in_logprobs=_bool(body, "return_text_in_logprobs"),
        )

    def sglang_body(self) -> dict:
        """This request as the body of SGLang's ``/generate`` (``parse`` reads it back to an
        equal request)."""
        body = {"input_ids": list(self.input_ids), "sampling_params": self.sampling_params.sglang_dict(),
                "return_logprob": self.return_logprob, "top_logprobs_num": self.top_logprobs_num,
                "logprob_start_len": self.logprob_start_len, "stream": self.stream}
        if self.rid is not None:
            body["rid"] = self.rid
        if self.return_routed_experts:
            body.update(return_routed_experts=True, routed_experts_start_len=self.routed_experts_start_len)
        if self.return_text_in_logprobs:
            body["return_text_in_logprobs"] = True
        return body

    @property
    def input_logprob_start(self) -> int:
        """First input position of ``input_token_logprobs`` (len(input_ids): none), as SGLang's
        scheduler resolves ``logprob_start_len`` (-1 -> output log-probs only)."""
        return len(self.input_ids) if self.logprob_start_len == -1 else self.logprob_start_len


def is_batch(body: Any) -> bool:
    """SGLang's batched /generate: ``input_ids`` is a list of prompts."""
    if not isinstance(body, dict):
        return False
    ids = body.get("input_ids")
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


# GenerateReqInput fields that SGLang 0.5.23 splits per prompt in a batch (a list: one each)
PER_PROMPT_FIELDS = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
                     "lora_path", "lora_id", "extra_key", "image_data", "video_data", "audio_data",
                     "custom_logit_processor", "return_hidden_states", "return_sampling_mask",
                     "sampling_logprobs_mode", "watermark", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                     "bootstrap_pair_key", "decode_tp_size", "cache_salt", "kv_hints")


def parse_batch(body: dict, *, vocab_size: int, max_context: int,
                eos_token_ids: frozenset[int] = frozenset(), adapter: str | None = None,
                token_count: Callable[[str], int] | None = None) -> list[GenerateRequest]:
    """A batched /generate body -> one request per prompt. As in SGLang's
    ``GenerateReqInput.__getitem__``, the fields of ``PER_PROMPT_FIELDS`` are either one value
    for all prompts or a list with one per prompt; the others (``routed_experts_start_len``,
    ``return_routed_experts``, ``return_text_in_logprobs``, ...) apply to all. Errors name
    the field and the prompt's index."""
    n = len(body["input_ids"])
    per_item = {"input_ids": body["input_ids"]}
    for key in PER_PROMPT_FIELDS:
        v = body.get(key)
        if isinstance(v, list) and v:
            if len(v) != n:
                raise RequestError(key, f"has {len(v)} entries for {n} prompts")
            per_item[key] = v
    if body.get("stream"):
        raise RequestError("stream", "streaming a batch of prompts is not supported")
    out = []
    for i in range(n):
        item = {k: v for k, v in body.items() if k not in per_item}
        item.update({k: v[i] for k, v in per_item.items()})
        try:
            out.append(GenerateRequest.parse(item, vocab_size=vocab_size, max_context=max_context,
                                             eos_token_ids=eos_token_ids, adapter=adapter, token_count=token_count))
        except RequestError as e:
            raise RequestError(f"prompt {i}: {e.field}", e.message) from None
    return out


def finish_length(n: int) -> dict:
    return {"type": "length", "length": n}


def finish_stop(matched: int | str) -> dict:
    """A stop token (its id) or a stop string (the string), as SGLang's FINISH_MATCHED_*."""
    return {"type": "stop", "matched": matched}


def finish_abort(message: str = "Aborted", status_code: int | None = None) -> dict:
    """An abort; with an error ``status_code`` (>= 400) the server answers with that HTTP error,
    as SGLang does, instead of a response with partial output."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


# --- weight sync requests -------------------------------------------------------------------
@dataclass
class InitGroupRequest:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"

    @classmethod
    def parse(cls, body: Any) -> "InitGroupRequest":
        if not isinstance(body, dict):
            raise RequestError("body", "expected a JSON object")
        for key in ("master_address", "master_port", "rank_offset", "world_size"):
            if key not in body:
                raise RequestError(key, "required")
        return cls(
            master_address=_str(body, "master_address"),
            master_port=_int(body, "master_port", lo=0),
            rank_offset=_int(body, "rank_offset", lo=0),
            world_size=_int(body, "world_size", lo=1),
            group_name=_str(body, "group_name", "weight_update_group"),
            backend=_str(body, "backend", "nccl"),
        )


@dataclass
class UpdateWeightsRequest:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    checksum: Any = None  # our extension, passed to the receiver

    @classmethod
    def parse(cls, body: Any) -> "UpdateWeightsRequest":
        if not isinstance(body, dict):
            raise RequestError("body", "expected a JSON object")
        for key in ("names", "dtypes", "shapes"):
            if not isinstance(body.get(key), list):
                raise RequestError(key, "required: a list")
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        # one pass each, no per-item calls: a 30B-A3B bucket lists 18,000 tensors (this took
        # 10 ms per request with a helper call and an f-string per shape)
        if not set(map(type, names)) <= {str}:
            raise RequestError("names", "expected a list of strings")
        if not set(map(type, dtypes)) <= {str}:
            raise RequestError("dtypes", "expected a list of strings")
        if not (set(map(type, shapes)) <= {list} and set(map(type, itertools.chain.from_iterable(shapes))) <= {int}):
            i = next(i for i, s in enumerate(shapes) if not (type(s) is list and all(type(x) is int for x in s)))
            raise RequestError(f"shapes[{i}]", "expected a list of integers")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise RequestError("names", f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        return cls(
            names=names, dtypes=dtypes, shapes=shapes,
            group_name=_str(body, "group_name", "weight_update_group"),
            flush_cache=_bool(body, "flush_cache", True),
            abort_all_requests=_bool(body, "abort_all_requests", False),
            weight_version=_str(body, "weight_version", numbers=True),
            load_format=_str(body, "load_format"),
            checksum=body.get("checksum"),
        )


@dataclass
class UpdateFromDiskRequest:
    """SGLang's ``UpdateWeightFromDiskReqInput``: the weights of an HF checkpoint directory."""

    model_path: str
    abort_all_requests: bool = False
    weight_version: str | None = None

    # fields with no effect on the embedded engine: it has no prefix cache to flush, copies
    # the weights in place (captured decode graphs read them there) and never stays paused
    _NO_EFFECT = {"is_async", "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "flush_cache"}
    LOAD_FORMATS = (None, "auto", "safetensors")

    @classmethod
    def parse(cls, body: Any) -> "UpdateFromDiskRequest":
        if not isinstance(body, dict):
            raise RequestError("body", "expected a JSON object")
        for key in body:
            if key in cls._NO_EFFECT:
                _bool(body, key)
            elif key == "token_step":
                _int(body, key, 0, lo=0)
            elif key == "manifest" and body[key] is not None:
                raise RequestError(key, "not supported by the embedded engine (only null)")
            elif key not in ("model_path", "load_format", "abort_all_requests", "weight_version", "manifest"):
                raise RequestError(key, "unknown field (not in SGLang's UpdateWeightFromDiskReqInput)")
        path = _str(body, "model_path")
        if not path:
            raise RequestError("model_path", "required: the HF checkpoint directory to load")
        fmt = _str(body, "load_format")
        if fmt not in cls.LOAD_FORMATS:
            raise RequestError("load_format", f"the embedded engine reads HF safetensors only (auto, safetensors), got {fmt!r}")
        return cls(model_path=path, abort_all_requests=_bool(body, "abort_all_requests"),
                   weight_version=_str(body, "weight_version", numbers=True))


# --- request bodies encoded once ---------------------------------------------------------------
class FrozenList(list):
    """A read-only list whose JSON text is made once. A weight-sync request lists every tensor
    of its bucket (18,000 names and shapes for a 30B-A3B bucket): ``json.dumps`` of them took
    10 ms per bucket, per engine, per sync; the bucket's lists never change, so their text is
    reused (``dumps_body``). Compares, iterates and pickles as a list."""

    def _read_only(self, *args, **kwargs):
        raise TypeError("FrozenList is read-only")

    append = extend = insert = remove = pop = clear = sort = reverse = _read_only
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only

    def __reduce__(self):
        return (FrozenList, (list(self),))

    def json(self) -> str:
        text = self.__dict__.get("_json")
        if text is None:
            text = self.__dict__["_json"] = json.dumps(self)
        return text


def dumps_body(body: dict) -> str:
    """``json.dumps(body)``, with the stored text of its ``FrozenList`` values."""
    return "{" + ", ".join(f"{json.dumps(k)}: {v.json() if isinstance(v, FrozenList) else json.dumps(v)}"
                           for k, v in body.items()) + "}"


# --- routing and versions in responses -------------------------------------------------------
def encode_routed_experts(rows: np.ndarray) -> str:
    """int32 [tokens, layers, top_k] -> base64 (SGLang's meta_info.routed_experts)."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype=np.int32).tobytes()).decode("ascii")


def decode_routed_experts(data: str | dict, num_layers: int, top_k: int) -> np.ndarray:
    """SGLang's ``meta_info.routed_experts`` (or a whole response / meta_info) -> int32
    [tokens, num_layers, top_k]. ``num_layers`` is the model's num_hidden_layers."""
    if isinstance(data, dict):
        data = data.get("meta_info", data).get("routed_experts")
    if data is None:
        raise ValueError("the response has no meta_info.routed_experts (was return_routed_experts set, "
                         "and SGLang launched with --enable-return-routed-experts?)")
    flat = np.frombuffer(base64.b64decode(data), dtype=np.int32)
    if flat.size % (num_layers * top_k):
        raise ValueError(f"routed_experts has {flat.size} ints, not a multiple of layers*top_k={num_layers * top_k}")
    return flat.reshape(-1, num_layers, top_k)


def version_spans(versions: list[str]) -> list[dict]:
    """Per-output-token versions -> SGLang's ``weight_versions`` spans."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def token_weight_versions(meta_info: dict) -> list[str] | None:
    """The weight version of each output token, from our extension or SGLang's spans; None when
    the server reported neither (then ``meta_info["weight_version"]`` applies to all)."""
    if "output_token_weight_versions" in meta_info:
        return list(meta_info["output_token_weight_versions"])
    spans = meta_info.get("weight_versions")
    if spans is None:
        return None
    out: list[str] = []
    for s in spans:
        if isinstance(s, dict):
            v, start, end = s["version"], s["start"], s["end"]
        else:  # msgspec array_like form [version, start, end]
            v, start, end = s
        out.extend([v] * (end - start))
    return out


def version_number(v) -> int:
    """An engine's weight version as the trainer's step number. SGLang reports "default" (or
    its --weight-version) until its first update: the initial weights, version 0."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def output_logprobs(meta_info: dict) -> list[float]:
    """Log-probs of the output tokens from ``meta_info.output_token_logprobs``."""
    return [float(t[0]) for t in meta_info.get("output_token_logprobs") or []]

"""The tokenizer side of SGLang's server for ``moe-rl serve``: "text" prompts in, "text" out.

With a tokenizer in ``model.path`` (``transformers.AutoTokenizer``) the embedded engine answers
like an SGLang server with its tokenizer (read from sglang 0.5.23's ``tokenizer_manager.py`` and
``detokenizer_manager.py``):

* a ``text`` prompt (without ``input_ids``) is tokenized with ``tokenizer(text)["input_ids"]``
  (a fast tokenizer; ``encode`` otherwise), special tokens added as the tokenizer's default;
* ``"text"`` of an answer is the detokenized output: SGLang decodes the last 5 prompt tokens
  plus the output and drops the text of those 5 (``INIT_INCREMENTAL_DETOKENIZATION_OFFSET``),
  so a tokenizer whose decoding depends on context (SentencePiece's leading space) gives the
  same text; the matched stop token (``finish_reason.matched``) is left out unless
  ``no_stop_trim``; ``skip_special_tokens`` / ``spaces_between_special_tokens`` go to
  ``batch_decode``;
* ``sampling_params.stop`` strings are matched on the decoded tail of the output by the engine
  (``Engine.decode`` is this codec's ``decode``); the text is cut before the matched string
  (after it with ``no_stop_trim``), as SGLang's ``trim_matched_stop``;
* ``return_text_in_logprobs`` fills the third element of every log-prob tuple with the
  token's text (``batch_decode([[id] ...])``, no skipping).

Without a tokenizer it answers like SGLang launched with ``--skip-tokenizer-init``: no
``"text"`` key, ``None`` texts in the log-prob tuples, and a ``text`` prompt is a 400.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DETOKENIZE_CONTEXT = 5  # SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | None):
    """``AutoTokenizer`` of ``path`` (model.path), or None when it holds no tokenizer files."""
    if not path or not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is in the test extra
        raise ImportError(f"model.path {path} has a tokenizer: serving text needs the `transformers` package") from e
    return AutoTokenizer.from_pretrained(path)


def model_eos_ids(path: str | None) -> frozenset[int]:
    """The EOS ids SGLang stops at: ``eos_token_id`` of the model's config.json and
    generation_config.json (an int or a list). A random-init model (no path) has none."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = Path(path) / name if path else None
        if f is not None and f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    return frozenset(ids)


class TextCodec:
    """Text in and out of one engine's requests (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        if getattr(tok, "is_fast", False):
            return list(tok(text)["input_ids"])
        return list(tok.encode(text))

    def output_text(self, prompt_ids: list[int], output_ids: list[int], finish_reason: dict | None,
                    skip_special_tokens: bool, spaces_between_special_tokens: bool, no_stop_trim: bool) -> str:
        context = list(prompt_ids[max(0, len(prompt_ids) - DETOKENIZE_CONTEXT) :])
        ids = context + list(output_ids)
        matched = (finish_reason or {}).get("matched")
        if isinstance(matched, int) and not no_stop_trim and output_ids:
            ids = ids[:-1]  # the matched stop token is always the last one
        kw = dict(skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens)
        full, head = self.tokenizer.batch_decode([ids, context], **kw)
        text = full[len(head) :]
        if isinstance(matched, str):  # a stop string: cut before it (after it with no_stop_trim)
            pos = text.find(matched)
            if pos != -1:
                text = text[: pos + len(matched)] if no_stop_trim else text[:pos]
        return text

    def token_count(self, s: str) -> int:
        """Tokens of ``s`` without special tokens (SGLang's stop_str_max_len)."""
        return len(self.tokenizer.encode(s, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """SGLang's Req.tail_str decoding (the tokenizer's defaults)."""
        return self.tokenizer.decode(ids)

    def add_text(self, out: dict, req) -> dict:
        """Adds ``"text"`` to an answer (``out``: the engine's dict for ``req``) and, with
        ``return_text_in_logprobs``, each log-prob tuple's token text. Returns ``out``."""
        sp = req.sampling_params
        text = self.output_text(req.input_ids, out["output_ids"], out["meta_info"].get("finish_reason"),
                                sp.skip_special_tokens, sp.spaces_between_special_tokens, sp.no_stop_trim)
        if req.return_logprob and req.return_text_in_logprobs:
            self._logprob_texts(out["meta_info"])
        return {"text": text, **out}

    def _logprob_texts(self, meta: dict) -> None:
        tuples: list[list[Any]] = []
        for key in ("input_token_logprobs", "output_token_logprobs"):
            tuples += meta.get(key) or []
        for key in ("input_top_logprobs", "output_top_logprobs"):
            for row in meta.get(key) or []:
                tuples += row or []
        if not tuples:
            return
        texts = self.tokenizer.batch_decode([[t[1]] for t in tuples])
        for t, s in zip(tuples, texts):
            t[2] = s

"""File-backed math-style task: prompts and reference answers from a dataset file, 0/1 reward
by math-verify.

Files (``data.path``; ``data.format`` names the format, ``auto`` tells it from the path):

* **JSONL** (any other name), one JSON object per line, blank lines skipped::

      {"prompt": "What is 17 + 25?", "answer": "42"}

* **Parquet** (``.parquet``), verl's schema as its data preprocessing writes it: ``prompt`` a
  list of chat messages ``[{"role": "user", "content": ...}]``, ``reward_model.ground_truth``
  the answer, ``data_source`` and ``extra_info`` carried along;
* **an HF ``datasets`` directory** (a directory written by ``Dataset.save_to_disk``; a
  ``DatasetDict``'s directory holds one per split).

Rows, in every format:

* the prompt is ``data.prompt_key``, else the first present of ``"prompt"``, ``"question"``,
  ``"problem"``, ``"messages"``: a string, or a list of chat messages (objects with string
  ``role`` and ``content``, verl's and slime's form);
* the answer is ``data.answer_key``, else ``"answer"``, ``"solution"`` or
  ``reward_model.ground_truth``: a string or a number. A dotted key reads a nested field
  (``reward_model.ground_truth``, ``extra_info.answer``). GSM8K lines (``question`` + a worked
  ``answer`` ending in ``#### 42``) and MATH lines (``problem`` + ``solution`` with a
  ``\\boxed{}``) load as they are: the reference is taken from after ``####`` or from the box
  (see :mod:`moe_rl.tasks.answers`);
* ``data_source`` and ``extra_info`` (verl), when present, are kept in ``Prompt.meta`` for a
  ``reward.fn`` plug-in; other keys are ignored.

``Prompt.meta`` holds the ``answer`` and, for agents (``env.openai_agent``), the question as
``text`` (a chat-message prompt's last user message) and the chat ``messages`` where the row's
prompt is in that form.

A row that is not an object, lacks its prompt or answer, or has a value of the wrong type
raises :class:`DatasetError` naming ``file:line`` (JSONL) or ``file: row i`` (Parquet and
``datasets``, rows numbered from 0 as pandas and ``datasets`` index them); so does a file that
cannot be read or holds no example. The whole file is checked when the task is built, before
any training. Parquet needs ``pyarrow`` (``pip install 'moe-rl[parquet]'``), a ``datasets``
directory the ``datasets`` package (``pip install 'moe-rl[datasets]'``).

Order: ``num_prompts`` = number of examples; ``prompt(index)`` walks epoch
``index // num_prompts`` in a permutation seeded by (data.seed, epoch), so the stream is
endless and a data position (an integer) resumes it exactly.

Tokenizer (``task_args.tokenizer``): ``"hf"`` loads ``transformers.AutoTokenizer`` from
``task_args.tokenizer_path`` or else ``model.path`` (transformers is imported only then);
``"byte"`` is a built-in byte-level tokenizer (PAD 0, BOS 1, EOS 2, byte b -> b + 3; 259 ids)
for tests and tiny models. Default: ``"hf"`` when a path is known, else ``"byte"`` (the choice
is logged once). A string prompt is formatted by ``task_args.template`` (default
``"{prompt}\\nPut your final answer within \\boxed{}."``) and, with an HF tokenizer, goes
through its chat template as one user message (``task_args.chat_template``, default true). A
chat-message prompt is used as it is (datasets in that form carry their instructions in the
messages): rendered by the tokenizer's chat template, or, without one (the byte tokenizer,
``chat_template: false``), as its messages' contents joined by blank lines (logged once).

Reward: decode the response up to its first stop token and check it against the reference
with math-verify (:func:`moe_rl.tasks.answers.math_reward`, at most
``task_args.verify_timeout_s`` of CPU time per response): 1.0 or 0.0.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .answers import VERIFY_TIMEOUT_S, math_reward, reference_answer
from .base import DatasetError, Prompt, cut_at_stop, rng_for

log = logging.getLogger(__name__)

PROMPT_KEYS = ("prompt", "question", "problem", "messages")
ANSWER_KEYS = ("answer", "solution", "reward_model.ground_truth")
DEFAULT_TEMPLATE = "{prompt}\nPut your final answer within \\boxed{{}}."
FORMATS = ("jsonl", "parquet", "hf_disk")
_MISSING = object()


def detect_format(path: str | Path) -> str:
    """``hf_disk`` for a directory, ``parquet`` for a ``.parquet`` file, else ``jsonl``."""
    p = Path(path)
    if p.is_dir():
        return "hf_disk"
    return "parquet" if p.suffix.lower() == ".parquet" else "jsonl"


def _field(row: dict, key: str):
    """``row[key]``, a dotted key walking nested objects (``reward_model.ground_truth``)."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _messages(value: list, where: str, key: str) -> list[dict[str, str]]:
    if not value:
        raise DatasetError(f"{where}: {key!r} is an empty list of chat messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: {key!r} message {i} is not a chat message (an object with string "
                               f"'role' and 'content'): {str(m)[:80]}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def example_from_row(row: Any, where: str, prompt_key: str | None = None, answer_key: str | None = None) -> dict:
    """{"prompt" (a string or chat messages), "answer" (the reference), and verl's "data_source"
    / "extra_info" when present} of one row; DatasetError naming ``where`` if it cannot be used."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")

    def pick(given, defaults, what, config_key):
        keys = (given,) if given else defaults
        for k in keys:
            v = _field(row, k)
            if v is not _MISSING:
                return k, v
        if given:
            raise DatasetError(f"{where}: missing {what} key {given!r} ({config_key})")
        raise DatasetError(f"{where}: missing {what} key (one of {', '.join(defaults)}; or set {config_key})")

    pk, prompt = pick(prompt_key, PROMPT_KEYS, "prompt", "data.prompt_key")
    ak, answer = pick(answer_key, ANSWER_KEYS, "answer", "data.answer_key")
    for k, v in ((pk, prompt), (ak, answer)):
        if v is None:  # a Parquet / datasets row without the field reads as null
            raise DatasetError(f"{where}: {k!r} is null")
    if isinstance(prompt, list):
        prompt = _messages(prompt, where, pk)
        empty_prompt = not any(m["content"].strip() for m in prompt)
    elif isinstance(prompt, str):
        empty_prompt = not prompt.strip()
    else:
        raise DatasetError(f"{where}: {pk!r} must be a string or a list of chat messages, got {type(prompt).__name__}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DatasetError(f"{where}: {ak!r} must be a string or a number, got {type(answer).__name__}")
    ref = reference_answer(str(answer))
    if empty_prompt or not ref:
        raise DatasetError(f"{where}: empty {pk if empty_prompt else ak!r}")
    ex = {"prompt": prompt, "answer": ref}
    for k in ("data_source", "extra_info"):
        if row.get(k) is not None:
            ex[k] = row[k]
    return ex


def _jsonl_rows(p: Path):
    with p.open("rb") as f:
        if f.read(4) == b"PAR1":
            raise DatasetError(f"{p}: a Parquet file read as JSONL: name it .parquet or set data.format=parquet")
        f.seek(0)
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{p}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start}); a JSONL file "
                                   "is UTF-8 text (data.format names another format)") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{p}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            yield f"{p}:{lineno}", {"line": lineno}, obj


def _parquet_rows(p: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{p}: reading Parquet needs pyarrow: pip install 'moe-rl[parquet]'") from None
    try:
        rows = pq.read_table(p).to_pylist()
    except Exception as e:  # pyarrow's ArrowInvalid, OSError, ...
        raise DatasetError(f"{p}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    for i, row in enumerate(rows):
        yield f"{p}: row {i}", {"row": i}, row


def _hf_disk_rows(p: Path):
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{p}: reading a `datasets` directory needs the datasets package: "
                           "pip install 'moe-rl[datasets]'") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # FileNotFoundError for a directory save_to_disk did not write, ...
        raise DatasetError(f"{p}: not a directory written by datasets' save_to_disk "
                           f"({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        raise DatasetError(f"{p}: holds a DatasetDict with splits {sorted(ds)}; set data.path to one split's "
                           f"directory (e.g. {p / sorted(ds)[0]})")
    for i, row in enumerate(ds):
        yield f"{p}: row {i}", {"row": i}, row


_READERS = {"jsonl": _jsonl_rows, "parquet": _parquet_rows, "hf_disk": _hf_disk_rows}


def load_examples(path: str | Path, *, format: str = "auto", prompt_key: str | None = None,
                  answer_key: str | None = None) -> list[dict[str, Any]]:
    """[{"prompt", "answer" (reference, extracted), "line" or "row", ...}] of a dataset file
    (module docstring); DatasetError on the first bad row (naming the file and the row) or
    when the file holds no example."""
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"{p}: no such dataset file")
    fmt = detect_format(p) if format == "auto" else format
    if fmt not in _READERS:
        raise DatasetError(f"data.format={format!r}: expected auto or one of {', '.join(FORMATS)}")
    if (fmt == "hf_disk") != p.is_dir():
        raise DatasetError(f"{p}: data.format={fmt} reads " + ("a directory" if fmt == "hf_disk" else "a file"))
    out = [{**example_from_row(row, where, prompt_key, answer_key), **pos} for where, pos, row in _READERS[fmt](p)]
    if not out:
        raise DatasetError(f"{p}: the file holds no examples (empty or only blank lines)")
    return out


class ByteTokenizer:
    """UTF-8 bytes shifted past three specials: PAD 0, BOS 1, EOS 2, byte b -> b + 3."""

    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return [self.BOS] + [b + self.OFFSET for b in text.encode("utf-8")]

    def encode_text(self, text: str) -> list[int]:
        """``text`` as plain ids (no BOS): an observation appended inside an episode."""
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.vocab_size).decode("utf-8", errors="replace")

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.EOS]


class HFTokenizer:
    """``transformers.AutoTokenizer`` behind the same three methods."""

    def __init__(self, path: str, chat_template: bool = True):
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError("data.task_args.tokenizer=hf needs the `transformers` package") from e
        self.path = path
        self.tok = AutoTokenizer.from_pretrained(path)
        self.chat_template = chat_template
        if chat_template and not getattr(self.tok, "chat_template", None):
            raise ValueError(f"the tokenizer at {path} has no chat template; set data.task_args.chat_template=false")
        self.vocab_size = len(self.tok)
        stops = [self.tok.eos_token_id] if self.tok.eos_token_id is not None else []
        gen_cfg = Path(path) / "generation_config.json"
        if gen_cfg.is_file():  # e.g. Qwen lists both <|im_end|> and <|endoftext|>
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            stops += eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        self.stop_token_ids = sorted(set(stops))

    def encode(self, text: str) -> list[int]:
        if self.chat_template:
            return self.encode_messages([{"role": "user", "content": text}])
        return list(self.tok.encode(text, add_special_tokens=True))

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation through the tokenizer's chat template, ready for the assistant's turn."""
        ids = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer releases
            ids = ids["input_ids"]
        return list(ids)

    def encode_text(self, text: str) -> list[int]:
        """``text`` as plain ids, special tokens in it (<|im_start|>...) parsed, none added:
        an observation appended inside an episode."""
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


class JsonlMathTask:
    """See the module docstring."""

    def __init__(
        self,
        path: str | Path,
        *,
        seed: int = 0,
        name: str = "jsonl",
        tokenizer: str | None = None,
        tokenizer_path: str | None = None,
        model_path: str | None = None,
        chat_template: bool = True,
        template: str = DEFAULT_TEMPLATE,
        verify_timeout_s: float = VERIFY_TIMEOUT_S,
        format: str = "auto",
        prompt_key: str | None = None,
        answer_key: str | None = None,
    ):
        self.name = name
        self.path = str(path)
        self.seed = seed
        self.examples = load_examples(path, format=format, prompt_key=prompt_key, answer_key=answer_key)
        if verify_timeout_s <= 0:
            raise ValueError(f"data.task_args.verify_timeout_s={verify_timeout_s}: must be > 0")
        self.verify_timeout_s = verify_timeout_s
        self.num_prompts = len(self.examples)
        if "{prompt}" not in template:
            raise ValueError("data.task_args.template must contain '{prompt}'")
        self.template = template
        tok_path = tokenizer_path or model_path
        if tokenizer is None:
            tokenizer = "hf" if tok_path else "byte"
            log.info("task %s: using the %s tokenizer%s", name, tokenizer, f" from {tok_path}" if tok_path else "")
        if tokenizer == "hf":
            if not tok_path:
                raise ValueError("data.task_args.tokenizer=hf needs model.path or data.task_args.tokenizer_path")
            self.tokenizer: ByteTokenizer | HFTokenizer = HFTokenizer(tok_path, chat_template)
        elif tokenizer == "byte":
            self.tokenizer = ByteTokenizer()
        else:
            raise ValueError(f"data.task_args.tokenizer={tokenizer!r}: expected 'hf' or 'byte'")
        self.vocab_size_needed = self.tokenizer.vocab_size
        self.stop_token_ids = list(self.tokenizer.stop_token_ids)
        self._ids: dict[int, list[int]] = {}  # tokenised prompts, by example
        self._told_plain = False
        self._epoch_order: tuple[int, list[int]] = (-1, [])

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order[0] != epoch:
            self._epoch_order = (epoch, rng_for(self.seed, epoch).permutation(self.num_prompts).tolist())
        return self._epoch_order[1]

    def example_at(self, index: int) -> int:
        """Which example (0-based, file order) the stream's ``index`` points at."""
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        epoch, pos = divmod(index, self.num_prompts)
        return self._order(epoch)[pos]

    def _encode(self, prompt: str | list[dict[str, str]]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(self.template.format(prompt=prompt))
        if getattr(self.tokenizer, "chat_template", False):
            return self.tokenizer.encode_messages(prompt)
        if not self._told_plain:
            log.info("task %s: chat-message prompts rendered as their contents joined by blank lines (the %s "
                     "tokenizer has no chat template in use)", self.name, type(self.tokenizer).__name__)
            self._told_plain = True
        return self.tokenizer.encode("\n\n".join(m["content"] for m in prompt))

    def prompt(self, index: int) -> Prompt:
        i = self.example_at(index)
        ex = self.examples[i]
        if i not in self._ids:
            self._ids[i] = self._encode(ex["prompt"])
        meta = {k: v for k, v in ex.items() if k != "prompt"}
        prompt = ex["prompt"]
        if isinstance(prompt, str):
            meta["text"] = prompt
        else:
            users = [m["content"] for m in prompt if m["role"] == "user"]
            meta["text"] = users[-1] if users else prompt[-1]["content"]
            meta["messages"] = [dict(m) for m in prompt]
        return Prompt(index, list(self._ids[i]), None, {**meta, "example": i, "source": self.path})

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        text = self.tokenizer.decode(cut_at_stop(response_ids, self.stop_token_ids))
        return math_reward(text, prompt.meta["answer"], timeout_s=self.verify_timeout_s)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


"""File-backed math-style task: one JSON object per line, rule-based 0/1 reward.

Line format (blank lines are skipped)::

    {"prompt": "What is 17 + 25?", "answer": "42"}

* the prompt is the first present of ``"prompt"``, ``"question"``, ``"problem"`` (a string);
* the answer is ``"answer"`` or else ``"solution"`` (a string or a number). GSM8K lines
  (``question`` + a worked ``answer`` ending in ``#### 42``) and MATH lines (``problem`` +
  ``solution`` with a ``\\boxed{}``) load as they are: the reference is taken from after
  ``####`` or from the box (see :mod:`moe_rl.tasks.answers`);
* ``"messages"`` (optional): the conversation as chat messages (``[{"role", "content"}]``);
  then the prompt key may be left out (the question is the last user message), and an HF
  tokenizer's chat template renders the messages instead of the templated question;
* other keys are ignored.

``Prompt.meta`` holds ``answer`` and, for agents (``env.openai_agent``), the question as
``text`` and the ``messages`` where the line has them.

A line that is not valid JSON, not an object, lacks a prompt or answer key, or has a value of
the wrong type raises :class:`DatasetError` naming ``file:line``; a file with no example
raises it too. The whole file is checked when the task is built, before any training.

Order: ``num_prompts`` = number of examples; ``prompt(index)`` walks epoch
``index // num_prompts`` in a permutation seeded by (data.seed, epoch), so the stream is
endless and a data position (an integer) resumes it exactly.

Tokenizer (``task_args.tokenizer``): ``"hf"`` loads ``transformers.AutoTokenizer`` from
``task_args.tokenizer_path`` or else ``model.path`` (transformers is imported only then);
``"byte"`` is a built-in byte-level tokenizer (PAD 0, BOS 1, EOS 2, byte b -> b + 3; 259 ids)
for tests and tiny models. Default: ``"hf"`` when a path is known, else ``"byte"`` (the choice
is logged once). With an HF tokenizer the prompt goes through its chat template
(``task_args.chat_template``, default true); ``task_args.template`` formats the text first
(default ``"{prompt}\\nPut your final answer within \\boxed{}."``).

Reward: decode the response up to its first stop token, extract the final answer, compare
(:func:`moe_rl.tasks.answers.math_reward`): 1.0 or 0.0.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .answers import math_reward, reference_answer
from .base import DatasetError, Prompt, cut_at_stop, rng_for

log = logging.getLogger(__name__)

PROMPT_KEYS = ("prompt", "question", "problem")
ANSWER_KEYS = ("answer", "solution")
DEFAULT_TEMPLATE = "{prompt}\nPut your final answer within \\boxed{{}}."


def load_examples(path: str | Path) -> list[dict[str, Any]]:
    """[{"prompt", "answer" (reference, extracted), "line"}] of a JSONL file; DatasetError on
    the first bad line (``file:line: reason``) or when the file holds no example."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{p}: no such dataset file")
    out = []
    with p.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            pk = next((k for k in PROMPT_KEYS if k in obj), None)
            ak = next((k for k in ANSWER_KEYS if k in obj), None)
            messages = obj.get("messages")
            if messages is not None:
                if not (isinstance(messages, list) and messages and all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in messages)):
                    raise DatasetError(f"{where}: 'messages' must be a non-empty list of {{\"role\": str, "
                                       f"\"content\": str}} objects")
                users = [m["content"] for m in messages if m["role"] == "user"]
                if pk is None and users:
                    obj, pk = {**obj, "prompt": users[-1]}, "prompt"
            if pk is None:
                raise DatasetError(f"{where}: missing prompt key (one of {', '.join(PROMPT_KEYS)})")
            if ak is None:
                raise DatasetError(f"{where}: missing answer key (one of {', '.join(ANSWER_KEYS)})")
            prompt, answer = obj[pk], obj[ak]
            if not isinstance(prompt, str):
                raise DatasetError(f"{where}: {pk!r} must be a string, got {type(prompt).__name__}")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise DatasetError(f"{where}: {ak!r} must be a string or a number, got {type(answer).__name__}")
            ref = reference_answer(str(answer))
            if not prompt.strip() or not ref:
                raise DatasetError(f"{where}: empty {pk if not prompt.strip() else ak!r}")
            out.append({"prompt": prompt, "answer": ref, "line": lineno, **({"messages": messages} if messages else {})})
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
            ids = self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                               add_generation_prompt=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer releases
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tok.encode(text, add_special_tokens=True))

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """A dataset's own chat messages through the chat template."""
        ids = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

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
    ):
        self.name = name
        self.path = str(path)
        self.seed = seed
        self.examples = load_examples(path)
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

    def prompt(self, index: int) -> Prompt:
        i = self.example_at(index)
        ex = self.examples[i]
        if i not in self._ids:
            chat = "messages" in ex and getattr(self.tokenizer, "chat_template", False)
            self._ids[i] = (self.tokenizer.encode_messages(ex["messages"]) if chat
                            else self.tokenizer.encode(self.template.format(prompt=ex["prompt"])))
        meta = {"answer": ex["answer"], "example": i, "line": ex["line"], "source": self.path, "text": ex["prompt"]}
        if "messages" in ex:
            meta["messages"] = [dict(m) for m in ex["messages"]]
        return Prompt(index, list(self._ids[i]), None, meta)

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        text = self.tokenizer.decode(cut_at_stop(response_ids, self.stop_token_ids))
        return math_reward(text, prompt.meta["answer"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


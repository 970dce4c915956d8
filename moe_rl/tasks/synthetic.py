"""Synthetic verifiable-reward tasks a tiny, randomly initialised MoE learns on a CPU.

Token layout (shared by every task here)::

    0 PAD   1 BOS   2 SEP   3 EOS   4 .. 4+num_symbols-1  symbols

so ``vocab_size_needed = 4 + num_symbols`` (<= the model's vocabulary; the tiny model has 64,
and the ids above the symbols are simply never rewarded).

Tasks (``data.task``):

* ``echo``     prompt ``[BOS, x, SEP]``; the answer is x, x, x, ... (``copy`` with length 1)
* ``copy``     prompt ``[BOS, s1..sk, SEP]``; the answer is s1..sk repeated cyclically
* ``reverse``  prompt ``[BOS, s1..sk, SEP]``; the answer is sk..s1 repeated cyclically

Reward (dense partial credit): with L the prompt's token budget (``Prompt.max_new_tokens``,
always set by these tasks), the fraction of the L answer positions that the response gets
right; the response is cut at its first EOS, so missing positions count as wrong. It lies in
[0, 1]; 1 means the whole budget is the right pattern.

Why this shape (the task has to be learnable by GRPO from a random init in a few dozen steps):

* Under the near-uniform policy of a fresh model each position is right with probability
  about 1/vocab (1/64), so the reward starts low but non-zero: with 16 tokens about one
  response in five earns some credit, which gives GRPO groups the within-group variance it
  needs (a 0/1 exact-match reward would be almost always 0 and give no signal).
* A small symbol set (4 by default) keeps the climb short enough for ~40 GRPO steps at
  8 prompts x 4 samples: measured on the tiny model (lr 3e-3, on-policy, one thread), echo
  goes from ~0.02 to 0.16-0.35 after 40 steps (three sampling seeds) and ~0.43 after 60,
  past the 0.25 ceiling of any prompt-independent policy; reverse (k=2) reaches 0.22-0.29
  after 40. With 8 symbols echo only reaches ~0.08 after 40 steps.
* Credit is per position, so every improvement is rewarded: first "emit symbols rather than
  other ids" (~1/num_symbols), then "emit the prompt's symbol" (echo: 1.0). The second step
  needs the prompt: a prompt-independent policy cannot exceed ~1/num_symbols, so a rising
  curve shows prompt-conditioned behaviour.
* Stopping early never pays, so responses fill their budget: with ``long_tail`` the
  response lengths follow the long-tailed budget distribution throughout training, which is
  what the async-vs-sync benchmark needs.

``task_args``:

* ``num_symbols`` (4): size of the symbol set;
* ``length`` (echo 1, copy/reverse 2): k, symbols per prompt;
* ``max_new_tokens``: the fixed per-prompt budget (default: ``rollout.max_new_tokens``);
* ``long_tail`` (false): draw each prompt's budget from a discretised, truncated Pareto
  distribution instead: ``L = floor(min * U^(-1/alpha))`` clipped to [min, max], U uniform,
  seeded by (data.seed, index). ``long_tail_min`` 4, ``long_tail_max`` 64,
  ``long_tail_alpha`` 1.0: median 7-8, mean about 14.5, P(L >= 32) ~ 1/8, P(L = 64) ~ 1/16 --
  most responses short, a few very long, as in reasoning RL.
"""
from __future__ import annotations

import math

from .base import Prompt, cut_at_stop, rng_for

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_SYMBOL = 4

_STREAM_SYMBOLS = 0  # rng stream tags: independent draws per purpose
_STREAM_LENGTH = 1


def long_tail_length(seed: int, index: int, lo: int = 4, hi: int = 64, alpha: float = 1.0) -> int:
    """A discretised Pareto(alpha) budget in [lo, hi], deterministic in (seed, index)."""
    u = rng_for(seed, index, _STREAM_LENGTH).random()
    x = lo * (1.0 - u) ** (-1.0 / alpha)  # 1-u in (0, 1]
    return int(min(hi, max(lo, math.floor(x))))


class PatternTask:
    """echo / copy / reverse: see the module docstring."""

    def __init__(
        self,
        name: str,
        *,
        seed: int = 0,
        num_symbols: int = 4,
        length: int | None = None,
        max_new_tokens: int = 16,
        long_tail: bool = False,
        long_tail_min: int = 4,
        long_tail_max: int = 64,
        long_tail_alpha: float = 1.0,
    ):
        if name not in ("echo", "copy", "reverse"):
            raise ValueError(f"unknown pattern task {name!r}")
        if length is None:
            length = 1 if name == "echo" else 2
        if name == "echo" and length != 1:
            raise ValueError("data.task_args.length: echo has length 1 (use copy for longer)")
        if num_symbols < 2:
            raise ValueError(f"data.task_args.num_symbols={num_symbols}: need at least 2")
        if length < 1:
            raise ValueError(f"data.task_args.length={length}: need at least 1")
        if max_new_tokens < 1:
            raise ValueError(f"data.task_args.max_new_tokens={max_new_tokens}: need at least 1")
        if long_tail and not 1 <= long_tail_min <= long_tail_max:
            raise ValueError("data.task_args: need 1 <= long_tail_min <= long_tail_max")
        if long_tail and long_tail_alpha <= 0:
            raise ValueError("data.task_args.long_tail_alpha must be > 0")
        self.name = name
        self.seed = seed
        self.num_symbols = num_symbols
        self.length = length
        self.max_new_tokens = max_new_tokens
        self.long_tail = long_tail
        self.long_tail_args = (long_tail_min, long_tail_max, long_tail_alpha)
        self.vocab_size_needed = FIRST_SYMBOL + num_symbols
        self.stop_token_ids = [EOS]
        self.num_prompts = None  # an endless generator

    def prompt(self, index: int) -> Prompt:
        rng = rng_for(self.seed, index, _STREAM_SYMBOLS)
        symbols = [FIRST_SYMBOL + int(s) for s in rng.integers(0, self.num_symbols, self.length)]
        pattern = symbols[::-1] if self.name == "reverse" else symbols
        if self.long_tail:
            budget = long_tail_length(self.seed, index, *self.long_tail_args)
        else:
            budget = self.max_new_tokens
        return Prompt(index, [BOS, *symbols, SEP], budget, {"pattern": pattern})

    def target(self, prompt: Prompt, n: int) -> list[int]:
        pattern = prompt.meta["pattern"]
        return [pattern[i % len(pattern)] for i in range(n)]

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        budget = prompt.max_new_tokens or self.max_new_tokens
        resp = cut_at_stop(response_ids, self.stop_token_ids)[:budget]
        want = self.target(prompt, len(resp))
        return sum(int(a == b) for a, b in zip(resp, want)) / budget

    def decode(self, ids: list[int]) -> str:
        names = {PAD: "<pad>", BOS: "<bos>", SEP: "|", EOS: "<eos>"}
        return " ".join(names.get(i, chr(ord("a") + i - FIRST_SYMBOL) if 0 <= i - FIRST_SYMBOL < 26
                                  else f"#{i}") for i in ids)

    def __repr__(self) -> str:
        lt = f", long_tail={self.long_tail_args}" if self.long_tail else ""
        return f"PatternTask({self.name!r}, symbols={self.num_symbols}, length={self.length}{lt})"


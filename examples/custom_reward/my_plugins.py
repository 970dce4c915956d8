"""A task and a reward of your own, plugged into moe-rl through the config alone.

    PYTHONPATH=examples/custom_reward moe-rl train examples/custom_reward/config.yaml

``data.task: my_plugins:make_task`` and ``reward.fn: my_plugins:majority_reward`` name the two
callables below (docs/environments.md describes the interfaces). Copy this file next to your
own code and change it.
"""
from __future__ import annotations

import numpy as np

from moe_rl.tasks import Prompt

BOS, SEP, EOS, FIRST = 1, 2, 3, 4  # token ids; the symbols are FIRST .. FIRST + num_symbols - 1


class MajorityTask:
    """Prompt: [BOS, s1 .. s5, SEP]; the answer: the symbol that occurs most often, repeated."""

    name = "majority"
    stop_token_ids = [EOS]
    num_prompts = None  # an endless, seeded stream

    def __init__(self, seed: int, num_symbols: int, max_new_tokens: int):
        self.seed, self.num_symbols, self.max_new_tokens = seed, num_symbols, max_new_tokens
        self.vocab_size_needed = FIRST + num_symbols

    def prompt(self, index: int) -> Prompt:
        # depends only on (seed, index): a resumed run sees the prompts it would have seen
        rng = np.random.default_rng([self.seed, index])
        symbols = [FIRST + int(s) for s in rng.integers(0, self.num_symbols, 5)]
        majority = max(set(symbols), key=lambda s: (symbols.count(s), -s))
        return Prompt(index, [BOS, *symbols, SEP], self.max_new_tokens, {"answer": majority})

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        return float(majority_reward(prompt, response_ids, "")["reward"])  # used without reward.fn

    def decode(self, ids: list[int]) -> str:
        return " ".join(chr(ord("a") + i - FIRST) if i >= FIRST else f"<{i}>" for i in ids)


def make_task(seed: int = 0, num_symbols: int = 4, max_new_tokens: int = 8) -> MajorityTask:
    """``data.task``: called with ``data.task_args``; ``seed`` and ``max_new_tokens`` come from
    the run (data.seed, rollout.max_new_tokens) unless task_args set them."""
    return MajorityTask(seed, num_symbols, max_new_tokens)


def majority_reward(prompt: Prompt, response_ids: list[int], response_text: str) -> dict:
    """``reward.fn``: the fraction of the budget that is the majority symbol, plus a metric that
    is logged as ``reward/hit_first`` (was the first token right?)."""
    answer, budget = prompt.meta["answer"], prompt.max_new_tokens
    resp = response_ids[: response_ids.index(EOS)] if EOS in response_ids else response_ids
    hits = sum(t == answer for t in resp[:budget])
    return {"reward": hits / budget, "hit_first": float(bool(resp) and resp[0] == answer)}

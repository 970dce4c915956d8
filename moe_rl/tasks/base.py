"""What a task is: a deterministic, integer-indexed prompt stream plus a reward function."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file and, for a bad line,
    its 1-based line number (``path:line: reason``)."""


@dataclass
class Prompt:
    """One prompt of a task's stream.

    ``index`` is its position in the stream (the data position a run resumes from);
    ``max_new_tokens`` overrides ``rollout.max_new_tokens`` for this prompt when not None;
    ``meta`` carries what the reward needs (the answer, the target, ...). Plain data,
    picklable, so rewards can be computed in worker processes.
    """

    index: int
    input_ids: list[int]
    max_new_tokens: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    """A shipped or file-backed task.

    * ``prompt(index)`` depends only on (``data.seed``, ``index``): a run that stopped after
      drawing prompts 0..k-1 resumes at index k and sees exactly the prompts it would have.
    * ``reward(prompt, response_ids)`` scores the generated tokens (the stop token may or
      may not be included; everything from the first stop token on is ignored). It may raise
      on a malformed response; the rollout manager's reward pool then marks that sample failed.
    * ``num_prompts``: distinct prompts per epoch, or None for an endless generator. Indices
      beyond it are valid: a file-backed task goes on with the next epoch, in a new seeded
      order.
    """

    name: str
    vocab_size_needed: int
    stop_token_ids: list[int]
    num_prompts: int | None

    def prompt(self, index: int) -> Prompt: ...

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float: ...

    def decode(self, ids: list[int]) -> str: ...


def rng_for(seed: int, *key: int) -> np.random.Generator:
    """A generator that depends only on (seed, *key): stable across runs, processes and
    platforms (numpy's SeedSequence hashing), independent between keys."""
    if seed < 0 or any(k < 0 for k in key):
        raise ValueError(f"seed and indices must be non-negative, got seed={seed}, key={key}")
    return np.random.default_rng([seed, *key])


def cut_at_stop(response_ids: list[int], stop_token_ids: list[int]) -> list[int]:
    """The response up to (not including) its first stop token."""
    stops = set(stop_token_ids)
    for i, tok in enumerate(response_ids):
        if tok in stops:
            return list(response_ids[:i])
    return list(response_ids)

"""Guess the number: a multi-turn task whose reward needs the environment's feedback.

``data.task: guess`` with ``env.factory: moe_rl.tasks.guess:GuessEnv`` (configs/guess_number.yaml).
A secret symbol is drawn per prompt; each model turn is one token, a guess; the environment
answers with one token, HIGHER or LOWER (or INVALID for a token that is not a symbol), and
ends the episode on a right guess. Token layout (that of :mod:`.synthetic`, plus feedback)::

    0 PAD  1 BOS  2 SEP  3 EOS  4 .. 4+K-1 symbols (the numbers 0..K-1)
    4+K HIGHER  4+K+1 LOWER  4+K+2 INVALID

Reward (per turn, summed over the episode): a right guess at turn t earns
``1 - 0.2 (t - 1)``; a wrong guess of a symbol not guessed before earns 0.05 (the first thing a
random model has to learn is to name symbols at all); anything else 0.

Why it needs the feedback: with K = 4 and 3 turns, binary search finds every secret (mean
reward (1 + 0.85 + 0.85 + 0.7) / 4 = 0.85), while the best policy that ignores the feedback (a
fixed order of three distinct guesses) misses one secret in four (mean 0.675). A fresh model
names a symbol with probability about K / vocab, so it starts near 0.
"""
from __future__ import annotations

import asyncio
import itertools

from .base import Prompt, rng_for
from .env import StepResult
from .synthetic import BOS, EOS, FIRST_SYMBOL, SEP


class GuessTask:
    """The prompt stream: ``[BOS, SEP]`` with a seeded secret in ``meta``."""

    name = "guess"

    def __init__(self, *, seed: int = 0, num_symbols: int = 4):
        if num_symbols < 2:
            raise ValueError(f"data.task_args.num_symbols={num_symbols}: need at least 2")
        self.seed, self.num_symbols = seed, num_symbols
        self.HIGHER, self.LOWER, self.INVALID = (FIRST_SYMBOL + num_symbols + i for i in range(3))
        self.vocab_size_needed = FIRST_SYMBOL + num_symbols + 3
        self.stop_token_ids = [EOS]
        self.num_prompts = None

    def prompt(self, index: int) -> Prompt:
        secret = int(rng_for(self.seed, index).integers(0, self.num_symbols))
        return Prompt(index, [BOS, SEP], 1, {"secret": FIRST_SYMBOL + secret})

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        """Single-turn use (no env.factory): one guess."""
        return float(bool(response_ids) and response_ids[0] == prompt.meta["secret"])

    def decode(self, ids: list[int]) -> str:
        names = {BOS: "<bos>", SEP: "|", EOS: "<eos>", self.HIGHER: "higher", self.LOWER: "lower",
                 self.INVALID: "invalid"}
        return " ".join(names.get(i, str(i - FIRST_SYMBOL) if 0 <= i - FIRST_SYMBOL < self.num_symbols else f"#{i}")
                        for i in ids)


class GuessEnv:
    """One episode of guess-the-number (module docstring); ``task`` is the run's GuessTask."""

    _episodes = itertools.count()  # distinct latency draws per episode

    def __init__(self, task: GuessTask, *, latency_s: float = 0.0, latency_max_s: float = 2.0,
                 latency_alpha: float = 1.0):
        """``latency_s`` > 0 simulates a slow environment (``moe-rl bench async --multi-turn``):
        each step sleeps a Pareto(``latency_alpha``) time, at least ``latency_s``, at most
        ``latency_max_s`` -- mostly short, a few very long, as tool calls and sandboxes are."""
        if not isinstance(task, GuessTask):
            raise TypeError(f"GuessEnv needs data.task=guess, got {getattr(task, 'name', task)!r}")
        if latency_s < 0 or latency_alpha <= 0 or latency_max_s < latency_s:
            raise ValueError("env.args: need 0 <= latency_s <= latency_max_s and latency_alpha > 0")
        self.task = task
        self.latency = (latency_s, latency_max_s, latency_alpha)
        self.rng = rng_for(task.seed, next(self._episodes), 1)
        self.secret, self.turn, self.tried = None, 0, set()

    async def reset(self, prompt: Prompt) -> list[int]:
        self.secret, self.turn, self.tried = prompt.meta["secret"], 0, set()
        return list(prompt.input_ids)

    async def step(self, action_ids: list[int], action_text: str) -> StepResult:
        self.turn += 1
        t = self.task
        lo, hi, alpha = self.latency
        if lo > 0:
            await asyncio.sleep(min(hi, lo * (1.0 - self.rng.random()) ** (-1.0 / alpha)))
        guess = action_ids[0] if action_ids else EOS
        if guess == self.secret:
            return StepResult([], 1.0 - 0.2 * (self.turn - 1), True, {"found": 1})
        if not FIRST_SYMBOL <= guess < FIRST_SYMBOL + t.num_symbols:
            return StepResult([t.INVALID, SEP], 0.0, False, {})
        reward = 0.05 if guess not in self.tried else 0.0
        self.tried.add(guess)
        return StepResult([t.HIGHER if self.secret > guess else t.LOWER, SEP], reward, False, {})

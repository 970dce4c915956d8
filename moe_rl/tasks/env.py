"""The multi-turn environment protocol (DESIGN.md contract 7; docs/environments.md).

An environment plays one episode. It is made by the ``env.factory`` plug-in, once per episode::

    class MyEnv:
        async def reset(self, prompt: Prompt) -> list[int]:
            # the episode's first observation (token ids): what the model sees first
        async def step(self, action_ids: list[int], action_text: str) -> StepResult | tuple:
            # the model's turn (ids as generated, and their text) ->
            # (observation ids, reward, done, info)

Both methods may be plain (sync) functions: they then run in a worker thread, so a slow
environment never blocks the rollout loop. Observations are token ids, appended to the
episode's one token sequence as they are (never re-tokenised); an environment that thinks in
text encodes its observation itself (``task.tokenizer`` / the task's ``encode``), once.

The rollout side (``moe_rl/rollout/episode.py``) bounds the number of model turns
(``env.max_turns``), the episode's tokens and its wall time; a bad value returned by an
environment is an :class:`EnvError` naming ``env.factory`` and the method.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Protocol

from .base import Prompt
from .plugins import PluginError, call_with_optional, load_plugin


@dataclass
class StepResult:
    observation: list[int]  # token ids appended after the model's turn (ignored when done)
    reward: float = 0.0  # this turn's reward; the episode's reward is the sum over its turns
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    async def reset(self, prompt: Prompt) -> list[int]: ...

    async def step(self, action_ids: list[int], action_text: str) -> StepResult: ...


class EnvError(RuntimeError):
    """An environment that raised or returned a bad value, for one episode."""


class EnvFactory:
    """``env.factory`` loaded once; ``make()`` builds one environment per episode."""

    def __init__(self, path: str, args: dict, task, vocab_size: int | None = None):
        self.path, self.args, self.task, self.vocab_size = path, dict(args), task, vocab_size
        self.who = f"env.factory ({path})"
        self.factory = load_plugin(path, "env.factory")
        env = self.make()  # fail at start-up, not in the first episode, on a bad factory
        for m in ("reset", "step"):
            if not callable(getattr(env, m, None)):
                raise PluginError(f"{self.who}: returned a {type(env).__name__} without a {m}() method "
                                  "(see moe_rl.tasks.env.Environment)")

    def make(self):
        try:
            return call_with_optional(self.factory, self.args, {"task": self.task})
        except TypeError as e:
            raise PluginError(f"{self.who} with env.args={self.args}: {e}") from e

    async def call(self, env, method: str, *args):
        """``env.method(*args)``, awaited if async, else run in a worker thread."""
        fn = getattr(env, method)
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args)
            out = await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))
            return await out if inspect.isawaitable(out) else out
        except (asyncio.CancelledError, asyncio.TimeoutError):
            raise
        except Exception as e:
            raise EnvError(f"{self.who}: {method}() raised {type(e).__name__}: {e}") from e

    def check_ids(self, ids: Any, what: str) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise EnvError(f"{self.who}: {what} must be a list of token ids (ints), got {type(ids).__name__} "
                           f"{str(ids)[:80]}")
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in ids):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise EnvError(f"{self.who}: {what} holds token id {bad}, outside the model's vocabulary "
                           f"[0, {self.vocab_size})")
        return list(ids)

    def check_step(self, out: Any) -> StepResult:
        if isinstance(out, tuple) and len(out) == 4:
            out = StepResult(*out)
        if not isinstance(out, StepResult):
            raise EnvError(f"{self.who}: step() returned {type(out).__name__}; expected a StepResult or "
                           "(observation ids, reward, done, info)")
        obs = self.check_ids(out.observation, "step()'s observation")
        if not isinstance(out.reward, Real) or not math.isfinite(out.reward):
            raise EnvError(f"{self.who}: step()'s reward {out.reward!r} is not a finite number")
        if not isinstance(out.done, bool):
            raise EnvError(f"{self.who}: step()'s done {out.done!r} is not a bool")
        if not isinstance(out.info, dict):
            raise EnvError(f"{self.who}: step()'s info is a {type(out.info).__name__}, not a dict")
        return StepResult(obs, float(out.reward), out.done, out.info)

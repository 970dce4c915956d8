"""Plug-ins named in the config by import path ``package.module:name`` (DESIGN.md contract 8).

* ``data.task``   a factory returning a Task; called with ``data.task_args`` as keyword
                  arguments, plus ``seed`` / ``model_path`` / ``max_new_tokens`` /
                  ``tokenizer_path`` (model.tokenizer_path, else model.path) when it declares
                  parameters of those names.
* ``reward.fn``   ``fn(prompt, response_ids, response_text)``, sync or async, returning a float
                  or a dict with a float ``"reward"`` and other numeric metrics (logged).
* ``env.factory`` called once per episode with ``env.args`` (and ``task=`` when it declares
                  it); returns an environment (:mod:`moe_rl.tasks.env`).
* ``env.openai_agent`` an async ``agent(client, prompt, **env.args)`` called once per episode
                  (:mod:`moe_rl.rollout.agent`).

Every failure names the config key and the plug-in: :class:`PluginError` at load time (cannot
import, not callable, wrong signature, bad task), and for a reward at run time (raises, bad
value) -- the rollout manager then marks that one sample failed and the run goes on.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import sys
from numbers import Real
from typing import Any, Callable

from ..config import ConfigError
from .base import Prompt, cut_at_stop


class PluginError(ConfigError):
    """A plug-in that cannot be used; the message starts with ``config.key (plug-in path):``."""


def is_plugin_path(value: str) -> bool:
    return ":" in value


def load_plugin(path: str, key: str) -> Callable:
    """The callable at ``package.module:name``; errors name ``key`` and ``path``."""
    mod_name, _, attr = path.partition(":")
    if not mod_name or not attr:
        raise PluginError(f"{key}: {path!r} is not an import path 'package.module:name'")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or the module itself raising on import
        raise PluginError(f"{key} ({path}): cannot import module {mod_name!r}: {type(e).__name__}: {e} "
                          f"(is its directory on PYTHONPATH? sys.path[0]={sys.path[0]!r})") from e
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(mod) if not n.startswith("_"))
            raise PluginError(f"{key} ({path}): module {mod_name!r} has no attribute {attr!r}; "
                              f"it defines: {', '.join(public[:20])}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginError(f"{key} ({path}): {type(obj).__name__} object is not callable")
    return obj


def check_signature(fn: Callable, key: str, path: str, *args, **kwargs) -> None:
    """PluginError unless ``fn(*args, **kwargs)`` binds."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError) as e:
        try:
            sig = str(inspect.signature(fn))
        except (TypeError, ValueError):
            sig = "(?)"
        raise PluginError(f"{key} ({path}): wrong signature {sig}: {e}") from None


def call_with_optional(fn: Callable, args: dict, optional: dict) -> Any:
    """``fn(**args, **{k: v for the optional keywords fn declares})``."""
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    extra = {k: v for k, v in optional.items() if k in params or (takes_all and k not in args)}
    return fn(**args, **extra)


# --- tasks ---------------------------------------------------------------------------------
_TASK_MEMBERS = ("name", "vocab_size_needed", "stop_token_ids", "num_prompts", "prompt", "reward", "decode")


def load_task(data, *, model_path: str | None, max_new_tokens: int, tokenizer_path: str | None = None):
    """The Task made by the factory at ``data.task``."""
    key = "data.task"
    factory = load_plugin(data.task, key)
    optional = {"seed": data.seed, "model_path": model_path, "max_new_tokens": max_new_tokens,
                "tokenizer_path": tokenizer_path or model_path}
    params = inspect.signature(factory).parameters
    check_signature(factory, key, data.task, **data.task_args,
                    **{k: v for k, v in optional.items() if k in params and k not in data.task_args})
    try:
        task = call_with_optional(factory, dict(data.task_args), {k: v for k, v in optional.items()
                                                                   if k not in data.task_args})
    except ConfigError:
        raise
    except Exception as e:
        raise PluginError(f"{key} ({data.task}) with data.task_args={data.task_args}: raised "
                          f"{type(e).__name__}: {e}") from e
    missing = [m for m in _TASK_MEMBERS if not hasattr(task, m)]
    if missing:
        raise PluginError(f"{key} ({data.task}): returned a {type(task).__name__}, not a Task: it lacks "
                          f"{', '.join(missing)} (see moe_rl.tasks.base.Task)")
    return task


# --- rewards -------------------------------------------------------------------------------
class RewardError(ValueError):
    """A reward (shipped or plug-in) that raised or returned a bad value, for one sample."""


def reward_value(out: Any, who: str) -> tuple[float, dict[str, float]]:
    """(reward, extra metrics) from what a reward returned: a finite real number, or a dict with a
    finite real ``"reward"`` and other finite real metrics."""
    metrics: dict[str, float] = {}
    if isinstance(out, dict):
        if "reward" not in out:
            raise RewardError(f"{who}: returned a dict without a 'reward' key (keys: {sorted(out)})")
        for k, v in out.items():
            if k == "reward":
                continue
            if not isinstance(k, str) or not isinstance(v, Real) or not math.isfinite(v):
                raise RewardError(f"{who}: metric {k!r}={v!r} is not a finite number")
            metrics[k] = float(v)
        out = out["reward"]
    if not isinstance(out, Real):
        raise RewardError(f"{who}: returned {type(out).__name__} {out!r}; expected a float or a dict "
                          "with a float 'reward'")
    if not math.isfinite(out):
        raise RewardError(f"{who}: returned {out!r}; the reward must be finite")
    return float(out), metrics


class PluginRewardTask:
    """A task whose reward is the plug-in at ``reward.fn`` (everything else is the task's)."""

    def __init__(self, task, path: str):
        self.task, self.path = task, path
        self.fn = load_plugin(path, "reward.fn")
        check_signature(self.fn, "reward.fn", path, Prompt(0, [1]), [1], "text")
        self.is_async = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            getattr(self.fn, "__call__", None))

    def __getattr__(self, name):  # prompt, decode, stop_token_ids, num_prompts, ...
        return getattr(self.task, name)

    def reward(self, prompt: Prompt, response_ids: list[int]):
        """Called in the manager's reward worker threads, so an async reward gets its own loop."""
        text = self.task.decode(cut_at_stop(response_ids, self.task.stop_token_ids))
        who = f"reward.fn ({self.path})"
        try:
            out = self.fn(prompt, list(response_ids), text)
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
        except Exception as e:
            raise RewardError(f"{who}: raised {type(e).__name__}: {e}") from e
        r, metrics = reward_value(out, who)  # checked here, so the error names the plug-in
        return {"reward": r, **metrics} if metrics else r


async def _awaited(aw):
    return await aw


def check_plugins(cfg) -> list[str]:
    """Imports every plug-in the config names (``moe-rl validate``), checking the reward's
    signature; PluginError on the first that cannot be used. Returns what was checked."""
    checked = []
    if is_plugin_path(cfg.data.task):
        load_plugin(cfg.data.task, "data.task")
        checked.append(f"data.task={cfg.data.task}")
    if cfg.reward.fn:
        fn = load_plugin(cfg.reward.fn, "reward.fn")
        check_signature(fn, "reward.fn", cfg.reward.fn, Prompt(0, [1]), [1], "text")
        checked.append(f"reward.fn={cfg.reward.fn}")
    if cfg.env.factory:
        load_plugin(cfg.env.factory, "env.factory")
        checked.append(f"env.factory={cfg.env.factory}")
    if cfg.env.openai_agent:
        fn = load_plugin(cfg.env.openai_agent, "env.openai_agent")
        check_signature(fn, "env.openai_agent", cfg.env.openai_agent, None, Prompt(0, [1]), **cfg.env.args)
        checked.append(f"env.openai_agent={cfg.env.openai_agent}")
    return checked

"""Shipped tasks and dataset loaders, behind one registry.

``get_task(cfg.data, model_path=cfg.model.path, max_new_tokens=cfg.rollout.max_new_tokens)``
(or ``task_from_config(cfg)``) builds the task named by ``data.task``:

=============  ==================================================================  ==========
name           what                                                                 prompts
=============  ==================================================================  ==========
``echo``       tiny-model task: repeat the prompt's symbol (:mod:`.synthetic`)      endless
``copy``       repeat the prompt's k symbols cyclically                             endless
``reverse``    repeat the prompt's k symbols reversed, cyclically                   endless
``jsonl``      math problems at ``data.path`` (JSONL, Parquet, ``datasets`` dir),   the file's
               0/1 reward by math-verify (:mod:`.jsonl`)
``arith``      ``jsonl`` on the shipped ``data/arith_example.jsonl`` (48 problems)   48
``guess``      guess the number, multi-turn with ``env.factory:                     endless
               moe_rl.tasks.guess:GuessEnv`` (:mod:`.guess`)
=============  ==================================================================  ==========

``data.task_args`` are the task's keyword arguments (documented in each module); an unknown
key is an error naming it. Every task draws prompt ``index`` deterministically from
(``data.seed``, index), so a run resumes from an integer data position.
"""
from __future__ import annotations

import difflib
import inspect
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError, DataConfig
from .answers import math_reward, reference_answer
from .base import DatasetError, Prompt, Task, cut_at_stop
from .guess import GuessEnv, GuessTask
from .plugins import PluginError, PluginRewardTask, RewardError, is_plugin_path, load_task, reward_value
from .jsonl import ByteTokenizer, JsonlMathTask, load_examples
from .synthetic import PatternTask, long_tail_length

DATA_DIR = Path(__file__).parent / "data"
ARITH_EXAMPLE = DATA_DIR / "arith_example.jsonl"

# name -> (factory(data, model_path, max_new_tokens, **task_args), the class whose keyword
# arguments are the accepted task_args)
_Factory = Callable[..., Task]
_REGISTRY: dict[str, tuple[_Factory, Callable]] = {}


def register_task(name: str, factory: _Factory, args_of: Callable) -> None:
    """Adds a task: ``factory(data_cfg, model_path, max_new_tokens, **task_args) -> Task``;
    ``args_of``'s keyword-only parameters are the task_args it accepts."""
    _REGISTRY[name] = (factory, args_of)


def task_names() -> list[str]:
    return sorted(_REGISTRY)


def _pattern(name: str) -> _Factory:
    def make(data: DataConfig, model_path, max_new_tokens, **args) -> Task:
        return PatternTask(name, seed=data.seed, **{"max_new_tokens": max_new_tokens, **args})

    return make


def _jsonl(path_override: Path | None, name: str) -> _Factory:
    def make(data: DataConfig, model_path, max_new_tokens, **args) -> Task:
        path = path_override or data.path
        if not path:
            raise ConfigError(f"data.task={name} needs data.path (a JSONL file)")
        return JsonlMathTask(path, seed=data.seed, name=name, model_path=model_path, format=data.format,
                             prompt_key=data.prompt_key, answer_key=data.answer_key, **args)

    return make


for _n in ("echo", "copy", "reverse"):
    register_task(_n, _pattern(_n), PatternTask.__init__)
register_task("jsonl", _jsonl(None, "jsonl"), JsonlMathTask.__init__)
register_task("guess", lambda data, model_path, max_new_tokens, **args: GuessTask(seed=data.seed, **args),
              GuessTask.__init__)
register_task("arith", _jsonl(ARITH_EXAMPLE, "arith"), JsonlMathTask.__init__)

_NOT_TASK_ARGS = {"self", "name", "seed", "path", "model_path", "format", "prompt_key", "answer_key"}  # data.*


def get_task(data: DataConfig, *, model_path: str | None = None, max_new_tokens: int = 16,
             tokenizer_path: str | None = None) -> Task:
    """The task ``data.task`` with ``data.task_args``; ``model_path`` is where an HF
    tokenizer is found (``model.path``), ``max_new_tokens`` the default response budget
    (``rollout.max_new_tokens``) for tasks whose reward depends on it. A ``data.task`` of the
    form ``package.module:factory`` is a plug-in (:mod:`.plugins`)."""
    if is_plugin_path(data.task):
        return load_task(data, model_path=model_path, max_new_tokens=max_new_tokens, tokenizer_path=tokenizer_path)
    if data.task not in _REGISTRY:
        close = difflib.get_close_matches(data.task, list(_REGISTRY), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"data.task: unknown task {data.task!r}{hint}; known: {', '.join(task_names())}")
    factory, args_of = _REGISTRY[data.task]
    params = inspect.signature(args_of).parameters
    known = [k for k, p in params.items() if k not in _NOT_TASK_ARGS and p.kind is p.KEYWORD_ONLY]
    for key in data.task_args:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean 'data.task_args.{close[0]}'?)" if close else ""
            raise ConfigError(f"data.task_args.{key}: not an argument of task {data.task!r}{hint}; "
                              f"accepted: {', '.join(known)}")
    try:
        return factory(data, model_path, max_new_tokens, **data.task_args)
    except DatasetError:
        raise
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        msg = str(e)
        raise ConfigError(msg if msg.startswith("data.") else f"data.task_args (task {data.task!r}): {msg}") from e


def task_from_config(cfg: Any) -> Task:
    """``get_task`` for a whole ``ExperimentConfig``, its reward replaced by ``reward.fn`` if set."""
    task = get_task(cfg.data, model_path=cfg.model.path, max_new_tokens=cfg.rollout.max_new_tokens,
                    tokenizer_path=cfg.model.tokenizer_path)
    fn = getattr(getattr(cfg, "reward", None), "fn", None)
    return PluginRewardTask(task, fn) if fn else task


__all__ = [
    "Task",
    "Prompt",
    "DatasetError",
    "get_task",
    "task_from_config",
    "register_task",
    "task_names",
    "PatternTask",
    "JsonlMathTask",
    "ByteTokenizer",
    "load_examples",
    "long_tail_length",
    "reference_answer",
    "math_reward",
    "cut_at_stop",
    "ARITH_EXAMPLE",
    "GuessTask",
    "GuessEnv",
    "PluginError",
    "RewardError",
    "reward_value",
]

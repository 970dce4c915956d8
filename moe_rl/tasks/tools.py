"""Tool calling: an environment adaptor that runs the tools a model calls, in Qwen's format.

``env.factory: moe_rl.tasks.tools:ToolEnv`` on top of any text task (``jsonl``/``arith``, or a
plug-in task with a ``tokenizer``). Each model turn's text is searched for::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>

(Qwen2.5/Qwen3's ``hermes`` format). Every call is run -- registered Python callables, each
in a worker thread with ``timeout_s`` and its result cut to ``max_result_chars`` -- and the
results, each ``<tool_response>...</tool_response>``, become the next observation (through
``observation_template``, encoded once to ids). A turn without a tool call is the final
answer: the task's reward scores it and the episode ends. A malformed call, an unknown tool,
a tool that raises or times out is not an environment failure: the model is told in the
observation (and learns not to), ``info["tool_errors"]`` counts it.

``env.args``: ``tools`` ({name: "package.module:function"}; default: the calculator below),
``timeout_s`` (5), ``max_result_chars`` (1000), ``observation_template`` (must hold
``{results}``; for an HF chat model close the assistant turn and open the next one, see
examples/calculator_tool/config.yaml).
"""
from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import json
import operator
import re

from .base import Prompt
from .env import StepResult
from .plugins import PluginError, load_plugin

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_POOL = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="tool")  # shared by all episodes


def parse_tool_calls(text: str) -> list[dict | str]:
    """The calls in ``text``: ``{"name", "arguments"}`` dicts, or an error string for a
    malformed one (kept in order, so the model is told which call was wrong)."""
    calls: list[dict | str] = []
    for raw in TOOL_CALL.findall(text):
        try:
            call = json.loads(raw)
        except json.JSONDecodeError as e:
            calls.append(f"error: tool call is not valid JSON ({e.msg} at char {e.pos})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('error: a tool call must be {"name": ..., "arguments": {...}}')
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models send the arguments JSON-encoded
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(f"error: the arguments of {call['name']} must be an object")
            continue
        calls.append({"name": call["name"], "arguments": args})
    return calls


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluates arithmetic (+ - * / // % ** and parentheses on numbers), never Python code."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    value = ev(ast.parse(str(expression), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 10) if isinstance(value, float) else value)


class ToolEnv:
    """One episode of a task with tools (module docstring)."""

    def __init__(self, task, *, tools: dict[str, str] | None = None, timeout_s: float = 5.0,
                 max_result_chars: int = 1000,
                 observation_template: str = "\n{results}\n"):
        tok = getattr(task, "tokenizer", None)
        if tok is None or not hasattr(tok, "encode_text"):
            raise PluginError(f"env.factory (ToolEnv): task {getattr(task, 'name', task)!r} has no text tokenizer "
                              "(use data.task=jsonl/arith, or a task with a .tokenizer)")
        if "{results}" not in observation_template:
            raise PluginError("env.args.observation_template must contain '{results}'")
        self.task, self.tok = task, tok
        self.tools = {"calculator": calculator} if tools is None else {
            name: load_plugin(path, f"env.args.tools.{name}") for name, path in tools.items()}
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars
        self.template = observation_template
        self.prompt: Prompt | None = None

    async def reset(self, prompt: Prompt) -> list[int]:
        self.prompt = prompt
        return list(prompt.input_ids)

    async def step(self, action_ids: list[int], action_text: str) -> StepResult:
        calls = parse_tool_calls(action_text)
        if not calls:  # the final answer
            return StepResult([], float(self.task.reward(self.prompt, action_ids)), True, {"tool_calls": 0})
        results, errors = [], 0
        for call in calls:
            out = call if isinstance(call, str) else await self._run(call["name"], call["arguments"])
            errors += out.startswith("error:")
            results.append(f"<tool_response>\n{out}\n</tool_response>")
        obs = self.tok.encode_text(self.template.format(results="\n".join(results)))
        return StepResult(obs, 0.0, False, {"tool_calls": len(calls), "tool_errors": errors})

    async def _run(self, name: str, arguments: dict) -> str:
        fn = self.tools.get(name)
        if fn is None:
            return f"error: unknown tool {name!r}; tools: {', '.join(sorted(self.tools))}"
        loop = asyncio.get_running_loop()
        try:  # a timed-out tool's thread cannot be killed; its result is dropped
            out = await asyncio.wait_for(loop.run_in_executor(_POOL, lambda: fn(**arguments)), self.timeout_s)
        except asyncio.TimeoutError:
            return f"error: {name} timed out after {self.timeout_s} s"
        except Exception as e:
            return f"error: {name} raised {type(e).__name__}: {e}"
        text = out if isinstance(out, str) else json.dumps(out, default=str)
        if len(text) > self.max_result_chars:
            text = text[: self.max_result_chars] + f"... [truncated {len(text) - self.max_result_chars} chars]"
        return text

"""The tool-calling adaptor: Qwen-style calls parsed from the model's text, tools run with a
timeout and a result-size limit, results as the next observation (ids, no BOS)."""
import asyncio
import time

import pytest

from moe_rl.config import load_config
from moe_rl.tasks import ARITH_EXAMPLE, JsonlMathTask, PluginError, task_from_config
from moe_rl.tasks.tools import ToolEnv, calculator, parse_tool_calls


def slow_tool(seconds: float):
    time.sleep(seconds)
    return "late"


def big_tool(n: int):
    return "x" * n


def call(name, **args):
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


@pytest.fixture
def env():
    task = JsonlMathTask(ARITH_EXAMPLE, tokenizer="byte")
    e = ToolEnv(task, tools={"calculator": "moe_rl.tasks.tools:calculator", "slow": "tests.tasks.test_tools:slow_tool",
                             "big": "tests.tasks.test_tools:big_tool"},
                timeout_s=0.2, max_result_chars=20)
    return task, e


def run(coro):
    return asyncio.run(coro)


def test_parse_tool_calls():
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> and '
            '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{oops}</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[0] == {"name": "calculator", "arguments": {"expression": "1+2"}}
    assert calls[1] == {"name": "f", "arguments": {"a": 1}}
    assert calls[2].startswith("error: tool call is not valid JSON")
    assert parse_tool_calls("The answer is 7.") == []


def test_calculator_is_arithmetic_only():
    assert calculator("12 * (3 + 4)") == "84" and calculator("7 / 2") == "3.5" and calculator("-2 ** 3") == "-8"
    for bad in ("__import__('os')", "2 ** 1000", "[1, 2]", "a + 1"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_tool_results_become_the_next_observation(env):
    task, e = env
    p = task.prompt(0)
    assert run(e.reset(p)) == p.input_ids
    res = run(e.step([], call("calculator", expression="5315 + 2481")))
    assert not res.done and res.reward == 0.0 and res.info == {"tool_calls": 1, "tool_errors": 0}
    assert task.decode(res.observation) == "\n<tool_response>\n7796\n</tool_response>\n"
    assert 1 not in res.observation, "no BOS inside an episode"


@pytest.mark.parametrize("text, expected", [
    (call("slow", seconds=2), "error: slow timed out after 0.2 s"),
    (call("big", n=50), "x" * 20 + "... [truncated 30 chars]"),
    (call("nope"), "error: unknown tool 'nope'; tools: big, calculator, slow"),
    (call("calculator", expression="a+1"), "error: calculator raised ValueError: unsupported expression element Name"),
    (call("calculator", wrong=1), "error: calculator raised TypeError"),
])
def test_tool_errors_and_limits_are_told_to_the_model(env, text, expected):
    task, e = env
    run(e.reset(task.prompt(0)))
    t0 = time.monotonic()
    res = run(e.step([], text))
    assert time.monotonic() - t0 < 1.5
    assert expected in task.decode(res.observation) and not res.done


def test_final_answer_is_scored_by_the_task(env):
    task, e = env
    p = task.prompt(0)
    run(e.reset(p))
    answer = p.meta["answer"]
    good = task.tokenizer.encode_text(f"The answer is \\boxed{{{answer}}}") + task.stop_token_ids
    res = run(e.step(good, task.decode(good)))
    assert res.done and res.reward == task.reward(p, good) == 1.0
    res = run(e.step(task.tokenizer.encode_text("\\boxed{0.123}"), "\\boxed{0.123}"))
    assert res.done and res.reward == 0.0


def test_tool_env_needs_a_text_task():
    cfg = load_config("configs/tiny.yaml")
    with pytest.raises(PluginError, match="has no text tokenizer"):
        ToolEnv(task_from_config(cfg))
    with pytest.raises(PluginError, match="env.args.tools.calc .*cannot import"):
        ToolEnv(JsonlMathTask(ARITH_EXAMPLE, tokenizer="byte"), tools={"calc": "nowhere.mod:f"})


def test_real_model_example_validates():
    """examples/calculator_tool: a Qwen3-MoE checkpoint doing arithmetic with the calculator."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "moe_rl.cli", "validate", "examples/calculator_tool/config.yaml"],
                         cwd=repo, capture_output=True, text=True, env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "env.factory=moe_rl.tasks.tools:ToolEnv" in out.stdout

"""A `moe-rl train` world whose episodes are played by an OpenAI-API agent learns."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.train.tracking import read_metrics

pytest.importorskip("openai")
pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


async def call_a_tool(client, prompt):
    """Reward 1 when the model's reply is a tool call (a random model: ~1 in 6)."""
    r = await client.chat.completions.create(model="policy", messages=prompt.meta["messages"],
                                             tools=[{"type": "function", "function": {"name": "compare"}},
                                                    {"type": "function", "function": {"name": "answer"}}])
    return {"reward": float(bool(r.choices[0].message.tool_calls)), "calls": 1.0}


@pytest.mark.slow  # a `moe-rl train` world
def test_an_openai_agent_world_learns(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples" / "openai_agent")]))
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "configs/openai_agent.yaml", f"output_dir={out}",
                        "logging.progress=false", "train.steps=12", "train.lr=0.003", "env.args={}",
                        "env.openai_agent=tests.train.test_agent_train:call_a_tool"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 13))
    for row in rows:
        assert row["samples"] == 8 * 8 and row["failed_samples"] == 0 and row.get("env_failures", 0) == 0
        assert row["train_tokens"] == row["samples"]  # one call of one token each: the model's only
        assert row["reward/calls"] == 1.0
        assert row.get("routing_match", 1.0) == 1.0  # R3 from the engine's records
    first = sum(row["reward_mean"] for row in rows[:3]) / 3
    last = sum(row["reward_mean"] for row in rows[-3:]) / 3
    assert last > first + 0.2, [round(row["reward_mean"], 3) for row in rows]
    assert (out / "checkpoints" / "step_12" / "hf" / "chat_template.jinja").is_file()

"""A `moe-rl train` world whose episodes are played by an OpenAI-API agent trains: every
sample comes from the engine's records (one call of one token each), R3 replays them, and the
checkpoint's hf/ is a complete model directory. Whether the example learns is a benchmark
(examples/openai_agent/bench.py --learn), not a test: it takes minutes."""
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
    """Reward 1 when the model's reply is a tool call."""
    r = await client.chat.completions.create(model="policy", messages=prompt.meta["messages"],
                                             tools=[{"type": "function", "function": {"name": "compare"}},
                                                    {"type": "function", "function": {"name": "answer"}}])
    return {"reward": float(bool(r.choices[0].message.tool_calls)), "calls": 1.0}


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
def test_an_openai_agent_world_trains(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples" / "openai_agent")]))
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "configs/openai_agent.yaml", f"output_dir={out}",
                        "logging.progress=false", "train.steps=2", "rollout.prompts_per_step=2",
                        "rollout.group_size=4", "env.args={}",
                        "env.openai_agent=tests.train.test_agent_train:call_a_tool"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["samples"] == 2 * 4 and row["failed_samples"] == 0 and row.get("env_failures", 0) == 0
        assert row["train_tokens"] == row["samples"]  # one call of one token each: the model's only
        assert row["reward/calls"] == 1.0
        assert row.get("routing_match", 1.0) == 1.0  # R3 from the engine's records
    assert (out / "checkpoints" / "step_2" / "hf" / "chat_template.jinja").is_file()

"""The target run: ``moe-rl train`` against an SGLang stand-in (``standin_server``: SGLang's own
rendezvous and bucket code in two TP-rank processes, SGLang's request types checked on every
call) completes several weight syncs, and every tensor received equals the trainer's; an
OpenAI-API agent trains on it through the agent worker's gateway."""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from .conftest import require_sglang  # noqa: E402

require_sglang("sglang.srt.utils.common")

from safetensors.torch import load_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _standin(tmp_path, config: str, env: dict):
    """The stand-in server for ``config``: yields (its URL, its OUT directory, its output lines)."""
    so = tmp_path / "standin"
    srv = subprocess.Popen([sys.executable, "-m", "tests.sglang.standin_server", config, str(so)], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, lines, ready = [], [], threading.Event()

    def drain():
        for line in srv.stdout:
            lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert ready.wait(180) and url, "".join(lines[-30:])
        yield url[0], so, lines
    finally:
        srv.terminate()
        try:
            srv.wait(20)
        except subprocess.TimeoutExpired:
            srv.kill()


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
def test_moe_rl_train_syncs_an_sglang_standin_with_two_tp_ranks(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with _standin(tmp_path, "configs/tiny.yaml", env) as (url, so, lines):
        out = tmp_path / "run"
        r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "configs/tiny.yaml", f"output_dir={out}",
                            "logging.progress=false", "engine.kind=sglang", f'engine.urls=["{url}"]', "pools.rollout=0",
                            "train.steps=3", "sync.pause_mode=abort"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:] + "".join(lines[-20:])
        log = [json.loads(x) for x in (so / "log.jsonl").read_text().splitlines()]
        kinds = [e["kind"] for e in log]
        init = [e for e in log if e["kind"] == "init"]
        assert len(init) == 1 and (init[0]["rank_offset"], init[0]["world_size"]) == (1, 3)  # 1 sender + 2 TP ranks
        loaded = [e for e in log if e["kind"] == "loaded"]
        assert [e["version"] for e in loaded] == ["1", "2", "3"] and all(e["tp_ranks_equal"] for e in loaded)
        assert kinds.count("begin") == kinds.count("end") == 3
        flush = [e["flush_cache"] for e in log if e["kind"] == "update"]
        assert flush[-1] is True  # abort pauses: the last bucket of each sync flushes
        # the last sync carried the trainer's final weights: compare with its final checkpoint
        got = torch.load(so / "received.pt")
        assert got["version"] == "3"
        hf = {}
        for f in sorted((out / "checkpoints" / "step_3" / "hf").glob("*.safetensors")):
            hf.update(load_file(f))
        assert got["tensors"].keys() == hf.keys()
        for n, t in hf.items():
            mine = got["tensors"][n]
            assert torch.equal(mine.view(torch.uint8), t.to(mine.dtype).contiguous().view(torch.uint8)), n
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
def test_an_openai_agent_trains_on_an_sglang_standin(tmp_path):
    """An OpenAI-API agent on an SGLang engine: the agent worker's gateway renders the chat
    template and generates through the stand-in's /generate (each body checked against SGLang's
    GenerateReqInput there); every sample comes from the records, R3 replays them, and the
    weight syncs reach both TP ranks."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples" / "openai_agent")]))
    with _standin(tmp_path, "configs/openai_agent.yaml", env) as (url, so, lines):
        out = tmp_path / "run"
        r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "configs/openai_agent.yaml", f"output_dir={out}",
                            "logging.progress=false", "engine.kind=sglang", f'engine.urls=["{url}"]', "pools.rollout=0",
                            "sync.pause_mode=abort", "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4",
                            "env.args={}", "env.openai_agent=tests.train.test_agent_train:call_a_tool"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:] + "".join(lines[-20:])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["samples"] == 2 * 4 and row["failed_samples"] == 0 and row.get("env_failures", 0) == 0
        assert row["train_tokens"] == row["samples"] and row["reward/calls"] == 1.0
        assert row.get("routing_match", 1.0) == 1.0
    loaded = [json.loads(x) for x in (so / "log.jsonl").read_text().splitlines() if '"loaded"' in x]
    assert [e["version"] for e in loaded] == ["1", "2"] and all(e["tp_ranks_equal"] for e in loaded)

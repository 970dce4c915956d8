"""The target run: ``moe-rl train`` against an SGLang stand-in (``standin_server``: SGLang's own
rendezvous and bucket code in two TP-rank processes, SGLang's request types checked on every
call) completes several weight syncs, and every tensor received equals the trainer's."""
from __future__ import annotations

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


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
def test_moe_rl_train_syncs_an_sglang_standin_with_two_tp_ranks(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    so = tmp_path / "standin"
    srv = subprocess.Popen([sys.executable, "-m", "tests.sglang.standin_server", "configs/tiny.yaml", str(so)], cwd=ROOT,
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
        out = tmp_path / "run"
        r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "configs/tiny.yaml", f"output_dir={out}",
                            "logging.progress=false", "engine.kind=sglang", f'engine.urls=["{url[0]}"]', "pools.rollout=0",
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
    finally:
        srv.terminate()
        try:
            srv.wait(20)
        except subprocess.TimeoutExpired:
            srv.kill()

"""The long-run check's short version (scripts/long_run.py; the long one's figures are in
docs/run_safety.md): configs/tiny.yaml with the collective timeout forced to 1 s (the world's
default group takes it once the ranks have started, so a wait for the end of the run on it would
die at 1 s) runs far longer, sampled on every rank; the routing log's retention keeps it at a
few steps' worth of records."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.replay import ReplayLog

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow(longest=True)  # long: scheduled first (tests/conftest.py); runs in CI
def test_a_short_long_run_outlives_its_timeouts_with_a_bounded_routing_log(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "long_run.py"), "--steps", "120", "--warmup", "40",
                        "--dist-timeout", "1", "--every", "0.25", "--out", str(out), "--json", str(tmp_path / "s.json"),
                        "dist.wait_timeout_s=120", "checkpoint.every=25"], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    s = json.loads((tmp_path / "s.json").read_text())["summary"]
    log = (tmp_path / "run.stderr").read_text()
    assert "collectives time out after 1 s (dist.timeout_s), long waits after 120 s (dist.wait_timeout_s)" in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 121))
    # the engine host waited for the end of the run from its start: more than twice as long as a
    # collective may wait (120 steps take ~7 s on a quiet 2-core machine, 0.06 s a step, and more on
    # a loaded one; a machine 3x faster still passes; sampled every 0.25 s so that the steps after
    # the warm-up hold enough samples)
    assert rows[-1]["wall_s"] > 2 * 1 and s["outlived_timeout_x"] > 3, (rows[-1]["wall_s"], s["outlived_timeout_x"])
    assert set(s["rss"]) == {"0", "1"}  # both ranks sampled
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    kept = len(ReplayLog(out / "routing", mode="r"))
    bound = (2 * cfg.rollout.max_staleness + 4) * per_step  # docs/run_safety.md, "Long runs"
    assert kept <= bound, (kept, bound)  # without retention: 120 steps x 32 records
    assert s["routing"]["max_bytes"] < 120 * per_step * 20  # well under what 120 steps append (>= 20 B a record)

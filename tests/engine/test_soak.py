"""`moe-rl serve` soaked with faults (tests/engine/soak.py): 64 clients for 15 s, read timeout
5 s. A longer run, by hand: ``python -m tests.engine.soak --seconds 300 --clients 128``
(docs/serving.md)."""
from __future__ import annotations

import json

import pytest

from .soak import CONTROL, KINDS, run_soak


@pytest.mark.slow  # ~35 s with the server's start on 2 loaded cores; run in CI all the same
def test_soak_with_faults():
    report, log = run_soak(seconds=15, clients=64, read_timeout_s=5.0)
    print(json.dumps(report.__dict__))
    assert not report.problems, "\n".join(report.problems) + "\n--- server log:\n" + "".join(log[-30:])
    assert not [s for s in report.statuses if int(s) >= 500]
    assert set(report.counts) == set(KINDS) and set(report.control) == set(CONTROL)  # every fault happened
    assert report.statuses.get(413) and report.statuses.get(400) and report.half_sent_closed_s
    assert report.greedy_same and report.rss_mb["growth"] <= 0.10
    assert report.loads_after["kv_slots_free"] == report.loads_after["kv_slots"]

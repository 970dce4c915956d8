"""Engine failures: the client keeps off a failed engine for a backoff; the rollout manager
resubmits the requests of an engine that died to a live one, losing no prompt and counting
none twice (two real engine processes, one killed mid-run)."""
import time

import pytest

from moe_rl.config import load_config
from moe_rl.engine.client import EngineClient, EngineError
from moe_rl.rollout.buffer import RolloutBuffer
from moe_rl.rollout.manager import RolloutManager
from moe_rl.tasks.base import Prompt
from tests.rollout.test_manager import CountingTask

from .helpers import CONFIG, ServerProc, wait_for


def test_client_skips_engines_marked_down_until_their_backoff_ends():
    c = EngineClient(["http://a", "http://b"])
    assert {c.pick() for _ in range(4)} == {"http://a", "http://b"}
    assert c.mark_down("http://a/") == 1.0
    assert {c.pick() for _ in range(4)} == {"http://b"} and c.live_urls() == ["http://b"]
    assert c.mark_down("http://a") == 2.0  # doubles with each failure in a row
    c.mark_down("http://b")
    assert c.live_urls() == [] and c.pick() == "http://b"  # all down: the one due back first
    c._down_until = {u: time.monotonic() - 1 for u in c._down_until}  # backoffs over
    assert {c.pick() for _ in range(4)} == {"http://a", "http://b"}
    c.set_stale(["http://a/"])  # a weight sync missed it: never picked, even when b is down
    c.mark_down("http://b")
    assert {c.pick() for _ in range(4)} == {"http://b"} and c.live_urls() == []
    c.set_stale(["http://a", "http://b"])
    with pytest.raises(EngineError, match="behind the trainer's weights"):
        c.pick()
    c.set_stale([])
    assert c.pick() in ("http://a", "http://b")


class LongTask(CountingTask):
    def prompt(self, index):  # rollout.max_new_tokens applies, and no stop token: 200 tokens each
        return Prompt(index, [1, 2, 3 + index % 5])


def test_rollouts_survive_an_engine_killed_mid_run():
    a, b = ServerProc(), ServerProc()
    try:
        # eta = 8 and no weight update: 18 groups of 2 samples go out, then the gate holds
        cfg = load_config(CONFIG, ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_staleness=8",
                                   "rollout.max_new_tokens=200", "replay.enabled=false"])
        client = EngineClient([a.url, b.url], connect_retries=1, retry_backoff_s=0.05)
        buffer = RolloutBuffer()
        m = RolloutManager(cfg, LongTask(), client, buffer)
        m.start()
        seen = []
        try:
            # 200 tokens take each batch 200+ engine steps: the requests on a are mid-generation
            assert wait_for(lambda: m.stats["requests_inflight"] >= 8, timeout=60)
            a.kill()  # its requests' connections drop
            for _ in range(9):
                seen += buffer.take(2, 0, timeout=120, alive=m.check)
        finally:
            m.stop()
    finally:
        a.stop()
        b.stop()
    ids = [g.group_id for g in seen]
    assert sorted(ids) == list(range(18)), ids  # every prompt drawn was delivered, once
    assert m.stats["engine_failures"] >= 1
    for g in seen:
        assert [s.uid for s in g.samples] == [f"p{g.group_id}-s0", f"p{g.group_id}-s1"]
        for s in g.samples:  # whole answers only: nothing of a dropped request mixed in
            assert len(s.response_ids) == len(s.behaviour_logprobs) == len(s.versions) == 200


def test_client_drops_idle_connections_before_sglang_closes_them():
    """A pooled connection is reused only while SGLang's server still keeps it (its uvicorn
    closes an idle one after SGLANG_TIMEOUT_KEEP_ALIVE): else a request goes out on a socket
    the server is closing and is lost."""
    import asyncio

    envs = pytest.importorskip("sglang.srt.environ").envs

    async def keepalive():
        c = EngineClient(["http://a"])
        try:
            return c._get_session().connector._keepalive_timeout
        finally:
            await c.close()

    assert 0 < asyncio.run(keepalive()) < envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()

"""Engine failures: the client keeps off a failed engine for a backoff; the rollout manager
resubmits the requests of an engine that died to a live one, losing no prompt and counting
none twice (two real engine processes, one killed mid-run); a frozen engine (SIGSTOPped) is
routed around after engine.request_timeout_s, and the run stops naming it when none is left."""
import asyncio
import os
import signal
import socket
import time

import pytest

from moe_rl.config import load_config
from moe_rl.engine.client import EngineClient, EngineError, EngineTimeoutError
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


def test_a_request_to_a_frozen_engine_times_out_and_marks_it_frozen():
    """A frozen server (the kernel still accepts its connections, nothing answers) costs a
    request engine.request_timeout_s, not forever: aiohttp reads timeout=None as no timeout."""
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(8)  # never accepted, never answered: SIGSTOPped, as the network sees it
        url = f"http://127.0.0.1:{frozen.getsockname()[1]}"
        client = EngineClient([url], timeout_s=0.5)

        async def go():
            try:
                t0 = time.monotonic()
                with pytest.raises(EngineTimeoutError, match=r"/generate: no answer within 0.5 s"):
                    await client.generate([1, 2, 3], {"max_new_tokens": 2})
                return time.monotonic() - t0
            finally:
                await client.close()

        took = asyncio.run(go())
    assert 0.5 <= took < 3.0 and client.frozen == {url} and client.serving_urls() == []


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
def test_rollouts_route_around_a_frozen_engine_and_stop_naming_the_last_one():
    """engine a is SIGSTOPped mid-generation: its requests time out (engine.request_timeout_s)
    and go to b, nothing lost or counted twice. Then b freezes too: with no engine left to
    serve, the manager fails at once, naming b, instead of waiting for one to come back."""
    a, b = ServerProc(), ServerProc()
    try:
        # short answers: a live engine answers well within the timeout even on a loaded machine
        cfg = load_config(CONFIG, ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_staleness=4",
                                   "rollout.max_new_tokens=40", "replay.enabled=false", "engine.request_timeout_s=5"])
        client = EngineClient.from_config(cfg.engine, [a.url, b.url], connect_retries=1, retry_backoff_s=0.05)
        buffer = RolloutBuffer()
        m = RolloutManager(cfg, LongTask(), client, buffer)
        m.start()
        seen = []
        try:
            assert wait_for(lambda: m.stats["requests_inflight"] >= 4, timeout=60)
            os.kill(a.proc.pid, signal.SIGSTOP)
            for _ in range(5):  # (0 + eta + 1) * B = 10 groups
                seen += buffer.take(2, 0, timeout=120, alive=m.check)
            assert a.url in client.frozen and m.stats["engine_failures"] >= 1
            os.kill(b.proc.pid, signal.SIGSTOP)
            m.begin_update()
            m.end_update(1)  # the gate opens for two more groups: they can only go to frozen engines
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=rf"engine {b.url} gave no answer within 5 s "
                                                   r"\(engine.request_timeout_s\): it is frozen .* no other engine serves"):
                buffer.take(2, 0, timeout=120, alive=m.check)
            assert time.monotonic() - t0 < 5 + 10
        finally:
            m.stop()
    finally:
        for s in (a, b):
            os.kill(s.proc.pid, signal.SIGCONT)
            s.stop()
    ids = [g.group_id for g in seen]
    assert sorted(ids) == list(range(10)), ids  # every prompt drawn was delivered, once
    for g in seen:
        for s in g.samples:  # whole answers only
            assert len(s.response_ids) == len(s.behaviour_logprobs) == len(s.versions) == 40


def test_client_drops_idle_connections_before_sglang_closes_them():
    """A pooled connection is reused only while SGLang's server still keeps it (its uvicorn
    closes an idle one after SGLANG_TIMEOUT_KEEP_ALIVE): else a request goes out on a socket
    the server is closing and is lost."""
    envs = pytest.importorskip("sglang.srt.environ").envs

    async def keepalive():
        c = EngineClient(["http://a"])
        try:
            return c._get_session().connector._keepalive_timeout
        finally:
            await c.close()

    assert 0 < asyncio.run(keepalive()) < envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()

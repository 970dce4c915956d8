"""Rollout manager and buffer: the staleness bound, partial rollouts, failing rewards."""
import asyncio
import time

import pytest

from moe_rl.config import load_config
from moe_rl.engine.client import EngineError, EngineHTTPError
from moe_rl.rollout.buffer import RolloutBuffer
from moe_rl.rollout.manager import RolloutManager
from moe_rl.rollout.sample import Group, Sample
from moe_rl.tasks.base import Prompt


class CountingTask:
    name, vocab_size_needed, stop_token_ids, num_prompts = "counting", 16, [], None

    def __init__(self, fail_every: int = 0):
        self.fail_every = fail_every

    def prompt(self, index):
        return Prompt(index, [1, 2, 3 + index % 5], max_new_tokens=4 + index % 3)

    def reward(self, prompt, response_ids):
        if self.fail_every and prompt.index % self.fail_every == 0:
            raise ZeroDivisionError("bad reward")
        return float(len(response_ids))


class StubEngines:
    """Answers /generate after a random short delay with the engines' current version; a pause
    (abort) ends every in-flight request early with the tokens made so far."""

    def __init__(self):
        self.version = 0
        self.aborting = False
        self.calls = 0

    async def generate(self, input_ids, sampling_params, return_logprob=True, return_routed_experts=False, rid=None,
                       routed_experts_start_len=0):
        self.calls += 1
        n = sampling_params["max_new_tokens"]
        out, versions = [], []
        for _ in range(n):
            await asyncio.sleep(0.002)
            if self.aborting:
                break
            out.append(5)
            versions.append(str(self.version))
        reason = {"type": "abort"} if len(out) < n else {"type": "length"}
        return {"output_ids": out, "meta_info": {"finish_reason": reason, "weight_version": str(self.version),
                                                 "output_token_weight_versions": versions,
                                                 "output_token_logprobs": [[-1.0, 5, None]] * len(out)}}

    async def generate_batch(self, input_ids, sampling_params, return_logprob=True, return_routed_experts=False,
                             rids=None):
        return await asyncio.gather(*(self.generate(p, sp) for p, sp in zip(input_ids, sampling_params)))

    async def close(self):
        pass

    def mark_down(self, url):
        self.marked = getattr(self, "marked", []) + [url]
        return 0.01

    def live_urls(self):
        return ["stub"]


class FlakyEngines(StubEngines):
    """Every ``fail_every``-th call fails as an engine would when it dies: the connection drops
    (nothing answered), or with ``status`` an HTTP error answer."""

    def __init__(self, fail_every: int, status: int | None = None):
        super().__init__()
        self.fail_every, self.status, self.rids, self.n = fail_every, status, [], 0

    def _maybe_fail(self):
        self.n += 1
        if self.n % self.fail_every == 0:
            if self.status is not None:
                raise EngineHTTPError("http://engine-a", "/generate", self.status, {"error": {"message": "bad"}})
            raise EngineError("http://engine-a", "/generate", "connection lost mid-request (engine died?)")

    async def generate(self, input_ids, sampling_params, return_logprob=True, return_routed_experts=False, rid=None,
                       routed_experts_start_len=0):
        self._maybe_fail()
        self.rids.append(rid)
        return await super().generate(input_ids, sampling_params)

    async def generate_batch(self, input_ids, sampling_params, return_logprob=True, return_routed_experts=False,
                             rids=None):
        self._maybe_fail()
        self.rids += list(rids)
        return await asyncio.gather(*(StubEngines.generate(self, p, sp) for p, sp in zip(input_ids, sampling_params)))


def update_weights(m, engines, version, pause_s=0.01):
    """What the trainer does around a weight sync: pause (in-flight requests end early), new
    version, continue."""
    m.begin_update()
    engines.aborting = True
    time.sleep(pause_s)
    engines.version = version
    engines.aborting = False
    m.end_update(version)


def make(eta, task=None, B=3, n=2, engines=None, overrides=()):
    cfg = load_config("configs/tiny.yaml", [f"rollout.max_staleness={eta}", f"rollout.prompts_per_step={B}",
                                             f"rollout.group_size={n}", *overrides])
    engines, buffer = engines or StubEngines(), RolloutBuffer()
    m = RolloutManager(cfg, task or CountingTask(), engines, buffer)
    return cfg, engines, buffer, m


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_staleness_bound_holds_and_nothing_is_lost(eta):
    cfg, engines, buffer, m = make(eta)
    m.start()
    seen = []
    try:
        for v in range(6):  # the "trainer": take a batch at version v, then update
            groups = buffer.take(3, v - eta, timeout=30, alive=m.check)
            for g in groups:
                assert g.min_version >= v - eta
                assert all(len(s.versions) == len(s.response_ids) for s in g.samples)
            seen += [g.group_id for g in groups]
            update_weights(m, engines, v + 1)
    finally:
        m.stop()
    assert len(seen) == len(set(seen)), "a group was trained on twice"
    assert buffer.dropped_stale == 0, "the gate should keep the bound without discarding work"
    # the gate: never more than (v + eta + 1) * B groups submitted
    assert m.submitted <= (6 + eta + 1) * 3


def test_partial_rollouts_keep_each_tokens_version():
    cfg, engines, buffer, m = make(eta=1, B=2, n=2)
    m.start()
    try:
        buffer.take(2, 0, timeout=30, alive=m.check)
        update_weights(m, engines, 1, pause_s=0.02)
        groups = buffer.take(2, 0, timeout=30, alive=m.check)
    finally:
        m.stop()
    resumed = [s for g in groups for s in g.samples if s.resumes]
    for s in resumed:
        assert s.versions == sorted(s.versions) and len(s.versions) == len(s.response_ids)
        assert len(s.response_ids) == CountingTask().prompt(s.group_id).max_new_tokens
    assert m.stats["resumed_requests"] == sum(s.resumes for g in groups for s in g.samples)


def test_raising_reward_marks_sample_failed_and_run_goes_on():
    cfg, engines, buffer, m = make(eta=2, task=CountingTask(fail_every=2))
    m.start()
    try:
        groups = buffer.take(3, 0, timeout=30, alive=m.check)
    finally:
        m.stop()
    for g in groups:
        if g.group_id % 2 == 0:
            assert all(s.failed and "ZeroDivisionError" in s.failed for s in g.samples)
            assert g.trainable == []
        else:
            assert all(s.failed is None and s.reward == len(s.response_ids) for s in g.samples)
    assert m.stats["reward_failures"] >= 2


def test_buffer_drops_and_counts_stale_groups():
    b = RolloutBuffer()
    for gid, v in [(0, 0), (1, 3), (2, 1), (3, 4)]:
        b.put(Group(gid, [Sample(f"u{gid}", gid, [1], [2], [0.0], [v])]))
    got = b.take(2, min_version=3, timeout=1)
    assert [g.group_id for g in got] == [1, 3]
    assert b.dropped_ids == [0, 2] and b.dropped_stale == 2
    with pytest.raises(TimeoutError):
        b.take(1, 0, timeout=0.1)


def test_failed_engine_calls_are_resubmitted_none_lost_none_twice():
    engines = FlakyEngines(fail_every=3)
    cfg, engines, buffer, m = make(eta=1, B=3, n=2, engines=engines)
    m.start()
    seen = []
    try:
        for v in range(4):
            groups = buffer.take(3, v - 1, timeout=30, alive=m.check)
            seen += groups
            update_weights(m, engines, v + 1)  # partial rollouts: their resume calls fail too
    finally:
        m.stop()
    ids = [g.group_id for g in seen]
    assert sorted(ids) == list(range(len(ids))), "every prompt delivered once, in draw order"
    assert m.stats["engine_failures"] >= 3 and engines.marked[0] == "http://engine-a"
    for g in seen:
        assert [s.uid for s in g.samples] == [f"p{g.group_id}-s{j}" for j in range(2)]
        for s in g.samples:
            assert len(s.response_ids) == CountingTask().prompt(g.group_id).max_new_tokens
            assert len(s.versions) == len(s.behaviour_logprobs) == len(s.response_ids)
    # a resubmission never reuses a rid the failed engine may still hold
    assert len(engines.rids) == len(set(engines.rids))
    assert any(r.endswith("-e1") for r in engines.rids)


@pytest.mark.parametrize("status,overrides,failures", [
    (400, [], 0),  # the request's fault: raised at once, never resubmitted
    (None, ["rollout.engine_retry_s=0.2"], None),  # engines down past the deadline: the last error
])
def test_engine_errors_that_stop_the_run(status, overrides, failures):
    engines = FlakyEngines(fail_every=1, status=status)
    cfg, engines, buffer, m = make(eta=0, engines=engines, overrides=overrides)
    m.start()
    try:
        with pytest.raises(RuntimeError):
            buffer.take(3, 0, timeout=30, alive=m.check)
    finally:
        m.stop()
    assert isinstance(m.error, EngineHTTPError if status else EngineError) and "engine-a" in str(m.error)
    if failures is not None:
        assert m.stats["engine_failures"] == failures
    else:
        assert m.stats["engine_failures"] >= 1


class SGLangLikeEngines(StubEngines):
    """What a real SGLang server does that the stub does not: its weight_version is "default"
    until the first update, it returns routed_experts, and a request aborted while queued comes
    back with no routed_experts (here with a few tokens, which cannot be replayed).
    ``abort_kind`` "empty": aborted before its first forward, no tokens and an empty routing
    record (the embedded engine in abort mode); "short": tokens whose routing lacks rows."""

    L, K = 2, 2

    def __init__(self, abort_kind: str = "none"):
        super().__init__()
        self.aborted_without_routing = 0
        self.abort_kind = abort_kind

    async def generate(self, input_ids, sampling_params, return_logprob=True, return_routed_experts=False, rid=None,
                       routed_experts_start_len=0):
        import base64

        import numpy as np
        self.calls += 1
        n = sampling_params["max_new_tokens"]
        out = [5] * n
        version = "default" if self.version == 0 else str(self.version)
        meta = {"weight_version": version, "output_token_logprobs": [[-1.0, 5, None]] * n,
                "prompt_tokens": len(input_ids), "completion_tokens": n}
        def routing(rows):
            return base64.b64encode(np.tile(np.arange(self.K, dtype=np.int32), (rows, self.L, 1)).tobytes()).decode()

        if self.calls % 3 == 1:  # aborted in the queue: no routing
            self.aborted_without_routing += 1
            new = 0 if self.abort_kind == "empty" else 2
            meta.update(finish_reason={"type": "abort"}, output_token_logprobs=[[-1.0, 5, None]] * new,
                        completion_tokens=new)
            if self.abort_kind == "empty":
                meta["routed_experts"] = routing(0)
            elif self.abort_kind == "short":
                meta["routed_experts"] = routing(len(input_ids) + new - 2 - routed_experts_start_len)
            return {"output_ids": [5] * new, "meta_info": meta}
        rows = len(input_ids) + n - 1 - routed_experts_start_len
        meta.update(finish_reason={"type": "length"}, routed_experts=routing(rows))
        return {"output_ids": out, "meta_info": meta}


@pytest.mark.parametrize("abort_kind", ["none", "empty", "short"])
def test_sglang_aborts_without_routing_and_default_version(tmp_path, abort_kind):
    from moe_rl.replay.layers import RoutingSpec
    from moe_rl.replay.log import ReplayLog

    cfg = load_config("configs/tiny.yaml", ["rollout.max_staleness=1", "rollout.prompts_per_step=2", "rollout.group_size=2"])
    engines, buffer = SGLangLikeEngines(abort_kind), RolloutBuffer()
    spec = RoutingSpec(num_hidden_layers=2, top_k=2, num_experts=8)
    log = ReplayLog(tmp_path / "routing", num_layers=2, top_k=2, num_experts=8)
    m = RolloutManager(cfg, CountingTask(), engines, buffer, replay_log=log, routing_spec=spec)
    m.start()
    try:
        groups = buffer.take(2, 0, timeout=30, alive=m.check)
    finally:
        m.stop()
    samples = [s for g in groups for s in g.samples]
    assert engines.aborted_without_routing > 0
    assert (m.stats["aborted_without_routing"] > 0) == (abort_kind != "empty")  # counted when tokens are dropped
    for s in samples:  # the unreplayable tokens were dropped and regenerated: full length, version 0
        assert len(s.response_ids) == CountingTask().prompt(s.group_id).max_new_tokens
        assert s.versions == [0] * len(s.response_ids) and s.has_routing

"""Agent rollouts (moe_rl/rollout/agent.py): episodes played by OpenAI-API agents through the
engine's recorded endpoints. The trained tokens are exactly the engine's sampled tokens
(merged and split calls), checked against what the agent received and against a fresh
forward of the native model; failures mark samples failed; a weight update inside a call
continues it."""
from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import defaultdict

import numpy as np
import pytest
import requests

pytest.importorskip("openai")
pytest.importorskip("transformers")

from moe_rl.config import load_config  # noqa: E402
from moe_rl.engine import EngineClient, encode_routed_experts  # noqa: E402
from moe_rl.replay import RoutingSpec, record_from_responses  # noqa: E402
from moe_rl.rollout.agent import trajectories  # noqa: E402
from moe_rl.rollout.buffer import RolloutBuffer  # noqa: E402
from moe_rl.rollout.manager import RolloutManager  # noqa: E402
from moe_rl.tasks import task_from_config  # noqa: E402
from tests.engine.helpers import recompute  # noqa: E402
from tests.engine.openai_server import CONFIG, OVERRIDES  # noqa: E402

SEEN: dict[str, list] = defaultdict(list)  # episode base_url -> the choices the agent received
TOOLS = [{"type": "function", "function": {"name": "compare", "parameters": {"type": "object", "properties": {}}}}]


async def _ask(client, messages, **kw):
    r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=3,
                                             logprobs=True, extra_body={"return_token_ids": True}, **kw)
    c = r.choices[0]
    SEEN[str(client.base_url)].append(c)
    return c.message.model_dump(exclude_none=True)


async def agent_chain(client, prompt):
    """Three calls, each repeating the history: one sequence."""
    messages = list(prompt.meta["messages"])
    for turn in range(3):
        messages.append(await _ask(client, messages))
        messages.append({"role": "tool", "content": "higher"} if turn % 2 == 0 else {"role": "user", "content": "guess"})
    return 0.5


async def agent_chain_where(client, prompt):
    """agent_chain, saying which process played it."""
    await agent_chain(client, prompt)
    return {"reward": 0.5, "pid": float(os.getpid())}


async def agent_split(client, prompt):
    """Two chained calls, then a fresh conversation: two sequences."""
    messages = list(prompt.meta["messages"])
    messages.append(await _ask(client, messages))
    messages.append({"role": "tool", "content": "lower"})
    await _ask(client, messages)
    await _ask(client, [{"role": "user", "content": "guess 1 to 2"}])
    return {"reward": 1.0, "calls": 3}


async def agent_raises(client, prompt):
    await _ask(client, list(prompt.meta["messages"]))
    raise RuntimeError("the agent's own bug")


async def agent_hangs(client, prompt):
    await asyncio.sleep(60)


async def agent_silent(client, prompt):
    return 1.0


class RecordingLog:
    def __init__(self):
        self.records, self.versions = {}, {}

    def append(self, uid, rec, versions):
        assert uid not in self.records
        self.records[uid], self.versions[uid] = np.asarray(rec), versions


def _run_group(server, agent: str, overrides=()):
    import importlib

    importlib.import_module("tests.rollout.test_agent").SEEN.clear()
    cfg = load_config(CONFIG, [*OVERRIDES, f"env.openai_agent=tests.rollout.test_agent:{agent}", "env.args={}",
                               "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_staleness=0",
                               "rollout.max_new_tokens=3", "env.agent_workers=0", *overrides])
    arch = server.engine.arch
    spec = RoutingSpec(arch.num_hidden_layers, arch.num_experts_per_tok, arch.num_experts)
    buffer, log = RolloutBuffer(), RecordingLog()
    m = RolloutManager(cfg, task_from_config(cfg), EngineClient([server.url]), buffer, log, spec)
    m.start()
    try:
        group = buffer.take(1, 0, timeout=120, alive=m.check)[0]
    finally:
        m.stop()
    return group, log, m


def _seen(uid):
    import importlib  # the agents ran from the module as env.openai_agent imported it

    seen = importlib.import_module("tests.rollout.test_agent").SEEN
    return next(v for k, v in seen.items() if f"/episodes/{uid}-" in k)


def _check_against_engine_and_model(server, s, calls, log):
    """The sample's model tokens and log-probs are the concatenated choices the agent got; its
    sequence re-forwarded by the native model gives the same log-probs and routing rows."""
    seq = s.prompt_ids + s.response_ids
    assert s.prompt_ids == calls[0].prompt_token_ids
    model = [t for t, m in zip(s.response_ids, s.loss_mask) if m]
    assert model == [t for c in calls for t in c.response_token_ids]
    lps = [lp for lp, m in zip(s.behaviour_logprobs, s.loss_mask) if m]
    assert lps == [t.logprob for c in calls for t in c.logprobs.content]
    pos = len(calls[0].prompt_token_ids)
    for prev, c in zip(calls, calls[1:]):  # between the calls: the next prompt's new tokens, mask 0
        end = len(prev.prompt_token_ids) + len(prev.response_token_ids)
        assert c.prompt_token_ids[:end] == prev.prompt_token_ids + prev.response_token_ids, "not token for token"
        assert seq[:len(c.prompt_token_ids)] == c.prompt_token_ids
    mask = [0] * pos + [1] * len(calls[0].response_token_ids)
    for prev, c in zip(calls, calls[1:]):
        mask += [0] * (len(c.prompt_token_ids) - len(mask)) + [1] * len(c.response_token_ids)
    assert [0] * len(s.prompt_ids) + s.loss_mask == mask
    ref_lp, ref_rows = recompute(server.engine.model, s.prompt_ids, s.response_ids, 1.0)
    np.testing.assert_allclose([lp for lp, m in zip(ref_lp, s.loss_mask) if m], lps, atol=1e-5, rtol=0)
    rec = log.records[s.uid]
    np.testing.assert_array_equal(rec, ref_rows[:, list(server.engine.moe_layers)])


def test_chained_calls_merge_into_one_sequence(server):
    group, log, _ = _run_group(server, "agent_chain")
    assert len(group.samples) == 2
    for s in group.samples:
        assert s.failed is None and s.reward == 0.5 and s.turns == 3 and s.has_routing
        calls = _seen(s.uid)
        assert len(calls) == 3
        _check_against_engine_and_model(server, s, calls, log)
        assert set(s.model_versions) == {0} and log.versions[s.uid] == [0]


def test_agent_worker_processes_play_the_episodes(server):
    """env.agent_workers=1: the episodes are played in a process of their own, and what comes
    back is the engine's record: the native model's log-probs and routing for each sequence."""
    group, log, _ = _run_group(server, "agent_chain_where", ["env.agent_workers=1"])
    assert len(group.samples) == 2
    for s in group.samples:
        assert s.failed is None and s.reward == 0.5 and s.turns == 3 and s.has_routing
        assert s.metrics["pid"] != os.getpid()
        ref_lp, ref_rows = recompute(server.engine.model, s.prompt_ids, s.response_ids, 1.0)
        lps = [lp for lp, m in zip(s.behaviour_logprobs, s.loss_mask) if m]
        np.testing.assert_allclose([lp for lp, m in zip(ref_lp, s.loss_mask) if m], lps, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(log.records[s.uid], ref_rows[:, list(server.engine.moe_layers)])


def test_a_fresh_conversation_is_another_sample(server):
    group, log, _ = _run_group(server, "agent_split")
    assert len(group.samples) == 4 and all(s.failed is None for s in group.samples)
    for j in range(2):
        first, second = [s for s in group.samples if s.uid.startswith(f"p0-s{j}")]
        assert (first.uid, second.uid) == (f"p0-s{j}", f"p0-s{j}-q1")
        calls = _seen(first.uid)
        assert first.turns == 2 and second.turns == 1
        assert first.reward == second.reward == 1.0 and first.metrics == {"calls": 3.0}
        _check_against_engine_and_model(server, first, calls[:2], log)
        _check_against_engine_and_model(server, second, calls[2:], log)


@pytest.mark.parametrize("agent,why", [("agent_raises", "RuntimeError: the agent's own bug"),
                                       ("agent_hangs", "timed out after env.episode_timeout_s=2"),
                                       ("agent_silent", "made no call")])
def test_failed_episodes(server, agent, why):
    group, log, m = _run_group(server, agent, ["env.episode_timeout_s=2"])
    assert len(group.samples) == 2
    for s in group.samples:
        assert s.failed is not None and why in s.failed, s.failed
        assert s.uid not in log.records
    assert m.stats["env_failures"] == 2
    assert not server.engine.info()["running_requests"]
    assert not server.engine.by_rid


def test_trajectories_branch_takes_the_parents_routing_rows():
    """A call continuing a call that another call already continued (a branch) starts a new
    sequence whose routing rows before it come from the parent's record."""
    spec = RoutingSpec(1, 1, 4)

    def rows(lo, hi):  # row p holds p % 4, so the joined record says where each row came from
        return {"routed_experts": encode_routed_experts(np.arange(lo, hi, dtype=np.int32).reshape(-1, 1, 1) % 4)}

    def rec(prompt, out, parent, start):
        return {"prompt_ids": prompt, "output_ids": out, "output_logprobs": [-1.0] * len(out),
                "output_versions": ["0"] * len(out), "parent": parent,
                "routing": [{"start": start, "meta_info": {**rows(start, len(prompt) + len(out) - 1)}}]}

    a = rec([1, 2], [3], None, 0)
    b = rec([1, 2, 3, 9], [4], 0, 2)  # extends a
    c = rec([1, 2, 3, 8], [5], 0, 2)  # extends a too: a branch
    seqs = trajectories([a, b, c])
    assert [s.tokens for s in seqs] == [[1, 2, 3, 9, 4], [1, 2, 3, 8, 5]]
    assert seqs[0].mask == [1, 0, 1] and seqs[1].prompt_ids == [1, 2, 3, 8] and seqs[1].mask == [1]
    for s in seqs:
        got = record_from_responses(s.metas, spec, num_tokens=len(s.tokens), starts=s.starts)
        assert got[:, 0, 0].tolist() == [p % 4 for p in range(len(s.tokens) - 1)]


def test_a_weight_update_inside_a_call_continues_it(server):
    """Pause (abort mode) while an episode's call is generating: the call goes on after the
    update with the partial output as its prefix; the agent gets one answer, the record one
    call whose tokens carry the version that produced them, and routing covering it once."""
    update_inside_a_call(server, server.url)


def update_inside_a_call(server, url: str) -> None:
    """Pauses ``server``'s engine (abort mode) while a call of an episode registered at ``url``
    (the engine's own endpoints, or a gateway before it) generates, then checks the answer and
    the record against the model."""
    eid = f"wu-{time.monotonic()}"
    requests.post(url + "/episodes", json={"id": eid, "sampling_params": {"temperature": 1.0},
                                           "return_routed_experts": True}, timeout=10).raise_for_status()
    prompt = list(range(5, 15))
    box = {}

    def call():
        box["r"] = requests.post(f"{url}/episodes/{eid}/v1/completions", json={
            "prompt": prompt, "max_tokens": 60, "ignore_eos": True, "return_token_ids": True}, timeout=120).json()

    engine = server.engine
    t = threading.Thread(target=call)
    start = engine.stats["output_tokens"]
    t.start()
    deadline = time.monotonic() + 60
    while engine.stats["output_tokens"] < start + 5:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    engine.pause("abort")
    old = engine.weight_version
    engine.weight_version = "7"  # an update that changed nothing but the version
    engine.resume()
    t.join(60)
    records = requests.delete(f"{url}/episodes/{eid}", timeout=10).json()["records"]
    engine.weight_version = old
    assert len(records) == 1
    r = records[0]
    assert box["r"]["choices"][0]["token_ids"] == r["output_ids"] and len(r["output_ids"]) == 60
    versions = r["output_versions"]
    assert versions[0] == old and versions[-1] == "7" and versions == sorted(versions, key=lambda v: v == "7")
    assert len(r["routing"]) == 2 and r["routing"][1]["start"] == len(prompt) + versions.index("7") - 1
    arch = engine.arch
    spec = RoutingSpec(arch.num_hidden_layers, arch.num_experts_per_tok, arch.num_experts)
    got = record_from_responses([g["meta_info"] for g in r["routing"]], spec, num_tokens=len(prompt) + 60,
                                starts=[g["start"] for g in r["routing"]])
    ref_lp, ref_rows = recompute(engine.model, prompt, r["output_ids"], 1.0)
    np.testing.assert_array_equal(got, ref_rows[:, list(engine.moe_layers)])
    np.testing.assert_allclose(r["output_logprobs"], ref_lp, atol=1e-5, rtol=0)

"""Agents on SGLang engines (``engine.kind: sglang``): each agent player puts an OpenAI gateway
(moe_rl/engine/gateway.py) before the engine and the engine generates from token ids. The
engine here is the embedded one behind ``moe-rl serve``'s application, which speaks SGLang's
``/generate``; the reference for each check is the embedded engine's own OpenAI endpoints and a
fresh forward of the model. The requests the gateway sends are checked against SGLang's own
field lists in tests/sglang/test_requests_sglang.py."""
from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest
import requests

pytest.importorskip("openai")
pytest.importorskip("transformers")

from moe_rl.config import ConfigError, load_config  # noqa: E402
from moe_rl.engine import EngineClient  # noqa: E402
from moe_rl.engine.gateway import Gateway, GatewaySpec  # noqa: E402
from moe_rl.replay import RoutingSpec  # noqa: E402
from tests.engine.helpers import recompute  # noqa: E402
from tests.engine.openai_server import CONFIG, OVERRIDES, serve  # noqa: E402
from tests.rollout import test_agent as A  # noqa: E402


@pytest.fixture(scope="module")
def gateway(server):
    """A gateway before ``server``, in the server's event loop (as a player's is in its own)."""
    cfg = load_config(CONFIG, [*OVERRIDES, "engine.kind=sglang", f"engine.urls=[{server.url}]"])
    client = EngineClient(server.url)
    gw = Gateway(server.url, GatewaySpec.from_config(cfg), client)
    url = server.call(gw.start())
    yield url
    server.call(gw.close())
    server.call(client.close())


def _sglang(server) -> list[str]:
    return ["engine.kind=sglang", f"engine.urls=[{server.url}]"]


@pytest.mark.parametrize("agent,workers,kind", [("agent_chain", 0, "sglang"), ("agent_split", 1, "sglang"),
                                                ("agent_chain", 0, "embedded")])
def test_agent_episodes_through_the_gateway_are_the_engines_tokens(server, agent, workers, kind):
    """Merged calls (one sequence) and a fresh conversation (another sample), played in the
    trainer's loop and in a worker process, before SGLang and (env.agent_gateway=true) before
    the embedded engine: every trained token, log-prob and routing row is what the engine
    sampled, and the calls went to the gateway, not to the engine."""
    where = _sglang(server) if kind == "sglang" else ["env.agent_gateway=true"]
    group, log, _ = A._run_group(server, agent, [*where, f"env.agent_workers={workers}"])
    assert all(s.failed is None for s in group.samples)
    if agent == "agent_chain":
        assert len(group.samples) == 2
        for s in group.samples:
            calls = A._seen(s.uid)
            assert s.turns == 3 and len(calls) == 3
            A._check_against_engine_and_model(server, s, calls, log)
        assert A.SEEN and not any(k.startswith(server.url) for k in A.SEEN)
    else:  # the agent ran in another process: its SEEN is not here; the model is the reference
        assert len(group.samples) == 4
        for s in group.samples:
            ref_lp, ref_rows = recompute(server.engine.model, s.prompt_ids, s.response_ids, 1.0)
            lps = [lp for lp, m in zip(s.behaviour_logprobs, s.loss_mask) if m]
            np.testing.assert_allclose([lp for lp, m in zip(ref_lp, s.loss_mask) if m], lps, atol=1e-5, rtol=0)
            np.testing.assert_array_equal(log.records[s.uid], ref_rows[:, list(server.engine.moe_layers)])
        assert sorted(s.turns for s in group.samples) == [1, 1, 2, 2]


def _episode(url: str, eid: str, seed: int) -> None:
    requests.post(url + "/episodes", json={"id": eid, "seed": seed, "sampling_params": {"temperature": 1.0},
                                           "return_routed_experts": True}, timeout=10).raise_for_status()


def _chat(url: str, eid: str, stream: bool) -> dict:
    body = {"model": "policy", "messages": [{"role": "user", "content": "guess 1 to 3"}], "tools": A.TOOLS,
            "max_tokens": 4, "logprobs": True, "stream": stream, "return_token_ids": True}
    r = requests.post(f"{url}/episodes/{eid}/v1/chat/completions", json=body, timeout=60, stream=stream)
    r.raise_for_status()
    if not stream:
        return r.json()["choices"][0]
    lps = []  # a streamed chat choice carries no ids: its tokens' log-probs, one per token
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            for c in json.loads(line[6:])["choices"]:
                lps += [t["logprob"] for t in (c.get("logprobs") or {}).get("content") or []]
    return {"logprobs": lps}


def test_the_gateway_answers_and_records_as_the_engine_does(server, gateway):
    """The same episode seed on the engine's own endpoints and on the gateway (plain and
    streamed): the same tokens and log-probs to the agent, and the same record."""
    seed = 1234
    records = {}
    for name, url, stream in [("engine", server.url, False), ("gateway", gateway, False),
                              ("gateway_stream", gateway, True)]:
        eid = f"same-{name}-{time.monotonic()}"
        _episode(url, eid, seed)
        choice = _chat(url, eid, stream)
        records[name] = requests.delete(f"{url}/episodes/{eid}", timeout=10).json()["records"]
        rec = records[name][0]
        assert len(rec["output_ids"]) > 0
        if not stream:
            assert choice["response_token_ids"] == rec["output_ids"]
        lps = [t["logprob"] for t in choice["logprobs"]["content"]] if not stream else choice["logprobs"]
        assert lps == rec["output_logprobs"]
    want = records["engine"][0]
    for name in ("gateway", "gateway_stream"):
        got = records[name][0]
        for key in ("prompt_ids", "output_ids", "output_logprobs", "output_versions", "finish_reason"):
            assert got[key] == want[key], (name, key)
        assert [g["meta_info"]["routed_experts"] for g in got["routing"]] == \
            [g["meta_info"]["routed_experts"] for g in want["routing"]]


def test_a_weight_update_inside_a_call_through_the_gateway_continues_it(server, gateway):
    """The engine pauses (abort mode) while a gateway call generates: the gateway resubmits it
    with its partial output; the agent gets one answer of all its tokens, the record one call
    whose tokens carry the versions that made them, and its routing covers it once."""
    A.update_inside_a_call(server, gateway)


@pytest.mark.parametrize("stream", [True, False])
def test_an_agent_that_goes_away_frees_the_engines_request(server, gateway, stream):
    """A call (streamed, or answered whole) whose client disconnects while it generates: the
    engine's request ends there, before the 200 tokens it was asked for."""
    engine = server.engine
    eid = f"gw-gone-{time.monotonic()}"
    _episode(gateway, eid, 3)
    start = engine.stats["output_tokens"]
    body = json.dumps({"prompt": list(range(5, 15)), "max_tokens": 200, "ignore_eos": True, "stream": stream})
    host, port = gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:  # a raw socket: closed at will
        sock.sendall(f"POST /episodes/{eid}/v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 60
        while engine.stats["output_tokens"] < start + 5:  # it is generating
            assert time.monotonic() < deadline
            time.sleep(0.001)
    deadline = time.monotonic() + 30
    while engine.info()["running_requests"] or engine.by_rid:
        assert time.monotonic() < deadline, "the engine's request was left running"
        time.sleep(0.01)
    assert engine.stats["output_tokens"] - start < 200


def test_an_engine_refusal_is_an_openai_error(server, gateway):
    """What the engine refuses (here: a prompt past its context, which the gateway's own check
    lets through with a larger engine.max_context) comes back in OpenAI's error shape."""
    cfg = load_config(CONFIG, [*OVERRIDES, *_sglang(server), "engine.max_context=100000"])

    async def ask():
        client = EngineClient(server.url)
        gw = Gateway(server.url, GatewaySpec.from_config(cfg), client)
        url = await gw.start()
        try:
            async with client._get_session().post(url + "/v1/completions", json={
                    "prompt": list(range(5, 15)) * 40, "max_tokens": 2}) as resp:
                return resp.status, await resp.json()
        finally:
            await gw.close()
            await client.close()

    status, body = server.call(ask())
    assert status == 400 and "context length" in body["error"]["message"], body


def test_a_server_that_streams_increments_is_refused_by_name(server):
    """SGLang with --incremental-streaming-output sends each event's new tokens only; the
    gateway reads events as whole outputs, so a streamed call there is an error naming the flag
    (never a silently cut answer)."""
    from aiohttp import web

    async def generate(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, tok in enumerate([5, 6]):  # increments: one new token an event
            meta = {"completion_tokens": i + 1, "prompt_tokens": 3, "weight_version": "0",
                    "output_token_logprobs": [[-1.0, tok, None]], "finish_reason": None}
            await resp.write(b"data: " + json.dumps({"output_ids": [tok], "meta_info": meta}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    cfg = load_config(CONFIG, [*OVERRIDES, *_sglang(server)])

    async def ask():
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner, fake = await serve(app)
        client = EngineClient(fake)
        gw = Gateway(fake, GatewaySpec.from_config(cfg), client)
        url = await gw.start()
        try:
            async with client._get_session().post(url + "/v1/completions", json={
                    "prompt": [3, 4, 5], "max_tokens": 2, "stream": True}) as resp:
                return resp.status, await resp.text()
        finally:
            await gw.close()
            await client.close()
            await runner.cleanup()

    status, text = server.call(ask())
    assert "--incremental-streaming-output" in text, (status, text)


@pytest.mark.parametrize("kind", ["sglang", "embedded"])
def test_an_unreachable_engine_fails_its_episodes_and_is_kept_off(kind):
    """An engine nobody answers at: on SGLang the gateway's calls fail (the agent gets a 503),
    on the embedded engine the episode cannot even register. Either way each sample fails
    naming the engine, and the runner keeps new groups off it (mark_down), as the token-level
    path does with a failed engine."""
    from moe_rl.rollout.buffer import RolloutBuffer
    from moe_rl.rollout.manager import RolloutManager
    from moe_rl.tasks import task_from_config

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    cfg = load_config(CONFIG, [*OVERRIDES, "env.openai_agent=tests.rollout.test_agent:agent_chain", "env.args={}",
                               "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_staleness=0",
                               "rollout.max_new_tokens=3", "env.agent_workers=0", f"engine.kind={kind}",
                               f"engine.urls=[{dead}]"])
    arch = cfg.model.arch()
    spec = RoutingSpec(arch.num_hidden_layers, arch.num_experts_per_tok, arch.num_experts)
    buffer = RolloutBuffer()
    m = RolloutManager(cfg, task_from_config(cfg), EngineClient([dead], connect_retries=0), buffer, A.RecordingLog(), spec)
    m.start()
    try:
        group = buffer.take(1, 0, timeout=60, alive=m.check)[0]
    finally:
        m.stop()
    assert len(group.samples) == 2
    for s in group.samples:
        assert s.failed is not None and "cannot connect" in s.failed and dead in s.failed, s.failed
    assert m.stats["engine_failures"] >= 1 and m.client.live_urls() == []


@pytest.mark.parametrize("kind,engine", [("sglang", ["engine.kind=sglang", "engine.urls=[http://127.0.0.1:1]"]),
                                         ("embedded", ["env.agent_gateway=true"])])
def test_config_needs_a_tokenizer_for_agents_behind_a_gateway(kind, engine):
    with pytest.raises(ConfigError, match="set model.tokenizer_path or model.path"):
        load_config(CONFIG, [*engine, "model.tokenizer_path=null"])
    with pytest.raises(ConfigError, match="use lora.sync=merged"):
        load_config(CONFIG, [*OVERRIDES, *engine, "lora.enabled=true", "lora.sync=adapter"])
    assert load_config(CONFIG, [*OVERRIDES, *engine]).env.uses_gateway(kind)  # accepted, and behind a gateway


def test_agent_gateway_auto_is_on_for_sglang_only_and_sglang_cannot_go_without():
    sglang = ["engine.kind=sglang", "engine.urls=[http://127.0.0.1:1]"]
    assert load_config(CONFIG, [*OVERRIDES, *sglang]).env.uses_gateway("sglang")
    assert not load_config(CONFIG, OVERRIDES).env.uses_gateway("embedded")  # the engine's own endpoints
    assert not load_config(CONFIG, [*OVERRIDES, "model.tokenizer_path=null", "env.agent_gateway=false"]).env.uses_gateway(
        "embedded")  # no tokenizer needed where the engine serves the calls (it then refuses chat without one)
    with pytest.raises(ConfigError, match="env.agent_gateway to auto or true"):
        load_config(CONFIG, [*OVERRIDES, *sglang, "env.agent_gateway=false"])

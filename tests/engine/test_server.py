"""The embedded engine over HTTP: a `moe-rl serve` subprocess driven by EngineClient."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from moe_rl.engine import EngineClient, EngineError, EngineHTTPError, decode_routed_experts, output_logprobs
from moe_rl.engine.protocol import token_weight_versions
from moe_rl.engine.server import build_model

from .helpers import ARCH, CFG, K, L, ServerProc, check_against_native, recompute, run, start_long


@pytest.fixture(scope="module")
def server():
    s = ServerProc()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model():
    return build_model(CFG)


SAMPLING = [
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 0.0},
    {"temperature": 1.3, "top_p": 0.8, "top_k": 20},
]


def test_concurrent_generate_matches_native_recompute(server, model):
    prompts = [[(7 * i + j) % ARCH.vocab_size for j in range(3 + 2 * i)] for i in range(12)]

    async def main():
        async with EngineClient(server.url) as c:
            return await asyncio.gather(*(
                c.generate(p, {**SAMPLING[i % 4], "max_new_tokens": 10 + i, "sampling_seed": i},
                           return_logprob=True, return_routed_experts=True)
                for i, p in enumerate(prompts)))

    outs = run(main())
    for i, (p, out) in enumerate(zip(prompts, outs)):
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 10 + i}
        assert len(out["output_ids"]) == 10 + i and meta["prompt_tokens"] == len(p)
        assert meta["weight_version"] == "0"
        assert token_weight_versions(meta) == ["0"] * (10 + i)
        assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 10 + i}]
        check_against_native(model, p, out, SAMPLING[i % 4]["temperature"])
        # dense layer 1 rows are zeros, as SGLang writes them
        assert not decode_routed_experts(out, L, K)[:, 1].any()


def test_seed_and_stop(server):
    async def main():
        async with EngineClient(server.url) as c:
            sp = {"temperature": 1.0, "max_new_tokens": 30, "sampling_seed": 123}
            a, b = await asyncio.gather(c.generate([1, 2, 3], sp), c.generate([1, 2, 3], sp))
            stop_tok = a["output_ids"][4]
            s = await c.generate([1, 2, 3], {**sp, "stop_token_ids": [stop_tok]})
            return a, b, s, stop_tok

    a, b, s, stop_tok = run(main())
    assert a["output_ids"] == b["output_ids"]
    first = a["output_ids"].index(stop_tok)
    assert s["output_ids"] == a["output_ids"][: first + 1]
    assert s["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}


def test_pause_abort_partial_outputs_resume_with_prefix(server, model):
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8]]

    async def main():
        async with EngineClient(server.url) as c:
            tasks = await start_long(c, prompts)
            await c.pause_generation("abort")
            partial = await asyncio.gather(*tasks)
            # a request sent while paused waits for continue
            late = asyncio.ensure_future(c.generate([5, 5], {"max_new_tokens": 3}))
            await asyncio.sleep(0.2)
            assert not late.done()
            await c.continue_generation()
            await late
            resumed = []
            for p, part in zip(prompts, partial):
                prefix = p + part["output_ids"]
                resumed.append(await c.generate(prefix, {"temperature": 1.0, "max_new_tokens": 5},
                                                return_routed_experts=True, routed_experts_start_len=len(prefix) - 1))
            return partial, resumed

    partial, resumed = run(main())
    for p, part, res in zip(prompts, partial, resumed):
        meta = part["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        m = len(part["output_ids"])
        assert 1 <= m < 900 and len(output_logprobs(meta)) == m
        full_out = part["output_ids"] + res["output_ids"]
        # merge: the partial covers tokens [0, P+m-1), the resumed request [P+m-1, seqlen-1)
        merged = np.concatenate([decode_routed_experts(part, L, K), decode_routed_experts(res, L, K)])
        ref_lp, ref_rows = recompute(model, p, full_out, 1.0)
        assert merged.shape[0] == len(p) + len(full_out) - 1  # every forwarded token once
        np.testing.assert_array_equal(merged, ref_rows)
        np.testing.assert_allclose(output_logprobs(meta) + output_logprobs(res["meta_info"]), ref_lp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_in_place_and_retract_resume(server, model, mode):
    prompts = [[9, 8, 7], [1, 1, 2, 3, 5]]

    async def main():
        async with EngineClient(server.url) as c:
            tasks = await start_long(c, prompts, n=120, return_logprob=True)
            await c.pause_generation(mode)
            before = (await c.get_model_info())["stats"]["output_tokens"]
            await asyncio.sleep(0.3)
            info = await c.get_model_info()
            assert info["stats"]["output_tokens"] == before and info["paused"] == mode
            assert not any(t.done() for t in tasks)
            await c.continue_generation()
            return await asyncio.gather(*tasks)

    outs = run(main())
    for p, out in zip(prompts, outs):
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 120}
        assert out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)
        check_against_native(model, p, out, 1.0)


def _post(url, path, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


@pytest.mark.parametrize("body,field", [
    ({}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": ["a", "b"]}, "input_ids"),
    ({"input_ids": [1, 99999]}, "input_ids"),
    ({"input_ids": [1] * 1024}, "input_ids"),  # longer than the context
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "x"}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"frobnicate": 1}}, "sampling_params.frobnicate"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ({"text": "hi"}, "text"),  # no tokenizer (SGLang with --skip-tokenizer-init)
    (b"{not json", "body"),
])
def test_malformed_generate_is_400_naming_the_field(server, body, field):
    status, reply = _post(server.url, "/generate", body)
    assert status == 400, reply
    assert reply["error"]["message"].startswith(field + ":"), reply


def test_other_400s_and_client_never_retries_them(server):
    assert _post(server.url, "/pause_generation", {"mode": "sleep"})[0] == 400
    assert _post(server.url, "/update_weights_from_distributed", {"names": ["x"]})[0] == 400
    assert _post(server.url, "/init_weights_update_group", {"master_address": "x"})[0] == 400

    async def main():
        async with EngineClient(server.url) as c:
            with pytest.raises(EngineHTTPError) as e:
                await c.generate([1] * 5000, {})
            assert e.value.status == 400 and "context length" in str(e.value) and server.url in str(e.value)
            assert await c.health()
            info = await c.get_model_info()
            assert info["weight_version"] == "0" and info["num_hidden_layers"] == L and info["moe_layers"] == [0, 2]

    run(main())


def test_auth():
    s = ServerProc(api_key="sekret")
    try:
        assert _post(s.url, "/generate", {"input_ids": [1]})[0] == 401
        assert _post(s.url, "/generate", {"input_ids": [1]}, {"Authorization": "Bearer wrong"})[0] == 401
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(s.url + "/health", timeout=10)
        assert e.value.code == 401
        status, out = _post(s.url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}},
                            {"Authorization": "Bearer sekret"})
        assert status == 200 and len(out["output_ids"]) == 2

        async def main():
            async with EngineClient(s.url, api_key="sekret") as c:
                assert len((await c.generate([1, 2], {"max_new_tokens": 3}))["output_ids"]) == 3
            async with EngineClient(s.url) as c:
                with pytest.raises(EngineHTTPError) as e:
                    await c.get_model_info()
                assert e.value.status == 401

        run(main())
    finally:
        s.stop()


def test_server_killed_mid_request_gives_a_clear_error():
    s = ServerProc()

    async def main():
        async with EngineClient([s.url], connect_retries=1, retry_backoff_s=0.05, timeout_s=60) as c:
            tasks = await start_long(c, [[1, 2, 3]], n=1000)
            s.kill()
            with pytest.raises(EngineError) as e:
                await asyncio.wait_for(tasks[0], 20)
            assert s.url in str(e.value) and "/generate" in str(e.value)
            with pytest.raises(EngineError) as e:  # now nothing listens: connect retries, then a clear error
                await asyncio.wait_for(c.generate([1], {}), 20)
            assert "cannot connect" in str(e.value)

    try:
        run(main())
    finally:
        s.stop()


def test_client_spreads_requests_over_urls(server):
    async def main():
        seen = []
        async with EngineClient([server.url, server.url + "/"]) as c:
            assert c.urls == [server.url, server.url]  # normalised
            c2 = EngineClient(["http://a", "http://b"])
            c2.outstanding["http://a"] = 3
            assert c2.pick() == "http://b"
            c2.outstanding["http://b"] = 3
            seen = {c2.pick() for _ in range(4)}
            await c2.close()
        return seen

    assert run(main()) == {"http://a", "http://b"}


def test_stream_and_client_disconnect(server):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 6}, "stream": True}
    req = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]  # cumulative, as SGLang's default
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}

    async def main():  # a client that goes away frees its request on the engine
        async with EngineClient(server.url) as c:
            before = (await c.get_model_info())["stats"].get("finished_abort", 0)
            tasks = await start_long(c, [[4, 4]], n=1000)
            tasks[0].cancel()
            for _ in range(500):
                info = await c.get_model_info()
                if info["running_requests"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert info["running_requests"] == 0 and info["stats"]["finished_abort"] == before + 1

    run(main())


def test_batched_generate_equals_single_requests(server, model):
    """SGLang's batch form: a list of prompts in, one response each out, the same as sending
    them one by one (each request samples from its own seeded generator)."""
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    sps = [{"temperature": 1.0, "max_new_tokens": 6 + i, "sampling_seed": 40 + i} for i in range(3)]

    async def main():
        async with EngineClient(server.url) as c:
            batch = await c.generate_batch(prompts, sps, return_routed_experts=True, rids=["b0", "b1", "b2"])
            single = [await c.generate(p, sp, return_routed_experts=True) for p, sp in zip(prompts, sps)]
            return batch, single

    batch, single = run(main())
    for p, b, s in zip(prompts, batch, single):
        assert b["output_ids"] == s["output_ids"]
        assert b["meta_info"]["routed_experts"] == s["meta_info"]["routed_experts"]
        check_against_native(model, p, b, 1.0)


def test_batched_generate_errors_name_the_prompt(server):
    body = {"input_ids": [[1, 2], [1, 10**6]], "sampling_params": {"max_new_tokens": 2}}
    req = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
    assert "prompt 1: input_ids" in e.value.read().decode()


def _profile_files(text: str) -> list[str]:
    head, *files = text.splitlines()
    assert head == "Stop profiling. This will take some time."
    return files


def test_start_and_stop_profile_write_a_trace_and_op_tables(server, tmp_path):
    """SGLang's /start_profile and /stop_profile: torch.profiler over the engine loop's steps,
    a gzipped Chrome trace and torch's op tables written into output_dir."""
    import gzip

    async def main():
        async with EngineClient(server.url) as c:
            errors = []
            for endpoint, body in (("/stop_profile", {}), ("/start_profile", {"activities": ["MEM"]}),
                                   ("/start_profile", {"num_steps": 0}), ("/start_profile", {"num_steps": "3"})):
                with pytest.raises(EngineHTTPError) as e:
                    await c.request("POST", endpoint, payload=body)
                errors.append(e.value.status)
            await c.request("POST", "/start_profile", payload={"output_dir": str(tmp_path), "activities": ["CPU", "GPU"]})
            with pytest.raises(EngineHTTPError) as e:  # one at a time
                await c.request("POST", "/start_profile", payload={"output_dir": str(tmp_path)})
            errors.append(e.value.status)
            out = await c.generate([1, 2, 3], {"max_new_tokens": 6})
            return errors, out, await c.request("POST", "/stop_profile", payload={})

    errors, out, text = run(main())
    assert errors == [400] * 5 and len(out["output_ids"]) == 6
    trace, ops = _profile_files(text)
    assert trace.startswith(str(tmp_path)) and trace.endswith("-TP-0.trace.json.gz") and ops.endswith("-TP-0.ops.txt")
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    assert any(ev.get("name") == "aten::_grouped_mm" for ev in events)  # the engine thread's ops
    assert "aten::_grouped_mm" in open(ops).read()


def test_a_profile_of_num_steps_ends_by_itself(server, tmp_path):
    async def main():
        async with EngineClient(server.url) as c:
            await c.request("POST", "/start_profile", payload={"output_dir": str(tmp_path), "num_steps": 2})
            await c.generate([4, 5, 6], {"max_new_tokens": 8})
            written = sorted(p.name for p in tmp_path.iterdir())  # before any /stop_profile
            return written, await c.request("POST", "/stop_profile", payload={})

    written, text = run(main())
    assert len(written) == 2 and sorted(f.rsplit("/", 1)[1] for f in _profile_files(text)) == written

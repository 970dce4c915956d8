"""(b) Every request moe-rl's client sends is one SGLang accepts (its endpoint exists with that
HTTP method in SGLang's http_server.py, its body is a valid io_struct request, sampling params
pass SGLang's own ``SamplingParams.verify``), and every answer of ``moe-rl serve`` carries the
fields SGLang's clients read. io_struct cannot be imported on CPU (see conftest): its field
lists are read from the installed SGLang source."""
from __future__ import annotations

import asyncio
import base64
import re
from types import SimpleNamespace

import numpy as np
import pytest

from .conftest import check_request, require_sglang, sglang_schema, sglang_source, sglang_text

require_sglang("sglang.srt.sampling.sampling_params")

from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from moe_rl.engine import EngineClient  # noqa: E402
from moe_rl.engine.protocol import decode_routed_experts  # noqa: E402
from moe_rl.rollout.manager import RolloutManager  # noqa: E402
from tests.engine.helpers import ARCH, CFG, K, L, ServerProc  # noqa: E402


BODY_TYPES = {
    "/generate": "GenerateReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq",
}


def sglang_routes() -> dict[str, set[str]]:
    """{path: HTTP methods} of SGLang's http_server.py (its route decorators)."""
    src = sglang_source("srt/entrypoints/http_server.py").read_text()
    routes: dict[str, set[str]] = {}
    for verb, path, methods in re.findall(r'@app\.(post|get|put|api_route)\(\s*"([^"]+)"(?:,\s*methods=\[([^\]]*)\])?', src):
        ms = {m.strip().strip('"\'') for m in methods.split(",")} if verb == "api_route" else {verb.upper()}
        routes.setdefault(path, set()).update(ms)
    return routes


def _check_sampling(sp: dict) -> None:
    p = SamplingParams(**sp)  # SGLang's own class: an unknown key raises TypeError
    p.normalize(None)
    p.verify(ARCH.vocab_size)


def _check(calls) -> None:
    routes = sglang_routes()
    for method, endpoint, payload in calls:
        assert method in routes.get(endpoint, set()), f"SGLang has no {method} {endpoint}"
        if endpoint in BODY_TYPES:
            body = payload or {}
            if endpoint == "/generate":
                # the batch form: lists; SGLang normalizes them per prompt
                check_request("GenerateReqInput", body)
                sps = body["sampling_params"] if isinstance(body["sampling_params"], list) else [body["sampling_params"]]
                for sp in sps:
                    _check_sampling(sp)
            else:
                check_request(BODY_TYPES[endpoint], body)


def test_every_client_request_is_an_sglang_request(monkeypatch):
    calls = []

    async def fake_request(self, method, endpoint, url=None, payload=None, timeout_s=None):
        calls.append((method, endpoint, payload))
        if endpoint == "/generate":
            n = len(payload["input_ids"]) if isinstance(payload["input_ids"][0], list) else 0
            one = {"output_ids": [], "meta_info": {}}
            return [one] * n if n else one
        return {"success": True, "tp_size": 1}

    monkeypatch.setattr(EngineClient, "request", fake_request)
    # the rollout manager's own request body (sampling params included)
    mgr = SimpleNamespace(cfg=CFG, task=SimpleNamespace(stop_token_ids=[1, 2]), _uid=lambda i, j: f"{i}-{j}")
    prompt = SimpleNamespace(input_ids=[3, 4, 5], max_new_tokens=None)
    req = RolloutManager._request(mgr, prompt, 0, 1, [7, 8], 1)

    async def run():
        c = EngineClient("http://127.0.0.1:1")
        h = c.engine("http://127.0.0.1:1")
        await c.generate(req["input_ids"], req["sampling_params"], return_routed_experts=True, rid=req["rid"],
                         routed_experts_start_len=req["routed_experts_start_len"])
        await c.generate_batch([[1, 2], [3]], [{"max_new_tokens": 4}, {"temperature": 0.0}], rids=["a", "b"],
                               return_routed_experts=True)
        await c.pause_generation("in_place")
        await c.continue_generation()
        await c.abort_request("a")
        await c.abort_request(abort_all=True)
        await c.flush_cache()
        await c.init_weights_update_group("http://127.0.0.1:1", "127.0.0.1", 1234, 1, 3, "g", "gloo")
        await c.update_weights_from_distributed("http://127.0.0.1:1", ["w"], ["bfloat16"], [[2, 3]], "g", 5)
        await h.begin_weight_update()
        await h.end_weight_update()
        await h.destroy_weights_update_group("g")
        await h.server_info()
        await c.get_model_info()
        await c.close()

    asyncio.run(run())
    assert {e for _, e, _ in calls} >= set(BODY_TYPES) | {"/flush_cache", "/get_server_info", "/get_model_info"}
    _check(calls)


def test_the_checks_catch_what_sglang_would_drop():
    with pytest.raises(AssertionError, match="checksum"):
        check_request("UpdateWeightsFromDistributedReqInput", {"names": [], "dtypes": [], "shapes": [], "checksum": "x"})
    with pytest.raises(TypeError):
        _check_sampling({"max_new_tokens": 3, "sampling_seed_typo": 1})
    with pytest.raises(AssertionError, match="no POST /update_weights_from_disk_typo"):
        _check([("POST", "/update_weights_from_disk_typo", {})])


def test_the_agent_gateway_sends_sglang_requests():
    """The OpenAI gateway before SGLang engines (moe_rl/engine/gateway.py) sends each parsed
    request as ``GenerateRequest.sglang_body()``: a valid GenerateReqInput whose sampling params
    pass SGLang's own checks, read back to the same request; it resumes the calls SGLang ends
    with its scheduler's abort_all message, and aborts with a valid AbortReq."""
    from moe_rl.engine.gateway import SGLANG_ABORT, RemoteEngine
    from moe_rl.engine.openai_api import _is_update_abort
    from moe_rl.engine.protocol import GenerateRequest

    limits = dict(vocab_size=ARCH.vocab_size, max_context=64, eos_token_ids=frozenset({2}), token_count=len)
    bodies = [
        {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 5}},
        {"input_ids": [3, 4, 5], "rid": "r-1", "return_logprob": True, "top_logprobs_num": 2, "stream": True,
         "return_routed_experts": True, "routed_experts_start_len": 2,
         "sampling_params": {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 9,
                             "stop_token_ids": [7], "ignore_eos": True, "sampling_seed": 11, "min_p": 0.1,
                             "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1,
                             "skip_special_tokens": False, "no_stop_trim": True}},
    ]
    calls = []
    for body in bodies:
        req = GenerateRequest.parse(body, **limits)
        out = req.sglang_body()
        assert GenerateRequest.parse(out, **limits) == req
        calls.append(("POST", "/generate", out))
    calls.append(("POST", "/abort_request", {"rid": "r-1"}))
    _check(calls)
    # the message SGLang's scheduler gives every request abort_all ends
    assert f'prepare_abort(req, "{SGLANG_ABORT}")' in sglang_source("srt/managers/scheduler.py").read_text()
    assert _is_update_abort({"type": "abort", "message": SGLANG_ABORT}, RemoteEngine.update_aborts)
    assert not _is_update_abort({"type": "abort", "message": SGLANG_ABORT, "status_code": 400}, RemoteEngine.update_aborts)


@pytest.fixture(scope="module")
def server():
    s = ServerProc()
    yield s
    s.stop()


def _read_like_sglang_clients(out: dict, n_prompt: int) -> None:
    """The fields slime, miles, verl and moe-rl read from an SGLang /generate answer."""
    assert all(isinstance(t, int) for t in out["output_ids"])
    m = out["meta_info"]
    assert m["finish_reason"]["type"] in ("stop", "length", "abort")
    assert m["prompt_tokens"] == n_prompt and m["completion_tokens"] == len(out["output_ids"])
    assert isinstance(m["weight_version"], str) and isinstance(m.get("cached_tokens", 0), int)
    lp = m["output_token_logprobs"]  # [logprob, token id, text (null: no tokenizer)]
    assert [t for _, t, _ in lp] == out["output_ids"] and all(isinstance(x, float) for x, _, _ in lp)
    rows = decode_routed_experts(m["routed_experts"], L, K)
    assert rows.shape == (n_prompt + len(out["output_ids"]) - 1, L, K)


def test_serve_answers_carry_what_sglang_clients_read(server):
    async def run():
        async with EngineClient(server.url, timeout_s=60) as c:
            one = await c.generate([3, 1, 4], {"max_new_tokens": 4, "temperature": 0.0}, return_routed_experts=True)
            many = await c.generate_batch([[3, 1], [4, 1, 5]], [{"max_new_tokens": 3}] * 2, return_routed_experts=True)
            info = await c.request("GET", "/get_server_info")
            ver = await c.request("GET", "/get_weight_version")
            loads = await c.request("GET", "/v1/loads")
            return one, many, info, ver, loads

    one, many, info, ver, loads = asyncio.run(run())
    _read_like_sglang_clients(one, 3)
    _read_like_sglang_clients(many[0], 2)
    _read_like_sglang_clients(many[1], 3)
    assert info["tp_size"] == 1 and info["weight_version"] == ver["weight_version"]
    assert isinstance(loads["loads"], list)


def test_serve_weight_session_and_group_endpoints_answer_as_sglang(server):
    async def run():
        async with EngineClient(server.url, timeout_s=60) as c:
            async def post(ep, body):
                try:
                    return 200, await c.request("POST", ep, payload=body)
                except Exception as e:  # EngineHTTPError carries status and body
                    return e.status, e.body
            return [
                await post("/end_weight_update", {}),
                await post("/begin_weight_update", {}),
                await post("/begin_weight_update", {}),
                await post("/end_weight_update", {}),
                await post("/destroy_weights_update_group", {"group_name": "nope"}),
                await post("/update_weight_version", {"new_version": "v7"}),
                await post("/release_memory_occupation", {}),
            ], await c.request("GET", "/get_weight_version")

    answers, ver = asyncio.run(run())
    codes = [a[0] for a in answers]
    assert codes == [400, 200, 400, 200, 400, 200, 400], answers
    assert all(isinstance(b, dict) and "success" in b for _, b in answers[:-1])
    assert ver["weight_version"] == "v7"


def _slime_body(prompt: list[int], top_p: float, seed: int | None) -> dict:
    """What slime's token-based rollout (slime/rollout/sglang_rollout.py: GenerateState's
    sampling params and generate()'s payload, read at commit 0044b40) posts to /generate with
    its defaults: stop and stop_token_ids unset, skip_special_tokens on, no_stop_trim, no spaces
    between special tokens, custom_params when top_p < 1, a sampling seed in deterministic mode,
    and routing replay on."""
    sp = {"temperature": 1.0, "top_p": top_p, "top_k": -1, "max_new_tokens": 5, "stop": None, "stop_token_ids": None,
          "skip_special_tokens": True, "no_stop_trim": True, "spaces_between_special_tokens": False}
    if top_p != 1.0:
        sp["custom_params"] = {"return_top_p_token_ids": True}
    if seed is not None:
        sp["sampling_seed"] = seed
    return {"sampling_params": sp, "return_logprob": True, "return_routed_experts": True, "input_ids": prompt}


def _post(url: str, body: dict) -> dict:
    async def run():
        async with EngineClient(url, timeout_s=60) as c:
            return await c.request("POST", "/generate", payload=body)
    return asyncio.run(run())


@pytest.mark.parametrize("top_p,seed", [(1.0, None), (0.9, 7)])
def test_serve_takes_slime_requests(tok_server, tokenizer, top_p, seed):
    """Against a `moe-rl serve` with a tokenizer (slime loads one from --hf-checkpoint and
    reads the answer's "text")."""
    body = _slime_body([8, 9, 10], top_p, seed)
    _check([("POST", "/generate", body)])  # it is an SGLang request to begin with
    out = _post(tok_server.url, body)
    # slime reads these: tokens and log-probs from output_token_logprobs, the text, then meta_info
    toks = [item[1] for item in out["meta_info"]["output_token_logprobs"]]
    assert toks == out["output_ids"]
    fin = out["meta_info"]["finish_reason"]
    if fin["type"] == "length":
        assert len(toks) == 5
    else:  # slime's default body has no seed: an EOS sampled early ends the answer there, as in SGLang
        assert fin["type"] == "stop" and fin["matched"] == toks[-1] and len(toks) <= 5, fin  # an EOS at the 5th beats the cap (SGLang)
    assert out["text"] == sglang_text(tokenizer, body["input_ids"], out["output_ids"], fin,
                                      skip=True, spaces=False, no_stop_trim=True)
    _read_like_sglang_clients(out, 3)


def _miles_body(input_ids: list[int], max_new_tokens: int, skip_special_tokens: bool, seed: int | None) -> dict:
    """What miles' default single-turn rollout posts to /generate (read at radixark/miles:
    miles/rollout/generate_utils/generate_endpoint_utils.py compute_request_payload, commit
    02aa8e7, and the sampling params of inference_rollout_common.compute_sampling_params,
    commit 0100aa8): token ids in, log-probs on, routing replay and indexer replay flags,
    stop/stop_token_ids from --rollout-stop* (unset: None), skip_special_tokens from
    --rollout-skip-special-tokens, no_stop_trim on, no spaces between special tokens, a
    sampling seed in deterministic mode (rollout_seed + index in the group) and the
    kv-cache namespace as extra_key when one is given."""
    sp = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens, "stop": None,
          "stop_token_ids": None, "skip_special_tokens": skip_special_tokens, "no_stop_trim": True,
          "spaces_between_special_tokens": False}
    if seed is not None:
        sp["sampling_seed"] = seed
    body = {"input_ids": input_ids, "sampling_params": sp, "return_logprob": True, "return_routed_experts": True,
            "return_indexer_topk": False}
    if seed is not None:
        body["extra_key"] = "ns-0"
    return body


class _MilesSample:
    """The fields miles' update_sample_from_response / Sample.update_from_meta_info read from an
    answer (written from that source; the same reads, not its code): tokens and log-probs
    from output_token_logprobs ([1], [0]), "text" appended to the response, routed_experts as
    int32 [len(tokens) - 1, num_layers, -1] (top-k from the buffer length), weight_version,
    finish_reason.type -> status, cached_tokens and prompt_tokens (prefix-cache stats)."""

    def __init__(self, prompt: list[int]):
        self.tokens, self.response, self.log_probs, self.versions = list(prompt), "", [], []
        self.status, self.cached, self.prompt_total, self.routed = "pending", 0, 0, None

    def update(self, output: dict) -> None:
        m = output["meta_info"]
        new = m.get("output_token_logprobs") or []
        self.tokens += [t[1] for t in new]
        self.log_probs += [t[0] for t in new]
        self.response += output["text"]
        buf = np.frombuffer(base64.b64decode(m["routed_experts"].encode("ascii")), dtype=np.int32)
        n = len(self.tokens) - 1
        self.routed = buf.reshape(n, L, len(buf) // (n * L))
        if "weight_version" in m:
            self.versions.append(m["weight_version"])
        self.status = {"length": "truncated", "abort": "aborted", "stop": "completed"}[m["finish_reason"]["type"]]
        self.cached += m.get("cached_tokens", 0)
        self.prompt_total += m.get("prompt_tokens", 0)


@pytest.mark.parametrize("skip,seed", [(True, None), (False, 11)])
def test_serve_takes_miles_requests(tok_server, tokenizer, skip, seed):
    """miles' default rollout, with its partial-rollout resume: the first answer is cut at 3
    tokens (length), then miles sends prompt + response with the rest of the budget."""
    prompt, budget = [8, 9, 10, 11], 7
    sample = _MilesSample(prompt)
    first = _miles_body(prompt, 3, skip, seed)
    _check([("POST", "/generate", first)])
    out1 = _post(tok_server.url, first)
    sample.update(out1)
    if sample.status == "completed":  # unseeded: an EOS sampled within 3 tokens ends the sample, as in SGLang
        fin = out1["meta_info"]["finish_reason"]
        assert seed is None and fin["matched"] == out1["output_ids"][-1] and len(out1["output_ids"]) <= 3, fin
        assert sample.response == sglang_text(tokenizer, prompt, out1["output_ids"], fin, skip=skip, spaces=False,
                                               no_stop_trim=True)
        return  # miles resumes only a truncated sample
    assert sample.status == "truncated" and len(sample.tokens) == len(prompt) + 3
    resume = _miles_body(list(sample.tokens), budget - (len(sample.tokens) - len(prompt)), skip, seed)
    _check([("POST", "/generate", resume)])
    out2 = _post(tok_server.url, resume)
    sample.update(out2)
    assert sample.tokens == resume["input_ids"] + out2["output_ids"]
    assert len(sample.tokens) <= len(prompt) + budget and len(sample.log_probs) == len(sample.tokens) - len(prompt)
    assert all(isinstance(x, float) and x <= 0 for x in sample.log_probs)
    assert sample.routed.shape == (len(sample.tokens) - 1, L, K)
    assert sample.status in ("truncated", "completed") and sample.versions == [out1["meta_info"]["weight_version"]] * 2
    assert sample.prompt_total == len(prompt) + len(resume["input_ids"])
    want = "".join(sglang_text(tokenizer, b["input_ids"], o["output_ids"], o["meta_info"]["finish_reason"],
                               skip=skip, spaces=False, no_stop_trim=True) for b, o in ((first, out1), (resume, out2)))
    assert sample.response == want


def test_serve_takes_verl_http_adapter_requests(server):
    """verl's AsyncHttpServerAdapter (verl/workers/rollout/sglang_rollout/http_server_engine.py,
    read at commit 03620c9): at launch GET /health_generate then GET /flush_cache until 200;
    generate() posts {text, sampling_params, input_ids, image_data, return_logprob,
    logprob_start_len, top_logprobs_num, token_ids_logprob, lora_path, custom_logit_processor}
    with the None values dropped: token ids in, log-probs on. (The sampling params come from
    verl's rollout config; the ones here are a plain set, not read from verl.)"""
    body = {"sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 4},
            "input_ids": [9, 8, 7], "return_logprob": True}
    _check([("GET", "/health_generate", None), ("GET", "/flush_cache", None), ("POST", "/generate", body)])

    async def run():
        async with EngineClient(server.url, timeout_s=60) as c:
            await c.request("GET", "/health_generate")
            await c.request("GET", "/flush_cache")
            return await c.request("POST", "/generate", payload=body)

    out = asyncio.run(run())
    assert len(out["output_ids"]) == 4 and len(out["meta_info"]["output_token_logprobs"]) == 4


def test_serve_knows_every_generate_req_input_field():
    """Every field of SGLang's GenerateReqInput, and every SamplingParams argument, is a field
    `moe-rl serve`'s parser knows (implemented, ignored, or accepted at its no-op value), so a
    request SGLang takes is never a 400 "unknown field" here."""
    from moe_rl.engine.protocol import GenerateRequest, RequestError

    fields = [f for f in sglang_schema()["GenerateReqInput"] if f not in ("input_ids", "text")]
    assert len(fields) > 40
    for f in fields:
        try:
            GenerateRequest.parse({"input_ids": [1, 2], f: None}, vocab_size=ARCH.vocab_size, max_context=64)
        except RequestError as e:
            pytest.fail(f"GenerateReqInput.{f}: {e}")
    names = list(SamplingParams.__struct_fields__)  # a msgspec Struct: API fields, then internal ones
    params = names[: names.index("stop_strs")]
    assert "sampling_seed" in params and len(params) > 20
    for p in params:
        try:
            GenerateRequest.parse({"input_ids": [1, 2], "sampling_params": {p: None}}, vocab_size=ARCH.vocab_size,
                                  max_context=64)
        except RequestError as e:
            pytest.fail(f"SamplingParams.{p}: {e}")
    with pytest.raises(RequestError, match="unknown"):  # the check can fail
        GenerateRequest.parse({"input_ids": [1, 2], "not_a_field": None}, vocab_size=ARCH.vocab_size, max_context=64)


def test_v1_loads_has_sglang_keys(server):
    """/v1/loads answers with the keys of SGLang's (entrypoints/v1_loads.py: the envelope;
    managers/load_snapshot.py: LoadSnapshot's core keys and its memory and queues sections)."""
    import ast

    async def run():
        async with EngineClient(server.url, timeout_s=60) as c:
            return (await c.request("GET", "/v1/loads"), await c.request("GET", "/v1/loads?include=core"),
                    await c.request("GET", "/v1/loads?dp_rank=1"))

    loads, core, other_rank = asyncio.run(run())
    fn = next(n for n in ast.walk(ast.parse(sglang_source("srt/entrypoints/v1_loads.py").read_text()))
              if isinstance(n, ast.AsyncFunctionDef) and n.name == "get_loads")
    envelope = next(n.value for n in ast.walk(fn) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict))
    assert set(loads) == {k.value for k in envelope.keys}
    schema = sglang_schema("srt/managers/load_snapshot.py")
    sections = {"memory": "MemoryMetrics", "speculative": "SpeculativeMetrics", "lora": "LoRAMetrics",
                "disaggregation": "DisaggregationMetrics", "queues": "QueueMetrics"}
    core_keys = set(schema["LoadSnapshot"]) - set(sections)
    (load,) = loads["loads"]
    ours = {"kv_slots_free", "kv_slots", "paused"}  # the embedded engine's additions
    assert set(load) - ours == core_keys | {"memory", "queues"}
    for key in ("memory", "queues"):
        assert set(load[key]) == set(schema[sections[key]])
    assert set(core["loads"][0]) - ours == core_keys and other_rank["loads"] == []
    assert load["num_running_reqs"] == load["num_waiting_reqs"] == load["num_used_tokens"] == 0
    assert load["kv_slots_free"] == load["kv_slots"] == load["max_running_requests"]


def test_update_from_disk_and_queue_full_speak_sglang(tmp_path):
    """The /update_weights_from_disk body the soak sends is an SGLang UpdateWeightFromDiskReqInput
    on an SGLang route, and the engine refuses a request past its queue with SGLang's message."""
    from moe_rl.engine.engine import Engine
    from moe_rl.engine.protocol import GenerateRequest, QueueFull
    from moe_rl.engine.server import build_model

    _check([("POST", "/update_weights_from_disk", {"model_path": "/ckpt", "weight_version": "3",
                                                   "abort_all_requests": False, "flush_cache": True})])
    src = sglang_source("srt/managers/scheduler.py").read_text()
    message = re.search(r'message = "(The request queue is full\.)"', src).group(1)
    engine = Engine(build_model(CFG), max_running_requests=1, max_context=64, max_waiting_requests=0)
    req = GenerateRequest.parse({"input_ids": [1, 2]}, vocab_size=ARCH.vocab_size, max_context=64)
    engine.submit(req, lambda r: None)  # a free KV slot awaits it
    with pytest.raises(QueueFull) as e:
        engine.submit(req, lambda r: None)
    assert str(e.value).startswith(message) and "engine.max_waiting_requests=0" in str(e.value)

"""The embedded engine's server under abuse (moe_rl.engine.limits): bodies past
engine.max_request_bytes get 413, bad JSON 400 naming ``body``, a half-sent request is closed
within engine.read_timeout_s, a full queue answers 503 with Retry-After; no route answers 5xx to
a client's mistake. The server runs in this process (helpers.InProcessServer)."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from moe_rl.engine.limits import MIB, ServerLimits, default_max_request_bytes, weight_update_bytes
from moe_rl.engine.protocol import dumps_body
from moe_rl.model import iter_local_hf_tensors

from .helpers import InProcessServer, wait_for

LIMIT = 65536
READ_T = 1.5
SLACK = 1.0  # scheduling on a loaded 2-core machine


@pytest.fixture(scope="module")
def srv():
    s = InProcessServer(["engine.max_running_requests=2", "engine.max_waiting_requests=2"],
                        ServerLimits(max_request_bytes=LIMIT, read_timeout_s=READ_T))
    yield s
    s.stop()


def request_bytes(method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> bytes:
    head = {"Host": "x", "Connection": "close", **(headers or {})}
    if body is not None and "Transfer-Encoding" not in head:
        head.setdefault("Content-Length", str(len(body)))
        head.setdefault("Content-Type", "application/json")
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in head.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def exchange(srv, data: bytes, timeout: float = 30) -> tuple[bytes, float]:
    """Sends ``data`` on a new connection and reads until the server closes it: (what came
    back, seconds from the last byte sent to the close)."""
    with socket.create_connection((srv.host, srv.port), timeout=timeout) as sock:
        sock.sendall(data)
        sent = time.monotonic()
        out = b""
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out, time.monotonic() - sent


def parse(resp: bytes) -> tuple[int, dict, object]:
    head, _, body = resp.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = body
    return int(lines[0].split()[1]), headers, parsed


def call(srv, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    return parse(exchange(srv, request_bytes(method, path, body, headers))[0])


def chunked(body: bytes, size: int = 4096) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def padded(n: int) -> bytes:
    """A valid /generate body of exactly ``n`` bytes (whitespace-padded)."""
    body = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}).encode()
    return body + b" " * (n - len(body))


# --- size -------------------------------------------------------------------------------------
def test_a_body_past_max_request_bytes_is_413_in_sglang_shape(srv):
    assert call(srv, "POST", "/generate", padded(LIMIT))[0] == 200  # the limit itself is allowed
    for headers, body in [({}, padded(LIMIT + 1)),
                          ({"Transfer-Encoding": "chunked"}, chunked(padded(LIMIT + 1))),
                          ({}, b"1" * (50 * MIB))]:
        status, _, reply = call(srv, "POST", "/generate", body, headers)
        assert status == 413, reply
        assert reply["error"]["message"].startswith("body:") and f"engine.max_request_bytes={LIMIT}" in reply["error"]["message"]


def test_default_max_request_bytes_holds_the_largest_legitimate_bodies(srv):
    e = srv.engine
    tensors = [(n, list(t.shape)) for n, t in iter_local_hf_tensors(e.model)]
    # one bucket holding every tensor, as EngineClient encodes it (dtype names as long as they get)
    update = dumps_body({"names": [n for n, _ in tensors], "dtypes": ["bfloat16"] * len(tensors),
                         "shapes": [s for _, s in tensors], "group_name": "moe_rl_weight_sync", "flush_cache": True,
                         "abort_all_requests": False, "load_format": "flattened_bucket", "weight_version": "123456",
                         "checksum": [4294967295, 4294967295]})
    top = e.arch.vocab_size - 1  # the longest ids
    batch = json.dumps({"input_ids": [[top] * (e.max_context - 1)] * e.max_running, "return_logprob": True,
                        "return_routed_experts": True, "sampling_params": [{"max_new_tokens": 1, "temperature": 1.0,
                                                                            "top_p": 1.0, "stop_token_ids": [1, 2]}] * e.max_running})
    default = default_max_request_bytes(e)
    assert len(update) <= default and len(batch) <= default
    assert default == MIB + max(32 * e.max_context * e.max_running, 2 * weight_update_bytes(tensors))
    assert weight_update_bytes(tensors) >= 0.9 * len(update)  # it measures that body, not another


# --- content ----------------------------------------------------------------------------------
def _nested(depth: int) -> bytes:
    return b'{"input_ids": [1], "sampling_params": {"temperature": ' + b"[" * depth + b"]" * depth + b"}}"


@pytest.mark.parametrize("body", [b"{not json", b"[" * 20000, b"1" * 60000, b"\xff\xfe\xfa", b"", b"  "],
                         ids=["syntax", "20000-brackets", "60000-digit-number", "not-utf8", "empty", "blank"])
def test_malformed_json_is_400_naming_the_body(srv, body):
    status, _, reply = call(srv, "POST", "/generate", body)
    assert status == 400, reply
    assert reply["error"]["message"].startswith("body:"), reply


@pytest.mark.parametrize("depth", [50, 400, 900, 980, 995])
def test_deeply_nested_values_are_400(srv, depth):
    status, _, reply = call(srv, "POST", "/generate", _nested(depth))
    assert status == 400, reply
    assert reply["error"]["message"].startswith(("body:", "sampling_params.temperature:")), reply


@pytest.mark.parametrize("path,body,field", [
    ("/update_weights_from_disk", {"model_path": 5}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/x", "load_format": "gguf"}, "load_format"),
    ("/update_weights_from_disk", {"model_path": "/x", "keep_pause": "yes"}, "keep_pause"),
    ("/abort_request", {"rid": [1]}, "rid"),
    ("/pause_generation", {"mode": {}}, "mode"),
    ("/update_weight_version", {"new_version": [1]}, "new_version"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": "p", "rank_offset": 1, "world_size": 2},
     "master_port"),
])
def test_wrong_types_are_400_naming_the_field(srv, path, body, field):
    status, _, reply = call(srv, "POST", path, json.dumps(body).encode())
    assert status == 400, reply
    assert reply["error"]["message"].startswith(field + ":"), reply


# every field name the endpoints read, each with a value of the wrong type
WRONG = {"input_ids": "x", "text": 5, "sampling_params": [1], "rid": [1], "stream": "yes", "return_logprob": 2,
         "return_routed_experts": "no", "mode": {}, "abort_all": "x", "new_version": {}, "names": 1, "dtypes": 1,
         "shapes": "x", "group_name": 3, "master_address": 1, "master_port": "p", "rank_offset": -1,
         "world_size": "w", "backend": 1, "model_path": 5, "weight_version": [], "lora_name": [1], "lora_path": {},
         "load_format": 1, "abort_all_requests": "y", "flush_cache": 0.5}
GARBAGE = [b"{not json", b"[" * 20000, b"9" * 60000, _nested(990), b"[]", b"null", b'"text"', b"1.5e999",
           json.dumps(WRONG).encode()] + [json.dumps({k: v}).encode() for k, v in WRONG.items()]


def test_no_route_answers_5xx_to_garbage(srv):
    routes = sorted({(r.method, r.resource.canonical) for r in srv.runner.app.router.routes()
                     if r.method not in ("HEAD", "*")} | {("POST", "/flush_cache"), ("POST", "/stop_profile"), ("GET", "/no_such_route")})
    assert len(routes) > 20
    answers = {}
    for method, path in routes:
        for body in GARBAGE:
            status = call(srv, method, path, body)[0]
            answers.setdefault(status, []).append((method, path, body[:40]))
    # and garbage at the HTTP level: a bad request line, a huge header, bad chunks, bad gzip
    for data in [b"GARBAGE\r\n\r\n", b"POST /generate HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000 + b"\r\n\r\n",
                 request_bytes("POST", "/generate", b"zz\r\nabc\r\n0\r\n\r\n", {"Transfer-Encoding": "chunked"}),
                 request_bytes("POST", "/generate", b"\x1f\x8b not gzip at all", {"Content-Encoding": "gzip"}),
                 request_bytes("POST", "/generate", b"{}", {"Content-Length": "-5"})]:
        out = exchange(srv, data)[0]
        if out:
            answers.setdefault(parse(out)[0], []).append(("raw", data[:40], ""))
    srv_errors = {s: a for s, a in answers.items() if s >= 500}
    assert not srv_errors, srv_errors
    assert set(answers) <= {200, 400, 404, 405, 413, 431}, set(answers)
    # the fuzz may have paused the engine or opened a weight-update session: undo, then serve
    call(srv, "POST", "/continue_generation", b"{}")
    call(srv, "POST", "/end_weight_update", b"{}")
    status, _, out = call(srv, "POST", "/generate", padded(200))
    assert status == 200 and len(out["output_ids"]) == 1


# --- time -------------------------------------------------------------------------------------
def test_half_sent_requests_are_closed_within_the_read_timeout(srv):
    """Every kind at once: each is closed READ_T after its last byte (the body one with a 408),
    while a slow but complete client inside the timeout is served."""
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\n"
    body = padded(300)
    results: dict[str, tuple[bytes, float]] = {}

    def half(name, data):
        results[name] = exchange(srv, data)

    def trickle():  # a chunked body that never ends: one chunk every 0.3 s
        with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
            sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
            start, out = time.monotonic(), b""
            sock.settimeout(0.3)
            while time.monotonic() - start < 20:
                try:
                    sock.sendall(b"1\r\n \r\n")
                    chunk = sock.recv(1 << 16)
                    if not chunk:
                        break
                    out += chunk
                except socket.timeout:
                    continue
                except OSError:
                    break
            results["trickled body"] = (out, time.monotonic() - start)

    def slow_but_complete():
        with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
            sock.sendall(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
            time.sleep(READ_T / 3)
            sock.sendall(body)
            results["slow"] = (sock.makefile("rb").read(), 0.0)

    def idle_keep_alive():  # one answered request, then silence: the idle connection is closed
        with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
            sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            out = sock.recv(1 << 16)
            answered = time.monotonic()
            while chunk := sock.recv(1 << 16):
                out += chunk
            results["idle keep-alive"] = (out, time.monotonic() - answered)

    threads = [threading.Thread(target=half, args=a) for a in [
        ("nothing sent", b""), ("request line", b"POST /gen"), ("headers", head + b"Content-Le"),
        ("body", head + b"Content-Length: 300\r\n\r\n" + body[:100])]]
    threads += [threading.Thread(target=f) for f in (trickle, slow_but_complete, idle_keep_alive)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert parse(results.pop("slow")[0])[0] == 200
    for name, (out, closed_after) in results.items():
        assert READ_T - 0.2 <= closed_after <= READ_T + SLACK, (name, closed_after)
        if name in ("body", "trickled body"):
            status, _, reply = parse(out)
            assert status == 408 and "engine.read_timeout_s" in reply["error"]["message"], (name, out)
        elif name == "idle keep-alive":
            assert parse(out)[0] == 200
        else:
            assert out == b"", (name, out)


# --- load -------------------------------------------------------------------------------------
def _loads(srv) -> dict:
    return call(srv, "GET", "/v1/loads")[2]["loads"][0]


def test_a_full_queue_answers_503_with_retry_after(srv):
    """2 KV slots, 2 waiting places: the 5th request (or a batch that does not fit) is refused;
    a refused batch leaves none of its prompts behind."""
    long = {"input_ids": [3, 1, 4], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    results = {}

    def post(i, body):
        results[i] = call(srv, "POST", "/generate", json.dumps(body).encode())

    def start(i):
        t = threading.Thread(target=post, args=(i, {**long, "rid": f"long{i}"}))
        t.start()
        return t

    threads = [start(i) for i in range(3)]
    assert wait_for(lambda: (_loads(srv)["num_running_reqs"], _loads(srv)["num_waiting_reqs"]) == (2, 1))
    # a batch of 2 with one place left: its first prompt is admitted, the second refused, the first withdrawn
    status, headers, reply = call(srv, "POST", "/generate", json.dumps(
        {"input_ids": [[5, 6], [7, 8]], "sampling_params": {"max_new_tokens": 5}}).encode())
    assert status == 503 and headers["Retry-After"] == "1", reply
    assert reply["error"]["message"].startswith("The request queue is full"), reply
    assert wait_for(lambda: _loads(srv)["num_waiting_reqs"] == 1)
    threads.append(start(3))
    assert wait_for(lambda: _loads(srv)["num_waiting_reqs"] == 2)
    for body in ({"input_ids": [9], "sampling_params": {"max_new_tokens": 2}},
                 {"input_ids": [9], "sampling_params": {"max_new_tokens": 2}, "stream": True}):
        status, headers, reply = call(srv, "POST", "/generate", json.dumps(body).encode())
        assert status == 503 and headers["Retry-After"] == "1" and "engine.max_waiting_requests=2" in reply["error"]["message"]
    load = _loads(srv)
    assert (load["num_running_reqs"], load["num_waiting_reqs"], load["kv_slots_free"]) == (2, 2, 0)
    assert call(srv, "POST", "/abort_request", b'{"abort_all": true}')[2] == {"success": True, "aborted": 4}
    for t in threads:
        t.join(30)
    assert sorted(r[2]["meta_info"]["finish_reason"]["type"] for r in results.values()) == ["abort"] * 4
    load = _loads(srv)
    assert (load["num_running_reqs"], load["num_waiting_reqs"], load["num_used_tokens"], load["kv_slots_free"]) == (0, 0, 0, 2)
    assert call(srv, "POST", "/generate", padded(100))[0] == 200


def test_a_client_gone_as_its_body_is_read_is_cancelled_in_the_handler():
    """The client hangs up (aiohttp cancels the handler's task) in the same turn of the loop as
    its body comes in: the cancellation must reach the handler's wait on the engine, or its
    request would run for no one (asyncio.wait_for drops it there: tried once)."""
    class Request(dict):
        content_length, body_exists, method, path = 2, True, "POST", "/generate"
        match_info = type("M", (), {"http_exception": None})()

        async def read(self):
            await asyncio.sleep(0)
            return b"{}"

    async def main():
        mw = ServerLimits(max_request_bytes=LIMIT, read_timeout_s=READ_T).middleware()
        outcomes = []
        for turns in range(5):  # cancel after 0..4 turns of the loop: at every point of the read
            seen = []

            async def handler(request):
                seen.append("called")
                try:
                    await asyncio.sleep(5)  # the wait on the engine
                    seen.append("ran on")
                except asyncio.CancelledError:
                    seen.append("cancelled")  # where the engine aborts the request
                    raise

            task = asyncio.ensure_future(mw(Request(), handler))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=2)
            outcomes.append((turns, bool(done) and task.cancelled(), seen))
        return outcomes

    outcomes = asyncio.run(main())
    for turns, cancelled, seen in outcomes:
        assert cancelled and seen in ([], ["called", "cancelled"]), (turns, seen)
    assert any(seen for _, _, seen in outcomes)  # some turn reached the handler

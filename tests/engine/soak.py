"""A soak of ``moe-rl serve`` with faults: many concurrent clients mixing normal, batched and
streamed generation (routed experts asked for by half of them) with clients that hang up
mid-request and mid-stream, aborts by rid and abort storms, malformed and oversized bodies,
half-sent requests, and, one at a time from a control task, weight updates from disk and over
the update group (WeightSender) and pause/continue in every mode, all while requests run.

Afterwards: the server is alive; every well-formed request was answered (200), and aborted
only by an abort that covered it; no answer was a 5xx; /v1/loads shows nothing running or
waiting and every KV slot free; the same greedy request gives the same tokens and log-probs as
before the load (the original weights restored from disk); the server's RSS grew at most 10%
after the warm-up; half-sent requests were closed within the read timeout.

The test suite runs a short one (tests/engine/test_soak.py); a longer one, for docs/serving.md:

    python -m tests.engine.soak --seconds 300 --clients 128      # prints the report as JSON
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import torch

from moe_rl.engine import EngineClient

from .helpers import ARCH, CFG, K, L, ServerProc

ABORT_CAUSES = {  # finish_reason.message of an abort -> the control event that may cause it
    "Aborted by /abort_request": "abort_all",
    "Aborted by pause_generation": "pause_abort",
    "Aborted for a weight update": "disk_abort",
}
GREEDY = {"input_ids": [4, 8, 15, 16, 23, 42], "sampling_params": {"temperature": 0.0, "max_new_tokens": 16},
          "return_logprob": True, "return_routed_experts": True}
KINDS = {"generate": 40, "stream": 14, "batch": 6, "hangup": 8, "hangup_stream": 7, "abort_rid": 6,
         "malformed": 10, "half_sent": 2}
CONTROL = ("pause_abort", "pause_retract", "pause_in_place", "disk", "disk_abort", "group", "abort_storm")


@dataclass
class Report:
    seconds: float = 0.0
    clients: int = 0
    counts: dict = field(default_factory=dict)  # action -> how many
    statuses: dict = field(default_factory=dict)  # HTTP status -> how many
    control: dict = field(default_factory=dict)  # control op -> how many
    problems: list = field(default_factory=list)
    latency_ms: dict = field(default_factory=dict)
    output_tokens: int = 0
    half_sent_closed_s: list = field(default_factory=list)
    client_loop_lag_s: float = 0.0  # the soak's own event loop, at worst
    rss_mb: dict = field(default_factory=dict)
    loads_after: dict = field(default_factory=dict)
    greedy_same: bool = False

    def count(self, d: dict, key) -> None:
        d[key] = d.get(key, 0) + 1


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Soak:
    def __init__(self, url: str, pid: int, dirs: dict[str, Path], *, seconds: float, clients: int,
                 read_timeout_s: float, seed: int = 0):
        self.url, self.pid, self.dirs = url, pid, dirs
        self.seconds, self.clients, self.read_timeout_s, self.seed = seconds, clients, read_timeout_s, seed
        self.r = Report(seconds=seconds, clients=clients)
        self.events: list[tuple[str, float, float]] = []  # (cause, start, end) of aborting control ops
        self.aborted: list[tuple[str, str, float, float]] = []  # (message, rid, start, end) of aborted answers
        self.targeted: set[str] = set()  # rids an /abort_request named
        self.latencies: dict[str, list[float]] = {"generate": [], "stream_first_event": [], "stream": []}
        self.rss: list[tuple[float, int]] = []
        self.version = 0
        self.half_sent: list[threading.Thread] = []
        self.deadline = 0.0

    # --- plumbing ------------------------------------------------------------------------------
    def problem(self, what: str) -> None:
        if len(self.r.problems) < 50:
            self.r.problems.append(what)

    def status(self, kind: str, status: int) -> None:
        self.r.count(self.r.statuses, status)
        if status >= 500:
            self.problem(f"{kind}: HTTP {status}")

    async def post(self, s: aiohttp.ClientSession, path: str, body) -> tuple[int, object]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with s.post(self.url + path, data=data, headers={"Content-Type": "application/json"}) as resp:
            raw = await resp.read()
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, raw

    # --- checks of one answer ------------------------------------------------------------------
    def check_answer(self, kind: str, body: dict, out, start: float, end: float) -> None:
        if not isinstance(out, dict) or "meta_info" not in out:
            return self.problem(f"{kind}: not an answer: {str(out)[:200]}")
        meta, ids = out["meta_info"], out["output_ids"]
        sp, reason = body["sampling_params"], out["meta_info"]["finish_reason"]
        self.r.output_tokens += len(ids)
        if reason["type"] == "abort":
            self.aborted.append((reason["message"], body.get("rid") or meta["id"], start, end))
        elif reason["type"] == "length" and len(ids) != sp["max_new_tokens"]:
            self.problem(f"{kind}: length finish with {len(ids)} of {sp['max_new_tokens']} tokens")
        elif reason["type"] == "stop" and ids[-1] not in sp.get("stop_token_ids", []):
            self.problem(f"{kind}: stop finish on {ids[-1]}, not a stop token")
        if len(ids) > sp["max_new_tokens"] or len(meta["output_token_logprobs"]) != len(ids):
            self.problem(f"{kind}: {len(ids)} tokens, {len(meta['output_token_logprobs'])} log-probs")
        versions = [int(v) for v in meta["output_token_weight_versions"]]
        if versions != sorted(versions):
            self.problem(f"{kind}: weight versions go back: {versions}")
        if body.get("return_routed_experts"):
            rows = len(base64.b64decode(meta["routed_experts"])) // (4 * L * K)
            full = len(body["input_ids"]) + len(ids) - 1
            if rows != full and not (reason["type"] == "abort" and rows == 0):
                self.problem(f"{kind}: {rows} routing rows for {full} forwarded tokens ({reason['type']})")

    def gen_body(self, rng: random.Random, *, long: bool = False) -> dict:
        # a long one could not finish in the seconds a soak has left: one left running shows
        sp = {"max_new_tokens": rng.randint(600, 900) if long else rng.randint(1, 24)}
        pick = rng.random()
        if pick < 0.3:
            sp["temperature"] = 0.0
        elif pick < 0.6:
            sp.update(temperature=1.0, top_p=0.9, top_k=20)
        else:
            sp.update(temperature=0.8, sampling_seed=rng.randint(0, 10**6))
        if rng.random() < 0.2:
            sp["stop_token_ids"] = [rng.randrange(ARCH.vocab_size) for _ in range(3)]
        return {"input_ids": [rng.randrange(ARCH.vocab_size) for _ in range(rng.randint(2, 40))], "sampling_params": sp,
                "return_logprob": True, "return_routed_experts": rng.random() < 0.5, "rid": f"s{rng.getrandbits(48):x}"}

    # --- client actions ------------------------------------------------------------------------
    async def do_generate(self, s, rng, i):
        body = self.gen_body(rng)
        start = time.monotonic()
        status, out = await self.post(s, "/generate", body)
        end = time.monotonic()
        self.status("generate", status)
        if status != 200:
            return self.problem(f"generate: HTTP {status}: {str(out)[:200]}")
        self.check_answer("generate", body, out, start, end)
        if out["meta_info"]["finish_reason"]["type"] != "abort":
            self.latencies["generate"].append(end - start)

    async def do_batch(self, s, rng, i):
        n = rng.randint(2, 4)
        bodies = [self.gen_body(rng) for _ in range(n)]
        body = {"input_ids": [b["input_ids"] for b in bodies], "sampling_params": [b["sampling_params"] for b in bodies], "rid": [b["rid"] for b in bodies],
                "return_logprob": True, "return_routed_experts": True}
        start = time.monotonic()
        status, outs = await self.post(s, "/generate", body)
        self.status("batch", status)
        if status != 200 or not isinstance(outs, list) or len(outs) != n:
            return self.problem(f"batch: HTTP {status}: {str(outs)[:200]}")
        for b, out in zip(bodies, outs):
            self.check_answer("batch", {**b, "return_routed_experts": True}, out, start, time.monotonic())

    async def do_stream(self, s, rng, i, hang_up_after: int | None = None):
        body = {**self.gen_body(rng, long=hang_up_after is not None), "stream": True}
        start, first, events = time.monotonic(), None, []
        async with s.post(self.url + "/generate", json=body) as resp:
            self.status("stream", resp.status)
            if resp.status != 200:
                return self.problem(f"stream: HTTP {resp.status}: {(await resp.read())[:200]}")
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                first = first or time.monotonic()
                events.append(line[6:].strip())
                if hang_up_after is not None and len(events) >= hang_up_after:
                    resp.close()  # the client goes away mid-stream
                    return
        end = time.monotonic()
        if not events or events[-1] != b"[DONE]":
            return self.problem(f"stream: ended without [DONE] after {len(events)} events")
        chunks = [json.loads(e) for e in events[:-1]]
        lens = [len(c["output_ids"]) for c in chunks]
        if lens != sorted(lens) or chunks[-1]["meta_info"]["finish_reason"] is None:
            return self.problem(f"stream: snapshots not cumulative or unfinished: {lens}")
        self.check_answer("stream", body, chunks[-1], start, end)
        if chunks[-1]["meta_info"]["finish_reason"]["type"] != "abort":
            self.latencies["stream"].append(end - start)
            self.latencies["stream_first_event"].append(first - start)

    async def do_hangup_stream(self, s, rng, i):
        await self.do_stream(s, rng, i, hang_up_after=rng.randint(1, 3))

    async def do_hangup(self, s, rng, i):
        """A client that goes away before its answer (its request is aborted on the engine)."""
        task = asyncio.ensure_future(self.post(s, "/generate", self.gen_body(rng, long=True)))
        await asyncio.sleep(rng.uniform(0.0, 0.4))
        task.cancel()
        try:
            status, out = await task
            self.status("hangup", status)  # it finished first
        except asyncio.CancelledError:
            pass

    async def do_abort_rid(self, s, rng, i):
        body = {**self.gen_body(rng, long=True), "rid": f"soak-{i}-{rng.getrandbits(48):x}"}
        start = time.monotonic()
        task = asyncio.ensure_future(self.post(s, "/generate", body))
        await asyncio.sleep(rng.uniform(0.05, 0.5))
        self.targeted.add(body["rid"])
        status, reply = await self.post(s, "/abort_request", {"rid": body["rid"]})
        self.status("abort_request", status)
        if status != 200:
            self.problem(f"abort_request: HTTP {status}: {reply}")
        status, out = await task
        self.status("abort_rid", status)
        if status != 200:
            return self.problem(f"abort_rid: HTTP {status}: {str(out)[:200]}")
        self.check_answer("abort_rid", body, out, start, time.monotonic())
        if out["meta_info"]["finish_reason"]["type"] not in ("abort", "stop"):  # a stop token may come first
            self.problem(f"abort_rid: {body['rid']} was not aborted: {out['meta_info']['finish_reason']}")

    MALFORMED = [
        (b"{not json", 400, "body:"),
        (b"[" * 20000, 400, "body:"),
        (b"7" * 200_000, 400, "body:"),
        (b"1" * (3 << 20), 413, "body:"),  # past the default engine.max_request_bytes (1.5 MiB for this model)
        (json.dumps({"input_ids": "x"}).encode(), 400, "input_ids:"),
        (json.dumps({"input_ids": [1], "sampling_params": {"top_p": 7}}).encode(), 400, "sampling_params.top_p:"),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": ' + b"[" * 990 + b"]" * 990 + b"}}", 400, ""),
        (json.dumps({"input_ids": [[1], [ARCH.vocab_size]]}).encode(), 400, "prompt 1: input_ids:"),
    ]

    async def do_malformed(self, s, rng, i):
        data, want, prefix = rng.choice(self.MALFORMED)
        status, reply = await self.post(s, "/generate", data)
        self.status("malformed", status)
        msg = reply.get("error", {}).get("message", "") if isinstance(reply, dict) else ""
        if status != want or not msg.startswith(prefix):
            self.problem(f"malformed {data[:30]!r}: HTTP {status} {msg[:100]!r}, expected {want} {prefix!r}")

    async def do_half_sent(self, s, rng, i):
        """Opens a connection that sends part of a request and waits for the server to close it,
        in a thread of its own (a blocking socket: its timing does not wait on this process's
        busy event loop). Only while the close can still come before the soak's end."""
        if time.monotonic() < self.deadline - self.read_timeout_s and sum(t.is_alive() for t in self.half_sent) < 32:
            data = rng.choice([b"", b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le",
                               b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 300\r\n\r\n{\"input_ids\""])
            t = threading.Thread(target=self._half_sent, args=(data,), daemon=True)
            t.start()
            self.half_sent.append(t)

    def _half_sent(self, data: bytes) -> None:
        host, port = self.url[len("http://"):].rsplit(":", 1)
        sent = time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=self.read_timeout_s + 30) as sock:
                sock.sendall(data)
                sent = time.monotonic()
                while sock.recv(1 << 16):
                    pass
                self.r.half_sent_closed_s.append(time.monotonic() - sent)
        except OSError as e:  # a reset is a close too; a timeout is not
            if isinstance(e, socket.timeout):
                self.problem(f"half-sent request: not closed within {self.read_timeout_s + 30} s")
            else:
                self.r.half_sent_closed_s.append(time.monotonic() - sent)

    async def lag(self, stop: asyncio.Event) -> None:
        """How late this process's event loop runs (a starved client sends late: reported)."""
        while not stop.is_set():
            t = time.monotonic()
            await asyncio.sleep(0.1)
            self.r.client_loop_lag_s = max(self.r.client_loop_lag_s, round(time.monotonic() - t - 0.1, 2))

    async def worker(self, i: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + i)
        kinds, weights = list(KINDS), list(KINDS.values())
        async with aiohttp.ClientSession(connector=_connector(), timeout=aiohttp.ClientTimeout(total=300)) as s:
            first = True
            while time.monotonic() < deadline:
                kind = kinds[i % len(kinds)] if first else rng.choices(kinds, weights)[0]
                first = False
                self.r.count(self.r.counts, kind)
                try:
                    await getattr(self, "do_" + kind)(s, rng, i)
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    self.problem(f"{kind}: {type(e).__name__}: {e}")

    # --- the control task: one operation at a time ---------------------------------------------
    async def control(self, deadline: float, warm: asyncio.Event) -> None:
        rng = random.Random(self.seed)
        model = _model("a")
        weights = {w: {n: t.clone() for n, t in _model(w).state_dict().items()} for w in ("a", "b")}
        from moe_rl.sync.sender import WeightSender

        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=_connector(), timeout=timeout) as s, \
                EngineClient(self.url, timeout_s=120) as c:
            sender = WeightSender(model, engines=[c.engine(self.url)], bucket_mb=0.05, timeout_s=60)
            try:
                ops = list(CONTROL)
                while ops or time.monotonic() < deadline:
                    op = ops.pop(0) if ops else rng.choice(CONTROL)
                    self.r.count(self.r.control, op)
                    start = time.monotonic()
                    await self.control_op(op, s, c, sender, model, weights, rng)
                    self.events.append((op, start, time.monotonic()))
                    if not ops:
                        warm.set()  # every operation has run once
                    await asyncio.sleep(rng.uniform(0.2, 1.0))
                # the original weights back, as the last operation
                self.version += 1
                await self.expect(s, "/update_weights_from_disk", {"model_path": str(self.dirs["a"]),
                                                                   "weight_version": str(self.version)})
            finally:
                sender.close()

    async def expect(self, s, path: str, body) -> object:
        status, reply = await self.post(s, path, body)
        self.status(path, status)
        if status != 200:
            self.problem(f"{path}: HTTP {status}: {str(reply)[:300]}")
        return reply

    async def control_op(self, op, s, c, sender, model, weights, rng) -> None:
        if op.startswith("pause_"):
            await self.expect(s, "/pause_generation", {"mode": op[len("pause_"):]})
            await asyncio.sleep(rng.uniform(0.05, 0.3))
            await self.expect(s, "/continue_generation", {})
        elif op in ("disk", "disk_abort"):
            self.version += 1
            await self.expect(s, "/update_weights_from_disk", {
                "model_path": str(self.dirs[rng.choice("ab")]), "weight_version": str(self.version),
                "abort_all_requests": op == "disk_abort"})
        elif op == "group":
            self.version += 1
            w = rng.choice("ab")
            with torch.no_grad():
                for n, p in model.state_dict().items():
                    p.copy_(weights[w][n])
            sender.pause_mode = rng.choice(["abort", "retract", "in_place"])
            if sender.pause_mode == "abort":
                self.events.append(("pause_abort", time.monotonic(), float("inf")))  # closed below
            await sender.sync_async(str(self.version))
            if sender.pause_mode == "abort":
                self.events[-1] = ("pause_abort", self.events[-1][1], time.monotonic())
            await c.close()  # no idle pooled connection outlives the server's keep-alive
        elif op == "abort_storm":
            for _ in range(20):
                await self.expect(s, "/abort_request", {"rid": f"no-such-{rng.getrandbits(32):x}"})
            await self.expect(s, "/abort_request", {"abort_all": True})

    # --- after the load ------------------------------------------------------------------------
    def check_aborts(self) -> None:
        spans = {}
        for op, a, b in self.events:
            cause = {"abort_storm": "abort_all", "pause_abort": "pause_abort", "disk_abort": "disk_abort"}.get(op)
            if cause:
                spans.setdefault(cause, []).append((a, b))
        for message, rid, start, end in self.aborted:
            cause = ABORT_CAUSES.get(message)
            covered = cause is not None and any(a <= end and start <= b for a, b in spans.get(cause, []))
            if not covered and not (message == "Aborted by /abort_request" and rid in self.targeted):
                self.problem(f"request {rid} aborted ({message!r}) with no abort that covered it")

    async def sample_rss(self, stop: asyncio.Event) -> None:
        import psutil

        proc = psutil.Process(self.pid)
        while not stop.is_set():
            self.rss.append((time.monotonic(), proc.memory_info().rss))
            await asyncio.sleep(0.25)

    async def loads(self, s) -> dict:
        async with s.get(self.url + "/v1/loads") as resp:
            return (await resp.json())["loads"][0]

    async def run(self) -> Report:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            status, before = await self.post(s, "/generate", GREEDY)
            stop_rss = asyncio.Event()
            rss_task = asyncio.ensure_future(self.sample_rss(stop_rss))
            lag_task = asyncio.ensure_future(self.lag(stop_rss))
            warm = asyncio.Event()
            t0 = time.monotonic()
            deadline = self.deadline = t0 + self.seconds
            workers = [asyncio.ensure_future(self.worker(i, deadline)) for i in range(self.clients)]
            control = asyncio.ensure_future(self.control(deadline, warm))
            await asyncio.wait([asyncio.ensure_future(warm.wait()), control], return_when=asyncio.FIRST_COMPLETED)
            warm_at = max(time.monotonic(), t0 + 0.3 * self.seconds)
            await asyncio.gather(control, *workers)
            for t in self.half_sent:
                await asyncio.to_thread(t.join)
            # nothing left running or waiting, every KV slot free (a hung-up request is aborted
            # once the server notices the disconnect)
            for _ in range(50):  # 5 s: far less than a long request left running would take
                load = await self.loads(s)
                if load["num_running_reqs"] == load["num_waiting_reqs"] == 0 and load["kv_slots_free"] == load["kv_slots"]:
                    break
                await asyncio.sleep(0.1)
            self.r.loads_after = {k: load[k] for k in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens",
                                                       "kv_slots_free", "kv_slots")}
            status2, after = await self.post(s, "/generate", GREEDY)
            stop_rss.set()
            await asyncio.gather(rss_task, lag_task)
            async with s.get(self.url + "/health") as resp:
                healthy = resp.status == 200
        self.r.seconds = round(time.monotonic() - t0, 1)
        self.check_aborts()
        if not healthy:
            self.problem("the server is not healthy after the soak")
        la = self.r.loads_after
        if (la["num_running_reqs"], la["num_waiting_reqs"], la["num_used_tokens"]) != (0, 0, 0) or la["kv_slots_free"] != la["kv_slots"]:
            self.problem(f"requests or KV slots left after the soak: {la}")
        same = (status == status2 == 200 and before["output_ids"] == after["output_ids"]
                and before["meta_info"]["output_token_logprobs"] == after["meta_info"]["output_token_logprobs"]
                and before["meta_info"]["routed_experts"] == after["meta_info"]["routed_experts"])
        self.r.greedy_same = same
        if not same:
            self.problem("the greedy request changed: " + "; ".join(
                f"{k}: {str(before['meta_info'].get(k, before.get(k)))[:120]} -> {str(after['meta_info'].get(k, after.get(k)))[:120]}"
                for k in ("output_ids", "output_token_logprobs", "routed_experts")))
        base = next(rss for t, rss in self.rss if t >= warm_at)
        end, peak = self.rss[-1][1], max(rss for t, rss in self.rss if t >= warm_at)
        self.r.rss_mb = {"after_warm_up": round(base / 2**20, 1), "end": round(end / 2**20, 1),
                         "peak": round(peak / 2**20, 1), "growth": round(end / base - 1, 4)}
        if end > 1.10 * base:
            self.problem(f"RSS grew {100 * (end / base - 1):.1f}% after the warm-up ({self.r.rss_mb})")
        late = [x for x in self.r.half_sent_closed_s if x > self.read_timeout_s + 2.0]
        if late:
            self.problem(f"half-sent requests closed after {max(late):.1f} s (read timeout {self.read_timeout_s} s)")
        for key, xs in self.latencies.items():
            self.r.latency_ms[key] = {"n": len(xs), "p50": round(1000 * _pct(xs, 0.5), 1),
                                      "p99": round(1000 * _pct(xs, 0.99), 1),
                                      "mean": round(1000 * statistics.fmean(xs), 1) if xs else None}
        return self.r


def _connector() -> aiohttp.TCPConnector:
    """A connection per request: a soaked client's event loop lags by seconds, and a kept-alive
    connection it picks up after the server's read timeout closed it would fail a request for
    no fault of the server (tests/engine/test_limits.py checks the keep-alive timeout)."""
    return aiohttp.TCPConnector(force_close=True)


def _model(which: str):
    from moe_rl.engine.server import build_model

    m = build_model(CFG)
    return m if which == "a" else m.init_weights(seed=4242)


def write_checkpoints(root: Path) -> dict[str, Path]:
    """a: the served model's own weights (the seeded init of CFG); b: other weights."""
    from moe_rl.model import save_hf

    return {w: save_hf(_model(w), root / w) for w in ("a", "b")}


def run_soak(seconds: float, clients: int, read_timeout_s: float, seed: int = 0, overrides=()) -> tuple[Report, list[str]]:
    """Starts ``moe-rl serve`` (the tests' config), soaks it; returns the report and the server's log."""
    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_checkpoints(Path(tmp))
        server = ServerProc([f"engine.read_timeout_s={read_timeout_s}", *overrides])
        try:
            soak = Soak(server.url, server.proc.pid, dirs, seconds=seconds, clients=clients,
                        read_timeout_s=read_timeout_s, seed=seed)
            report = asyncio.run(soak.run())
            if server.proc.poll() is not None:
                report.problems.append(f"the server exited with {server.proc.returncode}")
            return report, server.lines
        finally:
            server.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.engine.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--read-timeout-s", type=float, default=30.0, help="engine.read_timeout_s (its default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    report, _ = run_soak(args.seconds, args.clients, args.read_timeout_s, args.seed)
    print(json.dumps(report.__dict__, indent=1))
    return 0 if not report.problems else 1


if __name__ == "__main__":
    sys.exit(main())

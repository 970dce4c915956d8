"""Test helpers: ``moe-rl serve`` as a subprocess on a free port (one torch thread), and the
native model's recomputation that engine outputs are checked against."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from moe_rl.config import load_config
from moe_rl.engine import decode_routed_experts, output_logprobs
from moe_rl.engine.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny.yaml")
# 3 layers with a dense one in the middle, so routed_experts rows of dense layers are exercised
OVERRIDES = ["model.num_hidden_layers=3", "model.mlp_only_layers=[1]", "model.max_position_embeddings=1024",
             "engine.max_context=1024", "engine.threads=1", "engine.max_running_requests=16"]

CFG = load_config(CONFIG, OVERRIDES)
ARCH = CFG.model.arch()
L, K = ARCH.num_hidden_layers, ARCH.num_experts_per_tok


class ServerProc:
    def __init__(self, overrides=(), api_key: str | None = None, timeout: float = 90.0, port: int = 0):
        cmd = [sys.executable, "-m", "moe_rl.cli", "serve", CONFIG, "--port", str(port), *OVERRIDES, *overrides]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._ready.wait(timeout) or self._url is None:
            self.stop()
            raise RuntimeError("engine server did not start:\n" + "".join(self.lines[-40:]))
        self.url = self._url

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m and self._url is None:
                self._url = m.group(1)
                self._ready.set()
        self._ready.set()  # exited

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_for(pred, timeout: float = 30.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return False


def recompute(model, prompt, output, temperature):
    """The native model's log-probs of ``output`` and routing rows [seqlen-1, L, K] (dense
    layers 0), from one fresh full-sequence forward."""
    seq = list(prompt) + list(output)
    record: list[torch.Tensor] = []
    with torch.no_grad():
        logits = model(torch.tensor([seq]), record=record)[0].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)
    P = len(prompt)
    logprobs = [lp[P - 1 + j, tok].item() for j, tok in enumerate(output)]
    rows = np.zeros((len(seq), L, K), dtype=np.int32)
    for i, layer in enumerate(model.moe_layers):
        rows[:, layer] = record[i].numpy()
    return logprobs, rows[:-1]


def check_against_native(model, prompt, out, temperature):
    ref_lp, ref_rows = recompute(model, prompt, out["output_ids"], temperature)
    got = output_logprobs(out["meta_info"])
    assert len(got) == len(out["output_ids"])
    np.testing.assert_allclose(got, ref_lp, atol=1e-5, rtol=0)
    rows = decode_routed_experts(out, L, K)
    assert rows.shape == ref_rows.shape
    np.testing.assert_array_equal(rows, ref_rows)


def _submit(engine, bodies: list[dict]):
    """Submits every /generate body; returns wait(timeout) -> the outputs in body order."""
    from moe_rl.engine.protocol import GenerateRequest

    outs, done = {}, threading.Semaphore(0)
    for i, body in enumerate(bodies):
        req = GenerateRequest.parse(body, vocab_size=engine.arch.vocab_size, max_context=engine.max_context)
        engine.submit(req, lambda r, i=i: (outs.__setitem__(i, r), done.release()))

    def wait(timeout: float) -> list[dict]:
        for _ in bodies:
            assert done.acquire(timeout=timeout)
        return [outs[i] for i in range(len(bodies))]
    return wait


def generate(engine, bodies: list[dict], timeout: float = 120) -> list[dict]:
    """Every /generate body through a running engine; the outputs in body order."""
    return _submit(engine, bodies)(timeout)


def generate_queued(engine, bodies: list[dict], timeout: float = 120) -> list[dict]:
    """Queues every /generate body, then starts the engine and waits for all: two engines given
    the same bodies run the same sequence of batches. Stops the engine."""
    wait = _submit(engine, bodies)
    engine.start()
    try:
        return wait(timeout)
    finally:
        engine.stop()


def decode_graphs_on_a_gpu(model, bodies: list[dict], **engine_kw) -> list[dict]:
    """A bf16 copy of ``model`` on the GPU, served by an eager static-decode engine and by one that
    replays captured CUDA graphs, the same queued ``bodies`` through each: the two give the same
    tokens, log-probs (1e-5) and routing, and the graphs replayed every static step. Returns the
    graph engine's outputs."""
    gpu = type(model)(model.arch).to("cuda", torch.bfloat16)
    gpu.load_state_dict(model.state_dict())
    eager = Engine(gpu, static_decode=True, cuda_graph=False, **engine_kw)
    graphs = Engine(gpu, cuda_graph=True, **engine_kw)
    want, got = generate_queued(eager, bodies), generate_queued(graphs, bodies)
    assert graphs.stats["decode_graph_steps"] == eager.stats["decode_static_steps"] > 10
    arch = model.arch
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        np.testing.assert_allclose(output_logprobs(b["meta_info"]), output_logprobs(a["meta_info"]), rtol=0, atol=1e-5)
        np.testing.assert_array_equal(decode_routed_experts(b, arch.num_hidden_layers, arch.num_experts_per_tok),
                                      decode_routed_experts(a, arch.num_hidden_layers, arch.num_experts_per_tok))
    return got


def check_bf16_against_fp32_replayed(model, bodies: list[dict], outs: list[dict], atol: float = 0.15) -> None:
    """A bf16 engine's log-probs against one full forward of the fp32 ``model`` that replays the
    engine's experts (as the trainer does with R3): close, not equal. Without the replay bf16 flips
    a few of a random model's near-tied top-k choices, each moving a log-prob by more than atol."""
    arch = model.arch
    for body, out in zip(bodies, outs):
        prompt = body["input_ids"]
        seq = prompt + out["output_ids"]
        rows = decode_routed_experts(out, arch.num_hidden_layers, arch.num_experts_per_tok)
        replay = [torch.from_numpy(np.ascontiguousarray(rows[:, n])).long() for n in model.moe_layers]
        t = body["sampling_params"].get("temperature") or 1.0
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([seq[:-1]]), replay=replay)[0].float() / t, -1)
        ref = [lp[len(prompt) - 1 + j, tok].item() for j, tok in enumerate(out["output_ids"])]
        np.testing.assert_allclose(output_logprobs(out["meta_info"]), ref, atol=atol, rtol=0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def start_long(c, prompts, n=900, **kw):
    base = (await c.get_model_info())["stats"].get("output_tokens", 0)
    tasks = [asyncio.ensure_future(c.generate(p, {"temperature": 1.0, "max_new_tokens": n, "sampling_seed": i},
                                              return_routed_experts=True, **kw)) for i, p in enumerate(prompts)]
    while (await c.get_model_info())["stats"].get("output_tokens", 0) < base + 8 * len(prompts):
        await asyncio.sleep(0.01)
    return tasks


class InProcessServer:
    """An engine of ``CFG`` (plus ``overrides``) and its HTTP server on a free port of this process,
    the server's loop in a thread (as moe_rl.engine.host runs it): no subprocess to start."""

    def __init__(self, overrides=(), limits=None):
        from moe_rl.engine.server import build_engine, start_server

        cfg = load_config(CONFIG, OVERRIDES + list(overrides))
        self.engine = build_engine(cfg)
        self.loop = asyncio.new_event_loop()
        self.runner, self.url = self.loop.run_until_complete(
            start_server(self.engine, "127.0.0.1", 0, None, limits))
        self.host, self.port = "127.0.0.1", int(self.url.rsplit(":", 1)[1])
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.engine.stop()

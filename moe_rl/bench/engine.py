"""``moe-rl bench engine [--json]``: the embedded engine's throughput over its HTTP API.

Starts an embedded engine in-process on a free port (the default config's model unless
``--config`` says otherwise) and drives it with ``EngineClient``:

* ``tokens_per_s_1``: output tokens/s with one request at a time;
* ``tokens_per_s_concurrent``: output tokens/s with ``--concurrency`` (default 64) concurrent
  requests (continuous batching); ``batching_speedup`` is its ratio to ``tokens_per_s_1``;
* ``ttft_ms``: time to first token of a single request (median latency of a one-token
  request: HTTP + prefill + sampling).

``--device cuda`` puts the engine's model and KV cache on the current GPU (the KV cache sized by
placement.mem_fraction_static, at most ``--concurrency`` requests); default ``cpu``.

Every request samples (temperature 1, no stop tokens) exactly ``--max-new-tokens`` tokens
from a ``--prompt-len`` prompt. Throughputs are the best of ``--repeats`` runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


async def _bench(cfg, args) -> dict:
    from ..engine.client import EngineClient
    from ..engine.server import build_engine, start_server

    engine = build_engine(cfg, device=args.device)
    runner, url = await start_server(engine, "127.0.0.1", 0)
    vocab = cfg.model.arch().vocab_size
    try:
        async with EngineClient(url, timeout_s=600) as c:
            def prompt(i):
                return [(17 * i + 5 * j + 1) % vocab for j in range(args.prompt_len)]

            sp = {"temperature": 1.0, "max_new_tokens": args.max_new_tokens}

            async def one(i, n=args.max_new_tokens):
                out = await c.generate(prompt(i), {**sp, "max_new_tokens": n, "sampling_seed": i})
                return len(out["output_ids"])

            await asyncio.gather(*(one(i, 4) for i in range(4)))  # warm-up

            async def throughput(concurrency: int, n_requests: int) -> float:
                sem = asyncio.Semaphore(concurrency)

                async def limited(i):
                    async with sem:
                        return await one(i)

                t0 = time.perf_counter()
                tokens = sum(await asyncio.gather(*(limited(i) for i in range(n_requests))))
                return tokens / (time.perf_counter() - t0)

            tps1 = max([await throughput(1, args.sequential_requests) for _ in range(args.repeats)])
            tpsn = max([await throughput(args.concurrency, args.concurrency) for _ in range(args.repeats)])
            ttfts = []
            for i in range(args.ttft_samples):
                t0 = time.perf_counter()
                await one(i, 1)
                ttfts.append((time.perf_counter() - t0) * 1e3)
            stats = (await c.get_model_info())["stats"]
    finally:
        await runner.cleanup()
        engine.stop()
    return {
        "tokens_per_s_1": round(tps1, 1),
        "tokens_per_s_concurrent": round(tpsn, 1),
        "concurrency": args.concurrency,
        "kv_slots": engine.max_running,
        "device": str(engine.device),
        "ttft_ms": round(statistics.median(ttfts), 2),
        "batching_speedup": round(tpsn / tps1, 2),
        "engine_steps": stats.get("steps"),
    }


def main(argv: list[str] | None = None) -> int:
    from ..config import ConfigError, load_config

    ap = argparse.ArgumentParser(prog="moe-rl bench engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default engine.threads, else torch's)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the engine runs")
    ap.add_argument("--sequential-requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ttft-samples", type=int, default=7)
    args = ap.parse_intermixed_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    overrides = list(args.overrides)
    if args.threads:
        overrides.append(f"engine.threads={args.threads}")
    overrides.append(f"engine.max_running_requests={max(args.concurrency, 1)}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.engine.threads:
        torch.set_num_threads(cfg.engine.threads)
    summary = asyncio.run(_bench(cfg, args))
    report = {
        "bench": "engine",
        "config": args.config,
        "params": {"device": args.device, "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
                   "concurrency": args.concurrency, "threads": torch.get_num_threads(), "dtype": cfg.engine.dtype},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None},
        "summary": summary,
    }
    if args.json:
        print(json.dumps(report))
    else:
        p = report["params"]
        print(f"embedded engine, {Path(args.config).name}, prompt {p['prompt_len']} + {p['max_new_tokens']} new tokens, "
              f"{p['threads']} torch threads")
        print(f"  {'concurrency':>12} {'tokens/s':>10}")
        print(f"  {1:>12} {summary['tokens_per_s_1']:>10.1f}")
        print(f"  {args.concurrency:>12} {summary['tokens_per_s_concurrent']:>10.1f}   ({summary['batching_speedup']:.1f}x)")
        print(f"  time to first token: {summary['ttft_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

The summary is the engine as the config sets it up (engine.static_decode, engine.cuda_graph:
on a GPU graphs are on where they can be captured); ``variants`` measures each decode mode
(``--variants``, default all that run on the device): ``dynamic`` (every step eager, shapes
as they come), ``static`` (decode steps padded to batch-size / context buckets, eager) and,
on a GPU, ``cuda_graph`` (those steps replayed from CUDA graphs) and ``compiled`` (the same with
engine.compile: the step compiled by Inductor before the capture; ``compile_s``), each with the
same keys as the summary; a mode that cannot run there says why (``skipped``). The configured
engine is one of them (a compiled static step without graphs, the CPU's, is ``static_compiled``).

Every request samples (temperature 1, no stop tokens) exactly ``--max-new-tokens`` tokens
from a ``--prompt-len`` prompt. Throughputs are the best of ``--repeats`` runs.

``--profile DIR`` then runs one more request between the engine's ``/start_profile`` and
``/stop_profile`` (torch.profiler over the engine loop's steps, the GPU's kernels too):
``summary.profile`` gives its time per output token, its engine steps and top ops, and the
files in DIR (a Chrome trace and torch's op tables, ``*-TP-0.ops.txt``).

``--out FILE`` writes the JSON report there after each figure of the configured engine (its
start, with the graph capture; one request; concurrent; time to first token) and after each
variant, ``summary.stopped`` saying what was under way until the last: a run stopped by a time
cap keeps what it measured.
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


MODES = {"dynamic": {"static_decode": False, "cuda_graph": False, "compile": False},
         "static": {"static_decode": True, "cuda_graph": False, "compile": False},
         "cuda_graph": {"static_decode": True, "cuda_graph": True, "compile": False},
         "compiled": {"static_decode": True, "cuda_graph": True, "compile": True}}
GPU_ONLY = ("cuda_graph", "compiled")


async def _bench(cfg, args, model=None, progress=None, profile_dir: Path | None = None, **mode) -> dict:
    """One engine's figures; ``progress(figures)``, if given, gets them as they come;
    ``profile_dir``: then one request under torch.profiler (``_profile_request``)."""
    from ..engine.client import EngineClient
    from ..engine.server import build_engine, start_server

    progress = progress or (lambda figures: None)
    t0 = time.perf_counter()
    engine = build_engine(cfg, model=model, device=args.device, **mode)
    runner, url = await start_server(engine, "127.0.0.1", 0)
    dec = engine.static_decoder
    got = {"concurrency": args.concurrency, "kv_slots": engine.max_running, "device": str(engine.device),
           "static_decode": engine.static_decode, "cuda_graph": engine.cuda_graph,
           "compile": bool(dec and dec.compiled), "start_s": round(time.perf_counter() - t0, 2),
           "capture_s": round(dec.capture_s, 2) if dec else 0.0, "compile_s": round(dec.compile_s, 2) if dec else 0.0}
    if engine.device.type == "cuda":  # the experts' grouped-GEMM tiles of a decode step, as this run takes them
        from ..kernels.grouped_gemm import tuned_tiles

        got["grouped_gemm_tiles"] = {str(dt).removeprefix("torch."): list(t) for dt, t in tuned_tiles(engine.device).items()}
    progress({**got, "stopped": "during the warm-up or one request at a time"})
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
            got["tokens_per_s_1"] = round(tps1, 1)
            progress({**got, "stopped": f"during {args.concurrency} concurrent requests"})
            tpsn = max([await throughput(args.concurrency, args.concurrency) for _ in range(args.repeats)])
            got.update(tokens_per_s_concurrent=round(tpsn, 1), batching_speedup=round(tpsn / tps1, 2))
            progress({**got, "stopped": "during the time-to-first-token requests"})
            ttfts = []
            for i in range(args.ttft_samples):
                t0 = time.perf_counter()
                await one(i, 1)
                ttfts.append((time.perf_counter() - t0) * 1e3)
            if profile_dir is not None:
                progress({**got, "stopped": "during the profiled request"})
                got["profile"] = await _profile_request(c, one, engine, profile_dir)
            stats = (await c.get_model_info())["stats"]
    finally:
        await runner.cleanup()
        engine.stop()
    return {
        **got,
        "ttft_ms": round(statistics.median(ttfts), 2),
        "engine_steps": stats.get("steps"),
        "decode_static_steps": stats.get("decode_static_steps", 0),
        "decode_graph_steps": stats.get("decode_graph_steps", 0),
        "decode_graphs": stats.get("decode_graphs", 0),
    }


async def _profile_request(c, one, engine, out_dir: Path) -> dict:
    """One request of ``--max-new-tokens`` tokens between the engine's ``/start_profile`` and
    ``/stop_profile`` (SGLang's endpoints: torch.profiler over the engine loop's steps, the GPU's
    kernels too): its time per output token, the profile's files and its top ops. The profiler
    costs time of its own (on a CPU most of it): the speed is ``tokens_per_s_1``, the profile
    says where a step's time goes."""
    await c.request("POST", "/start_profile", payload={"output_dir": str(out_dir)})
    t0 = time.perf_counter()
    tokens = await one(0)
    wall = time.perf_counter() - t0
    answer = await c.request("POST", "/stop_profile", payload={})
    files = [line for line in str(answer).splitlines()[1:] if line]
    return {"tokens": tokens, "ms_per_token": round(wall * 1e3 / tokens, 3), "files": files,
            **(engine.step_profiler.top or {})}


async def _bench_modes(cfg, args, save=None) -> dict:
    """The configured engine, then every other mode of ``args.variants``, all on one model
    (built once: a large random init takes seconds) unless the engine attaches LoRA to it.
    ``save(summary)``, if given, gets the summary as it fills."""
    from ..engine.server import build_model

    save = save or (lambda summary: None)
    save({"stopped": "while building the model"})
    shared = not (cfg.lora.enabled and cfg.lora.sync == "adapter")
    model = build_model(cfg).to(args.device) if shared else None
    save({"stopped": "while starting the engine (its graph capture)"})
    summary = await _bench(cfg, args, model, save, profile_dir=args.profile)
    configured = next((name for name, m in MODES.items() if (m["static_decode"], m["cuda_graph"], m["compile"])
                       == (summary["static_decode"], summary["cuda_graph"], summary["compile"])), "static_compiled")
    variants = {configured: {k: summary[k] for k in VARIANT_KEYS}}
    if args.variants == "all":
        names = [n for n in MODES if n not in GPU_ONLY or args.device == "cuda"]
    else:
        names = [] if args.variants == "none" else args.variants.split(",")
    for name in names:
        if name in variants:
            continue
        save({**summary, "variants": dict(variants), "stopped": f"during the {name} variant"})
        _free_device_memory()
        try:
            out = await _bench(cfg, args, model, **MODES[name])
            variants[name] = {k: out[k] for k in VARIANT_KEYS}
        except ValueError as e:  # e.g. cuda_graph with float32 experts: not capturable there
            variants[name] = {"skipped": str(e)}
    summary["variants"] = {n: variants[n] for n in [*MODES, configured] if n in variants}
    return summary


VARIANT_KEYS = ("tokens_per_s_1", "tokens_per_s_concurrent", "ttft_ms", "batching_speedup", "engine_steps",
                "decode_static_steps", "decode_graph_steps", "decode_graphs", "start_s", "capture_s", "compile_s")


def _free_device_memory() -> None:
    """The previous engine's KV cache and graphs go before the next one sizes its own."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    from ..config import ConfigError, load_config

    ap = argparse.ArgumentParser(prog="moe-rl bench engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", default=None, help="also write the JSON report to this file, rewritten as figures come")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default engine.threads, else torch's)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the engine runs")
    ap.add_argument("--sequential-requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ttft-samples", type=int, default=7)
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="also profile one request of the configured engine (/start_profile, /stop_profile): "
                         "a Chrome trace and op tables in DIR, its time per token and top ops in summary.profile")
    ap.add_argument("--variants", default="all",
                    help="decode modes measured besides the configured one: all (dynamic, static and, on cuda, "
                         "cuda_graph and compiled), none, or a comma list of them")
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
    if args.variants not in ("all", "none") and set(args.variants.split(",")) - set(MODES):
        print(f"error: --variants {args.variants!r}: expected all, none or a comma list of {', '.join(MODES)}",
              file=sys.stderr)
        return 2
    report = {
        "bench": "engine",
        "config": args.config,
        "params": {"device": args.device, "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
                   "concurrency": args.concurrency, "threads": torch.get_num_threads(), "dtype": cfg.engine.dtype},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None},
        "summary": {},
    }

    def save(summary: dict) -> None:
        report["summary"] = summary
        if args.out:
            Path(args.out).write_text(json.dumps(report) + "\n")

    summary = asyncio.run(_bench_modes(cfg, args, save))
    save(summary)
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
        if "profile" in summary:
            prof = summary["profile"]
            print(f"  profiled request: {prof['ms_per_token']:.2f} ms per token over {prof.get('steps')} engine steps; "
                  f"profile in {', '.join(prof['files'])}")
        for name, v in summary["variants"].items():
            if "skipped" in v:
                print(f"  {name:>10}: skipped ({v['skipped']})")
            else:
                print(f"  {name:>10}: {v['tokens_per_s_1']:>8.1f} tokens/s at 1, {v['tokens_per_s_concurrent']:>9.1f} at "
                      f"{args.concurrency}, TTFT {v['ttft_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``moe-rl bench sync [--json]``: bucketed weight sync vs per-tensor and flat broadcasts.

Two processes on this machine, one weight-sync group over gloo (CPU): this process is the
sender (trainer rank 0), a spawned process is the receiver (an engine's ``WeightReceiver``
over its own model, driven over a pipe with SGLang's request fields). Parameter set
(``--shape``): by default a Qwen3-30B-A3B-shaped model shrunk to ~257 MiB (48 layers x 128
experts x 3 projections of 14 KiB: 18,866 tensors). Measured in ``--reps`` rounds, each
method once per round (time until the receiver has acknowledged; best and median reported).
The ratio to (b) is the median over rounds of the ratio within each round: the link's speed
drifts on a shared machine, and a paired ratio cancels that drift.

  (a) per_tensor: one broadcast per tensor, straight into the receiver's parameters;
  (b) flat: one broadcast of a single pre-packed buffer of all the bytes (the link's bound);
  (c) bucketed: ``WeightSender.push`` at each bucket size, including the gather/pack on the
      sender and the receiver's staging + commit (unpack into its parameters);
  (d) with ``--http``: the same push to the embedded engine's HTTP server (SGLang's API:
      JSON requests through aiohttp into the engine's handlers), in a third process.

Sender peak extra memory = the most bytes of buffers the sender had allocated and alive at
once (it tracks every bucket buffer it allocates: the one in flight and the one being packed);
the RSS high-water delta of the sender process over the push is printed too.

On CUDA (``--gpu``, default when a GPU is visible): Triton pack + unpack throughput over the
same tensor set, vs one device-to-device copy of the same bytes and vs a per-tensor copy loop.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
import zlib

import torch

from moe_rl.model import MoEArch, MoEForCausalLM, bind_hf_views, iter_local_hf_tensors

# --shape qwen3-30b-a3b (default): Qwen3-30B-A3B's tensor count (48 layers x 128 experts x 3 =
# 18,432 expert tensors) shrunk to ~270 MB, so each expert tensor is 14 KiB: the many-small-
# tensors regime that makes one broadcast per tensor latency-bound.
# --shape wide: fewer, larger tensors (10 layers x 64 experts of 128 KiB; 2,012 tensors).
SHAPES = {
    "qwen3-30b-a3b": dict(vocab_size=4096, hidden_size=64, moe_intermediate_size=56, intermediate_size=256,
                          num_hidden_layers=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=128, num_experts_per_tok=8, tie_word_embeddings=True),
    "wide": dict(vocab_size=4096, hidden_size=256, moe_intermediate_size=128, intermediate_size=512,
                 num_hidden_layers=10, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 num_experts=64, num_experts_per_tok=4, tie_word_embeddings=True),
}
ARCH = SHAPES["qwen3-30b-a3b"]


def _arch(scale: float, shape: str = "qwen3-30b-a3b") -> MoEArch:
    base = SHAPES[shape]
    layers = max(1, round(base["num_hidden_layers"] * scale))
    return MoEArch(**{**base, "num_hidden_layers": layers})


def _crc(tensors) -> int:
    c = 0
    for t in tensors:
        c = zlib.crc32(memoryview(t.detach().contiguous().view(torch.uint8).numpy()), c)
    return c


# --- receiver process ----------------------------------------------------------------------
def _receiver_main(conn, scale: float, threads: int, bind: bool, shape: str):
    torch.set_num_threads(threads)
    from moe_rl.sync import WeightReceiver
    from moe_rl.sync.local import serve_receiver

    model = MoEForCausalLM(_arch(scale, shape))
    named = dict(iter_local_hf_tensors(model))
    rx = WeightReceiver(named, timeout_s=300,
                        rebind=(lambda staged: bind_hf_views(model, staged)) if bind else None)
    tensors = list(named.values())

    def per_tensor(group_name: str, reps: int):
        g = rx.groups[group_name]
        for _ in range(reps):
            works = [g.broadcast(t) for t in tensors]  # all posted, as SGLang does
            for w in works:
                g.wait_work(w)
            conn.send({"success": True, "ack": True})
        return "done"

    cache = {}

    def flat(group_name: str, numel: int, reps: int):
        g = rx.groups[group_name]
        buf = cache.get(numel)
        if buf is None:  # allocated and touched once, like the sender's pre-packed buffer
            buf = cache[numel] = torch.zeros(numel, dtype=torch.float32)
        for _ in range(reps):
            g.wait_work(g.broadcast(buf))
            conn.send({"success": True, "ack": True})
        return "done"

    serve_receiver(conn, rx, {"per_tensor": per_tensor, "flat": flat, "crc": lambda: _crc(rx.params.values()),
                              "version": lambda: rx.weight_version})


def _http_engine_main(conn, scale: float, threads: int, shape: str):
    """The embedded engine's HTTP server (SGLang's API) over the same parameter set: what a
    sync to a real engine goes through (JSON requests, aiohttp, the engine's handlers)."""
    torch.set_num_threads(threads)
    from moe_rl.config import load_config
    from moe_rl.engine.server import build_engine, start_server
    from moe_rl.gc_control import freeze_gc

    async def serve():
        cfg = load_config(None, [f"engine.threads={threads}"])
        engine = build_engine(cfg, MoEForCausalLM(_arch(scale, shape)))
        freeze_gc()  # as `moe-rl serve` does
        runner, url = await start_server(engine, "127.0.0.1", 0)
        conn.send(url)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
        await runner.cleanup()
        engine.stop()

    asyncio.run(serve())


# --- sender side ---------------------------------------------------------------------------
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _timed_collective(conn, cmd: str, kw: dict, reps: int, body) -> list[float]:
    """Starts ``cmd`` on the receiver, runs ``body()`` reps times, each until the receiver acks."""
    conn.send((cmd, kw))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        body()
        ack = conn.recv()
        if not ack.get("success"):
            raise RuntimeError(ack.get("message"))
        times.append(time.perf_counter() - t0)
    final = conn.recv()
    if not final.get("success"):
        raise RuntimeError(final.get("message"))
    return times


def _senders_per_bucket(model, engine, args, group_name: str, warm) -> dict:
    """One ``WeightSender`` per bucket size, all sharing the first one's weight-sync group;
    ``warm(mb, sender)`` makes each one's first push (the first one's forms the group)."""
    from moe_rl.sync import WeightSender

    senders = {}
    for mb in args.buckets:
        # with binding each sender moves its own copy of the weights into its buckets
        own = copy.deepcopy(model) if args.bind == "on" else model
        s = WeightSender(own, engines=[engine], bucket_mb=mb, timeout_s=300, group_name=group_name,
                         use_triton=False, bind_params=args.bind == "on")
        if senders:
            first = next(iter(senders.values()))
            s.group, s._group_key = first.group, first._group_key
        warm(mb, s)
        senders[mb] = s
    return senders


def _measured_push(run, sender, args, tag: str):
    """The receiver alternates two sets of buckets of the plan in use (with binding, the last
    update's buckets are the live weights); the senders take turns on one receiver, so two
    warm-up pushes bring back the steady state of this plan before the measured one.
    ``run`` runs a coroutine to completion."""
    for w in range(2 if args.bind == "on" else 1):
        run(sender.push(f"{tag}-warm{w}"))
    return run(sender.push(tag))


def _close_senders(senders: dict) -> None:
    for i, sender in enumerate(senders.values()):
        if i:
            sender.group = None  # shared: closed once
        sender.close()


def _timing(times: list[float], total: int, flat: list[float] | None = None) -> dict:
    """Best and median of per-round times; with ``flat``, the median of the per-round ratios."""
    out = {"seconds": min(times), "median_seconds": statistics.median(times), "gbps": total / min(times) / 1e9,
           "median_gbps": total / statistics.median(times) / 1e9, "times": times}
    if flat is not None:
        out["vs_flat_paired"] = statistics.median(tb / t for tb, t in zip(flat, times))
    return out


def run_cpu(args) -> dict:
    from moe_rl.sync.local import LocalEngine

    torch.set_num_threads(args.threads)
    arch = _arch(args.scale, args.shape)
    model = MoEForCausalLM(arch)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.uniform_(-1, 1, generator=g)
    tensors = [t for _, t in iter_local_hf_tensors(model)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    largest = max(t.numel() * t.element_size() for t in tensors)

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(b, args.scale, args.threads, args.bind == "on", args.shape), daemon=True)
    proc.start()
    b.close()
    engine = LocalEngine(a, name="bench-receiver", timeout_s=600)
    results: dict = {"bytes": total, "tensors": len(tensors), "largest_tensor_bytes": largest}
    try:
        # One sender per bucket size, sharing one weight-sync group; the machine may be shared,
        # so every round measures every method once (a, b, then each bucket size: one warm-up
        # push that refills the receiver's buffer pool for that plan, then the measured push).
        first_rss = {}

        def warm(mb, s):
            rss0 = _rss_kib("VmRSS")
            if _reset_hwm():  # the first push allocates the sender's buffers: its RSS high-water delta
                asyncio.run(s.push("warmup"))
                first_rss[mb] = max(0, _rss_kib("VmHWM") - rss0) * 1024
            else:
                asyncio.run(s.push("warmup"))

        senders = _senders_per_bucket(model, engine, args, "bench", warm)
        group = next(iter(senders.values())).group
        flat_buf = torch.cat([t.reshape(-1) for t in tensors])
        http = _HTTPSenders(args, model, ctx) if args.http else None

        def per_tensor():
            works = [group.broadcast(t) for t in tensors]
            for w in works:
                group.wait_work(w)

        t_a, t_b = [], []
        c = {mb: {"t": [], "peak": []} for mb in args.buckets}
        for r in range(args.reps):
            t_a += _timed_collective(a, "per_tensor", {"group_name": "bench", "reps": 1}, 1, per_tensor)
            t_b += _timed_collective(a, "flat", {"group_name": "bench", "numel": flat_buf.numel(), "reps": 1}, 1,
                                     lambda: group.wait_work(group.broadcast(flat_buf)))
            for mb, sender in senders.items():
                st = _measured_push(asyncio.run, sender, args, f"{mb}-{r}")
                c[mb]["t"].append(st.seconds)
                c[mb]["peak"].append(st.peak_extra_bytes)
            if http is not None:
                http.round(r)
        ok = engine.call("crc")["result"] == _crc(tensors)
        bucketed = {}
        for mb, sender in senders.items():
            bucketed[mb] = {
                "buckets": len(sender.plan.buckets), **_timing(c[mb]["t"], total, t_b),
                "peak_extra_mib": max(c[mb]["peak"]) / 2**20,
                "bound_mib": (2 * sender.plan.max_bucket_bytes + largest) / 2**20,
                "rss_hwm_delta_mib": first_rss[mb] / 2**20 if mb in first_rss else None, "bit_identical": ok,
            }
        results["per_tensor"], results["flat"] = _timing(t_a, total), _timing(t_b, total)
        results["bucketed"] = bucketed
        if http is not None:
            results["http"] = {mb: _timing(t, total, t_b) for mb, t in http.times.items()}
        _close_senders(senders)
    finally:
        if http is not None:
            http.close()
        try:
            engine.call("stop")
        except Exception:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return results


class _HTTPSenders:
    """(d): the same sender, one per bucket size, to the embedded engine's HTTP server."""

    def __init__(self, args, model, ctx):
        self.args = args
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_http_engine_main, args=(child, args.scale, args.threads, args.shape),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(300):
            raise RuntimeError("the engine's HTTP server did not start")
        url = self.conn.recv()
        self.loop = asyncio.new_event_loop()  # one loop: the HTTP clients' sessions live in it
        self.times = {mb: [] for mb in args.buckets}
        self.senders = _senders_per_bucket(model, url, args, "bench-http",
                                           lambda mb, s: self.loop.run_until_complete(s.push("warmup")))

    def round(self, r: int) -> None:
        for mb, sender in self.senders.items():
            self.times[mb].append(_measured_push(self.loop.run_until_complete, sender, self.args, f"h{mb}-{r}").seconds)

    def close(self) -> None:
        for sender in self.senders.values():
            self.loop.run_until_complete(sender._close_clients())
        _close_senders(self.senders)
        self.loop.close()
        try:
            self.conn.send("stop")
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def round_trip_identical(pack_plan, unpack_plan, tensors, outs) -> bool:
    """A fresh pack + unpack with the plans the bench timed: the packed buffer must equal a
    plain concatenation of ``tensors`` and every unpacked tensor its original, bit for bit.
    Buffer and outputs start as NaN, so anything a plan leaves out or puts elsewhere shows."""
    flat = torch.full((sum(t.numel() for t in tensors),), float("nan"), dtype=tensors[0].dtype,
                      device=tensors[0].device)
    pack_plan.pack(flat)
    for o in outs:
        o.fill_(float("nan"))
    unpack_plan.unpack(flat)

    def bits(t):
        return t.reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)

    packed_ok = torch.equal(bits(flat), bits(torch.cat([t.reshape(-1) for t in tensors])))
    return packed_ok and all(torch.equal(bits(a), bits(b)) for a, b in zip(outs, tensors))


def run_gpu(args) -> dict:
    """Triton pack/unpack vs a device-to-device copy of the same bytes vs a per-tensor loop."""
    from moe_rl.kernels.bucket_pack import BucketCopy, contiguous_offsets, pack, unpack

    arch = _arch(args.scale, args.shape)
    model = MoEForCausalLM(arch).to("cuda", torch.bfloat16)
    tensors = [t.detach() for _, t in iter_local_hf_tensors(model)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.bfloat16, device="cuda")
    other = torch.empty_like(flat)
    outs = [torch.empty_like(t) for t in tensors]
    offsets = contiguous_offsets(tensors)

    def timeit(fn, inner=5):
        """Median over rounds of the mean of `inner` back-to-back calls (CUDA events: host
        work between launches counts, as it does in a sync)."""
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(max(5, args.reps * 4)):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(inner):
                fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3 / inner)
        return statistics.median(times)

    def loop_pack():
        pos = 0
        for t in tensors:
            flat[pos : pos + t.numel()].copy_(t.reshape(-1))
            pos += t.numel()

    def loop_unpack():
        pos = 0
        for t in outs:
            t.copy_(flat[pos : pos + t.numel()].view(t.shape))
            pos += t.numel()

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pack_plan = BucketCopy(tensors, offsets, torch.bfloat16)
    torch.cuda.synchronize()
    plan_s = time.perf_counter() - t0
    unpack_plan = BucketCopy(outs, offsets, torch.bfloat16)
    res = {
        "d2d_copy": timeit(lambda: other.copy_(flat)),
        "triton_pack": timeit(lambda: pack_plan.pack(flat)),
        "triton_unpack": timeit(lambda: unpack_plan.unpack(flat)),
        # the functional API a sync calls: per-tensor key of the plan cache on the host
        "pack_call": timeit(lambda: pack(tensors, flat, offsets, use_triton=True), inner=1),
        "unpack_call": timeit(lambda: unpack(flat, outs, offsets, use_triton=True), inner=1),
        "loop_pack": timeit(loop_pack, inner=1),
        "loop_unpack": timeit(loop_unpack, inner=1),
    }
    identical = round_trip_identical(pack_plan, unpack_plan, tensors, outs)
    # chunk size per program: the default against smaller and larger ones
    chunks = {}
    for cb in (4096, 16384, 65536):
        p = BucketCopy(tensors, offsets, torch.bfloat16, chunk_bytes=cb)
        chunks[cb] = total / timeit(lambda: p.pack(flat)) / 1e9
    # d2d copy reads and writes the bytes once, like pack or unpack: compare bandwidths directly
    out = {k + "_gbps": total / v / 1e9 for k, v in res.items()}
    out["chunk_bytes_pack_gbps"] = chunks
    out["plan_build_s"] = plan_s
    out["vec_bytes"] = pack_plan.align
    out["bytes"] = total
    out["tensors"] = len(tensors)
    out["bit_identical"] = identical
    out["pack_vs_d2d"] = res["d2d_copy"] / res["triton_pack"]
    out["unpack_vs_d2d"] = res["d2d_copy"] / res["triton_unpack"]
    out["gpu"] = torch.cuda.get_device_name()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moe-rl bench sync", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--buckets", type=float, nargs="+", default=[16, 64, 256], help="bucket sizes in MiB")
    ap.add_argument("--reps", type=int, default=7, help="rounds; each measures every method once")
    ap.add_argument("--scale", type=float, default=1.0, help="scales the number of layers (size)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--http", action="store_true",
                    help="also (d): the sender to the embedded engine's HTTP server (SGLang's API, JSON requests)")
    ap.add_argument("--gpu", choices=["auto", "on", "off", "only"], default="auto",
                    help="the Triton pack/unpack figures on CUDA ('only': without the gloo part)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b",
                    help="parameter set (see SHAPES): many 14 KiB experts, or fewer 128 KiB ones")
    ap.add_argument("--bind", choices=["on", "off"], default="on",
                    help="(c) with parameters living in the buckets on both sides (sync.bind_params; the engine "
                         "commits by swapping storage), or packed and copied every sync")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="only the LoRA row: full vs adapter-only sync at this rank (moe_rl.bench.sync_lora)")
    ap.add_argument("--lora-layers", type=int, default=1, help="layers of the Qwen3-30B-A3B-width set for --lora")
    ap.add_argument("--lora-shared-outer", action="store_true",
                    help="--lora with lora.experts_shared_outer (one gate_up A and one down B per layer)")
    args = ap.parse_args(argv)

    if args.lora:
        from .sync_lora import print_lora, run_lora

        res = run_lora(args.lora, args.lora_layers, args.reps, max(args.buckets), args.lora_shared_outer)
        print(json.dumps(res) if args.json else print_lora(res))
        return 0
    gpu = None
    if args.gpu in ("on", "only") or (args.gpu == "auto" and torch.cuda.is_available()):
        gpu = run_gpu(args)
    if args.gpu == "only":  # the kernel figures alone (the gloo part is a CPU benchmark)
        print(json.dumps({"gpu": gpu}, default=str) if args.json else json.dumps(gpu, indent=1, default=str))
        return 0
    cpu = run_cpu(args)
    best_mb = max(cpu["bucketed"], key=lambda mb: cpu["bucketed"][mb]["vs_flat_paired"])
    best = cpu["bucketed"][best_mb]
    summary = {
        "per_tensor_gbps": round(cpu["per_tensor"]["gbps"], 3),
        "flat_gbps": round(cpu["flat"]["gbps"], 3),
        "bucketed_gbps": round(best["gbps"], 3),
        "best_bucket_mb": best_mb,
        "peak_extra_mib": round(best["peak_extra_mib"], 1),
        "device": "cpu (gloo, 2 processes)" + (f"; gpu kernels on {gpu['gpu']}" if gpu else ""),
        "vs_flat": round(best["vs_flat_paired"], 3),  # median of the per-round ratios
        "vs_flat_best": round(best["gbps"] / cpu["flat"]["gbps"], 3),  # best round against best round
        "vs_per_tensor": round(best["gbps"] / cpu["per_tensor"]["gbps"], 2),
        "peak_bound_mib": round(best["bound_mib"], 1),
    }
    if "http" in cpu:
        hb = max(cpu["http"], key=lambda mb: cpu["http"][mb]["vs_flat_paired"])
        summary.update(http_gbps=round(cpu["http"][hb]["gbps"], 3), http_best_bucket_mb=hb,
                       http_vs_flat=round(cpu["http"][hb]["vs_flat_paired"], 3))
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
               "threads_per_process": args.threads}
    if args.json:
        print(json.dumps({"summary": summary, "cpu": cpu, "gpu": gpu, "machine": machine}, default=str))
        return 0
    mib = cpu["bytes"] / 2**20
    print(f"weight sync over gloo, 2 processes: {mib:.0f} MiB in {cpu['tensors']} tensors (largest "
          f"{cpu['largest_tensor_bytes'] / 2**20:.1f} MiB), {args.reps} rounds, best (median)")
    print(f"{'method':<26}{'seconds':>9}{'GB/s':>8}{'(median)':>9}{'peak extra MiB':>16}{'bound':>8}{'RSS dHWM':>10}")
    for key, label in (("per_tensor", "(a) per-tensor broadcast"), ("flat", "(b) one flat broadcast")):
        r = cpu[key]
        print(f"{label:<26}{r['seconds']:>9.3f}{r['gbps']:>8.2f}{r['median_gbps']:>9.2f}")
    for mb, r in cpu["bucketed"].items():
        rss = f"{r['rss_hwm_delta_mib']:.0f}" if r["rss_hwm_delta_mib"] is not None else "-"
        label = f"(c) sender {mb:g} MiB x{r['buckets']}"
        print(f"{label:<26}{r['seconds']:>9.3f}{r['gbps']:>8.2f}{r['median_gbps']:>9.2f}{r['peak_extra_mib']:>16.1f}"
              f"{r['bound_mib']:>8.0f}{rss:>10}" + ("" if r["bit_identical"] else "  NOT IDENTICAL"))
    for mb, r in cpu.get("http", {}).items():
        label = f"(d) HTTP engine {mb:g} MiB"
        print(f"{label:<26}{r['seconds']:>9.3f}{r['gbps']:>8.2f}{r['median_gbps']:>9.2f}")
    if "http" in cpu:
        print(f"(d) best bucket {summary['http_best_bucket_mb']:g} MiB: {summary['http_vs_flat']:.2f}x flat "
              f"(median of the per-round ratios)")
    print(f"best bucket {best_mb:g} MiB: {summary['vs_flat']:.2f}x flat (median of the per-round ratios; "
          f"best against best {summary['vs_flat_best']:.2f}x), {summary['vs_per_tensor']:.1f}x per-tensor")
    if gpu:
        print(f"GPU {gpu['gpu']}: {gpu['bytes'] / 2**20:.0f} MiB bf16 in {gpu['tensors']} tensors")
        for k in ("d2d_copy", "triton_pack", "triton_unpack", "pack_call", "unpack_call", "loop_pack", "loop_unpack"):
            print(f"  {k:<14}{gpu[k + '_gbps']:>8.1f} GB/s")
        print(f"  pack {gpu['pack_vs_d2d']:.2f}x, unpack {gpu['unpack_vs_d2d']:.2f}x the d2d copy; "
              f"{gpu['vec_bytes']}-byte accesses; plan built in {gpu['plan_build_s'] * 1e3:.0f} ms; "
              f"bit-identical: {gpu['bit_identical']}")
        print("  pack GB/s by chunk bytes: " + ", ".join(f"{k}: {v:.0f}" for k, v in gpu["chunk_bytes_pack_gbps"].items()))
    return 0

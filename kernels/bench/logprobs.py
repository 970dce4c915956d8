"""Microbenchmark: fused LM-head log-probs + entropy against materialising baselines.

    moe-rl bench logprobs [--json] [--shapes N,H,V;...] [--dtype bf16|fp32] [--no-compile]
    python -m moe_rl.kernels.bench.logprobs ...        python kernels/bench/logprobs.py ...

Providers, each measured in the same run, forward ("fwd") and forward+backward ("fwd_bwd"):

* ``fused``: ``moe_rl.kernels.fused_logprobs(..., return_entropy=True)`` (Triton on CUDA,
  the chunked torch implementation on CPU).
* ``eager``: ``hidden @ weight.T`` materialised, ``.float() / T``, ``log_softmax``, gather and
  entropy; ``compile``: ``torch.compile`` of the same function.
* ``gemm``: the bare LM-head GEMM ``hidden @ weight.T`` (fwd) and the three GEMMs of its
  forward+backward (``x W^T``, ``g W``, ``g^T x``; fwd_bwd). The practical roofline.
* ``liger``: Liger-Kernel's fused linear cross-entropy, when importable on CUDA (it computes
  the NLL only, no entropy).

Per row: median ms (p20/p80), peak extra memory over inputs and outputs (MiB) and effective
TFLOP/s, counting 2NHV for a forward and 8NHV (2NHV forward + 6NHV backward) for a
forward+backward for every provider, so the column is a normalised inverse time.

Timing: ``triton.testing.do_bench`` on CUDA; on CPU the median of ``--reps`` runs timed with
``time.perf_counter``. Memory: on CUDA ``torch.cuda.max_memory_allocated`` minus what was
allocated before the call, minus the bytes of the returned outputs (log-probs, entropy, or the
gradients). On CPU there is no allocator peak counter: the figure is the peak of the running
sum of the individual CPU allocations and frees (c10 allocator) that ``torch.profiler``
records with ``profile_memory=True``, in time order, minus the outputs; memory that bypasses
the c10 allocator (oneDNN/BLAS internal workspaces, Python objects) is not seen.

Accuracy (unless ``--no-accuracy``), at every shape: the fused log-probs, entropy and both
gradients against an fp64 reference (row-chunked, so it fits next to the 150k vocabulary),
with the test suite's tolerances; ``accuracy_ok`` per shape and in the summary. ``--profile DIR``
writes torch.profiler op tables, Chrome traces and a per-kernel breakdown (``profile.json``) of
one fused forward and one forward+backward at the largest shape.

``--json`` prints one object: ``{"device", "software", "rows": [...], "summary": {...}}``,
the summary for the largest shape run: ``fwd_vs_gemm`` (fused fwd / bare GEMM fwd),
``fwd_bwd_vs_gemm`` (fused fwd+bwd / three GEMMs), ``extra_mem_fraction`` (the larger of the
fused fwd and fwd+bwd extra memory / materialised fp32 logits ``N*V*4`` bytes), ``device``.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time

import torch

from moe_rl.kernels.fused_logprobs import fused_logprobs

GPU_SHAPES = [(4096, 4096, 151936), (8192, 4096, 151936)]
CPU_SHAPES = [(256, 256, 8192), (1024, 512, 32000)]
TARGETS = {"fwd_vs_gemm": 1.15, "fwd_bwd_vs_gemm": 1.35, "extra_mem_fraction": 0.01}


def _parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for part in text.split(";"):
        if part.strip():
            n, h, v = (int(x) for x in part.split(","))
            shapes.append((n, h, v))
    return shapes


def eager_logprobs(hidden, weight, labels, temperature: float):
    """The materialising baseline: full logits, fp32 log_softmax, gather, entropy."""
    logits = (hidden @ weight.T).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    logp = logp_all.gather(1, labels[:, None])[:, 0]
    return logp, ent


# ----------------------------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, device, reps: int) -> tuple[float, float, float]:
    if device.type == "cuda":
        import triton.testing

        med, p20, p80 = triton.testing.do_bench(fn, warmup=100, rep=500,
                                                quantiles=[0.5, 0.2, 0.8])
        return float(med), float(p20), float(p80)
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    if len(times) >= 2:
        q = statistics.quantiles(times, n=5, method="inclusive")
    else:
        q = [times[0]] * 4
    return statistics.median(times), q[0], q[3]


def _nbytes(out) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(_nbytes(o) for o in out)
    return 0


def _cpu_peak_bytes(fn):
    """Peak of the running sum of the CPU allocations and frees torch.profiler records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak, out


def _extra_mib(fn, device) -> float:
    """Peak memory of one call over what existed before it, minus its outputs, in MiB."""
    gc.collect()
    if device.type == "cuda":
        _sync(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        _sync(device)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak, out = _cpu_peak_bytes(fn)
    extra = peak - _nbytes(out)
    del out
    return max(extra, 0) / 2**20


def _providers(hidden, weight, labels, temperature, device, use_compile, use_liger):
    """name -> (fwd fn, fwd_bwd fn); each returns its outputs (for the memory accounting)."""
    n, v = hidden.shape[0], weight.shape[0]
    hg = hidden.detach().requires_grad_()
    wg = weight.detach().requires_grad_()
    g_logp = torch.randn(n, device=device)
    g_ent = torch.randn(n, device=device)

    def fwd_bwd_of(f):
        def run():
            logp, ent = f(hg, wg, labels, temperature)
            return torch.autograd.grad((g_logp * logp).sum() + (g_ent * ent).sum(), [hg, wg])
        return run

    def fused(h, w, y, t):
        return fused_logprobs(h, w, y, t, return_entropy=True)

    provs = {
        "fused": (lambda: fused(hidden, weight, labels, temperature), fwd_bwd_of(fused)),
        "eager": (lambda: eager_logprobs(hidden, weight, labels, temperature),
                  fwd_bwd_of(eager_logprobs)),
    }
    if use_compile:
        compiled = torch.compile(eager_logprobs, dynamic=False)
        provs["compile"] = (lambda: compiled(hidden, weight, labels, temperature),
                            fwd_bwd_of(compiled))

    g_logits = torch.randn(n, v, device=device, dtype=hidden.dtype)  # an input of the 3 GEMMs

    def gemm_fwd_bwd():
        logits = hidden @ weight.T
        del logits
        return g_logits @ weight, g_logits.T @ hidden

    provs["gemm"] = (lambda: hidden @ weight.T, gemm_fwd_bwd)

    if use_liger and device.type == "cuda":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

            def liger_fwd():
                return loss_fn(weight, hidden, labels)

            def liger_fwd_bwd():
                return torch.autograd.grad(loss_fn(wg, hg, labels), [hg, wg])

            provs["liger"] = (liger_fwd, liger_fwd_bwd)
        except Exception as exc:  # not installed, or an API this version lacks
            provs["liger"] = (exc, exc)
    return provs


def bench_shape(n, h, v, dtype, temperature, device, reps, use_compile, use_liger,
                accuracy=True):
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device=device, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=gen).to(device)
    flops = {"fwd": 2 * n * h * v, "fwd_bwd": 8 * n * h * v}
    rows = []
    for name, fns in _providers(hidden, weight, labels, temperature, device, use_compile,
                                use_liger).items():
        for pas, fn in zip(("fwd", "fwd_bwd"), fns):
            row = {"shape": [n, h, v], "dtype": str(dtype).replace("torch.", ""),
                   "temperature": temperature, "provider": name, "pass": pas}
            if isinstance(fn, Exception):
                row["error"] = f"{type(fn).__name__}: {fn}"[:300]
                rows.append(row)
                continue
            try:
                ms, p20, p80 = _time_ms(fn, device, reps)
                row.update(ms=round(ms, 4), ms_p20=round(p20, 4), ms_p80=round(p80, 4),
                           extra_mib=round(_extra_mib(fn, device), 3),
                           tflops=round(flops[pas] / (ms * 1e-3) / 1e12, 3))
            except Exception as exc:  # one failing baseline must not sink the whole run
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if accuracy:
        acc = check_accuracy(hidden, weight, labels, temperature)
        for row in rows:
            if row["provider"] == "fused" and row["pass"] == "fwd":
                row.update(acc)
    return rows


# ----------------------------------------------------------------------------------------------
# accuracy against an fp64 reference
# ----------------------------------------------------------------------------------------------
# dtype -> (log-prob max abs error, entropy max abs error, gradient relative L2 error); the same
# bounds as tests/kernels/test_fused_logprobs.py
TOLERANCES = {torch.float32: (1e-5, 1e-5, 1e-5), torch.bfloat16: (2e-3, 5e-3, 1e-2)}


def fp64_reference(hidden, weight, labels, temperature, g_logp, g_ent, rows_per_chunk=1024):
    """Exact-ish log-probs, entropy and the gradients of sum(g_logp*logp + g_ent*ent) w.r.t.
    hidden and weight, in fp64, materialising at most ``rows_per_chunk`` rows of logits."""
    w64 = weight.detach().double().requires_grad_()
    logp, ent, d_hidden = [], [], []
    for lo in range(0, hidden.shape[0], rows_per_chunk):
        h64 = hidden[lo:lo + rows_per_chunk].detach().double().requires_grad_()
        y = labels[lo:lo + rows_per_chunk]
        z = (h64 @ w64.T) / temperature
        lp_all = torch.log_softmax(z, dim=-1)
        del z
        e = -(lp_all.exp() * lp_all).sum(-1)
        lp = lp_all.gather(1, y.clamp(min=0)[:, None])[:, 0]
        keep = y != -100
        lp, e = torch.where(keep, lp, 0.0), torch.where(keep, e, 0.0)
        ((g_logp[lo:lo + rows_per_chunk].double() * lp).sum() +
         (g_ent[lo:lo + rows_per_chunk].double() * e).sum()).backward()
        del lp_all
        logp.append(lp.detach())
        ent.append(e.detach())
        d_hidden.append(h64.grad)
    return torch.cat(logp), torch.cat(ent), torch.cat(d_hidden), w64.grad


def accuracy_report(ref, got, dtype) -> dict:
    """Errors of ``got`` = (logp, entropy, d_hidden, d_weight) against ``ref`` (fp64), and
    whether each is within the tolerance for the input dtype."""
    def rel(a, b):
        return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))

    tol_lp, tol_ent, tol_grad = TOLERANCES[dtype]
    out = {
        "max_abs_err_logp": float((got[0].double() - ref[0]).abs().max()),
        "max_abs_err_entropy": float((got[1].double() - ref[1]).abs().max()),
        "rel_err_d_hidden": rel(got[2], ref[2]),
        "rel_err_d_weight": rel(got[3], ref[3]),
    }
    out["accuracy_ok"] = bool(out["max_abs_err_logp"] <= tol_lp and
                              out["max_abs_err_entropy"] <= tol_ent and
                              out["rel_err_d_hidden"] <= tol_grad and
                              out["rel_err_d_weight"] <= tol_grad)
    return out


def check_accuracy(hidden, weight, labels, temperature) -> dict:
    """The fused op's outputs and gradients against the fp64 reference."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    g_logp = torch.randn(hidden.shape[0], generator=gen).to(hidden.device)
    g_ent = torch.randn(hidden.shape[0], generator=gen).to(hidden.device)
    hg = hidden.detach().clone().requires_grad_()
    wg = weight.detach().clone().requires_grad_()
    logp, ent = fused_logprobs(hg, wg, labels, temperature, return_entropy=True)
    d_hidden, d_weight = torch.autograd.grad((g_logp * logp).sum() + (g_ent * ent).sum(),
                                             [hg, wg])
    got = (logp.detach(), ent.detach(), d_hidden, d_weight)
    del hg, wg
    ref = fp64_reference(hidden, weight, labels, temperature, g_logp, g_ent)
    return accuracy_report(ref, got, hidden.dtype)


# ----------------------------------------------------------------------------------------------
# profile: where a fused call's time goes
# ----------------------------------------------------------------------------------------------
def profile_fused(n, h, v, dtype, temperature, device, out_dir) -> dict:
    """One fused forward and one forward+backward under torch.profiler. Writes the op table
    (sorted by device time on CUDA, CPU time otherwise), a Chrome trace per pass and
    ``profile.json``: per pass, every kernel/op with its call count and total time."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device=device, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=gen).to(device)
    fwd, fwd_bwd = _providers(hidden, weight, labels, temperature, device, False, False)["fused"]
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    summary = {"shape": [n, h, v], "dtype": str(dtype).replace("torch.", ""),
               "temperature": temperature, "device": _device_name(device), "passes": {}}
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        fn()  # compile / autotune outside the trace
        _sync(device)
        with profile(activities=activities) as prof:
            fn()
            _sync(device)
        (out / f"{name}_table.txt").write_text(
            prof.key_averages().table(sort_by=sort_by, row_limit=40))
        prof.export_chrome_trace(str(out / f"{name}_trace.json"))
        ops = []
        for e in prof.key_averages():
            dev_us = getattr(e, "self_device_time_total", None)
            if dev_us is None:
                dev_us = getattr(e, "self_cuda_time_total", 0.0)
            ops.append({"name": e.key, "count": e.count, "self_cpu_us": e.self_cpu_time_total,
                        "self_device_us": dev_us})
        key = "self_device_us" if cuda else "self_cpu_us"
        ops.sort(key=lambda o: o[key], reverse=True)
        summary["passes"][name] = {"total_ms": sum(o[key] for o in ops) / 1e3,
                                   "launches": sum(o["count"] for o in ops
                                                   if cuda and o["self_device_us"] > 0),
                                   "top": ops[:25]}
    (out / "profile.json").write_text(json.dumps(summary, indent=1))
    return summary


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu: {cpu}, {torch.get_num_threads()} torch threads"


def _summary(rows, device):
    ok = [r for r in rows if "ms" in r]
    if not ok:
        return {"device": _device_name(device)}
    big = max((tuple(r["shape"]) for r in ok), key=lambda s: s[0] * s[1] * s[2])
    get = {(r["provider"], r["pass"]): r for r in ok if tuple(r["shape"]) == big}
    n, _, v = big
    out = {"shape": list(big), "device": _device_name(device)}
    fused_f, fused_fb = get.get(("fused", "fwd")), get.get(("fused", "fwd_bwd"))
    gemm_f, gemm_fb = get.get(("gemm", "fwd")), get.get(("gemm", "fwd_bwd"))
    if fused_f and gemm_f:
        out["fwd_vs_gemm"] = round(fused_f["ms"] / gemm_f["ms"], 4)
    if fused_fb and gemm_fb:
        out["fwd_bwd_vs_gemm"] = round(fused_fb["ms"] / gemm_fb["ms"], 4)
    if fused_f and fused_fb:
        logits = n * v * 4 / 2**20
        out["extra_mem_fraction"] = round(max(fused_f["extra_mib"], fused_fb["extra_mib"]) /
                                          logits, 6)
        out["extra_mem_fraction_fwd"] = round(fused_f["extra_mib"] / logits, 6)
        out["materialised_fp32_logits_mib"] = round(logits, 3)
    for pas in ("fwd", "fwd_bwd"):
        fused = get.get(("fused", pas))
        others = {p: r["ms"] for (p, q), r in get.items() if q == pas and p in
                  ("eager", "compile", "liger")}
        if fused and others:
            out[f"{pas}_faster_than"] = sorted(p for p, ms in others.items() if fused["ms"] < ms)
    checked = [r["accuracy_ok"] for r in rows if "accuracy_ok" in r]
    if checked:  # every benchmarked shape, not only the largest
        out["accuracy_ok"] = all(checked)
    out["targets"] = TARGETS
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-rl bench logprobs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--shapes", help="N,H,V;N,H,V (default: GPU %s, CPU %s)"
                        % (GPU_SHAPES, CPU_SHAPES))
    parser.add_argument("--dtype", choices=["bf16", "fp32"],
                        help="input dtype (default bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--reps", type=int, default=5, help="CPU repetitions (median)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default 1 on CPU: steadier on a shared "
                             "machine; unchanged on CUDA)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    parser.add_argument("--no-liger", action="store_true", help="skip the Liger row")
    parser.add_argument("--no-accuracy", action="store_true",
                        help="skip the fp64 accuracy check of the fused outputs and gradients")
    parser.add_argument("--profile", metavar="DIR",
                        help="also profile one fused fwd and fwd+bwd at the largest shape with "
                             "torch.profiler: op tables, Chrome traces and profile.json in DIR")
    args = parser.parse_args(argv)

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            print("moe-rl bench logprobs: --device cuda but CUDA is not available",
                  file=sys.stderr)
            return 2
    gpu = device.type == "cuda"
    if args.threads or not gpu:
        torch.set_num_threads(args.threads or 1)
    shapes = _parse_shapes(args.shapes) if args.shapes else (GPU_SHAPES if gpu else CPU_SHAPES)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or
                                                             ("bf16" if gpu else "fp32")]
    rows = []
    for n, h, v in shapes:
        rows += bench_shape(n, h, v, dtype, args.temperature, device, args.reps,
                            not args.no_compile, not args.no_liger, not args.no_accuracy)
        if not args.json:
            print(f"done {n}x{h}x{v}", file=sys.stderr)
    if args.profile:
        big = max(shapes, key=lambda s: s[0] * s[1] * s[2])
        prof = profile_fused(*big, dtype, args.temperature, device, args.profile)
        if not args.json:
            for name, p in prof["passes"].items():
                print(f"profile {name}: {p['total_ms']:.2f} ms, top: " +
                      ", ".join(f"{o['name']} x{o['count']}" for o in p["top"][:5]),
                      file=sys.stderr)
    result = {
        "device": _device_name(device),
        "software": {"torch": torch.__version__, "python": platform.python_version(),
                     "triton": _triton_version()},
        "rows": rows,
        "summary": _summary(rows, device),
    }
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return 0


def _triton_version():
    try:
        import triton

        return triton.__version__
    except Exception:
        return None


def _print_table(result):
    print(f"device: {result['device']}  software: {result['software']}")
    hdr = f"{'shape':>22} {'dtype':>8} {'provider':>8} {'pass':>8} {'ms':>10} " \
          f"{'p20':>10} {'p80':>10} {'extra MiB':>10} {'TFLOP/s':>8}"
    print(hdr)
    for r in result["rows"]:
        shape = "x".join(map(str, r["shape"]))
        if "error" in r:
            print(f"{shape:>22} {r['dtype']:>8} {r['provider']:>8} {r['pass']:>8}  "
                  f"error: {r['error']}")
            continue
        print(f"{shape:>22} {r['dtype']:>8} {r['provider']:>8} {r['pass']:>8} {r['ms']:>10.3f} "
              f"{r['ms_p20']:>10.3f} {r['ms_p80']:>10.3f} {r['extra_mib']:>10.2f} "
              f"{r['tflops']:>8.3f}")
    print("summary:", json.dumps(result["summary"]))


if __name__ == "__main__":
    sys.exit(main())

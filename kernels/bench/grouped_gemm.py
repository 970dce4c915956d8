"""Microbenchmark: the grouped GEMM's tiles for small groups (``moe_rl.kernels.grouped_gemm``'s
``SMALL_GROUP_BLOCKS``), at the expert shapes of a decode step.

    moe-rl bench grouped-gemm [--json] [--dtypes fp32,bf16] [--rows 4,256] [--device cuda|cpu]
    python -m moe_rl.kernels.bench.grouped_gemm ...

A decode step sends each token through its top-k experts: ``rows`` = tokens x k rows spread over
the experts (4 rows: one request, top-4; 256: 64 requests), with the medium preset's widths by
default (32 experts, hidden 1024, expert width 512). Each case times the three expert GEMMs of a
layer (gate and up: N = width, K = hidden; down: N = hidden, K = width) for every candidate
``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` of a 16-row tile, and, for comparison, the tiles
groups of more than 16 rows take (``large_tiles``: the training shapes' tiles) and
``torch._grouped_mm`` where it runs (bf16 on sm_90+). The weights of ``--layers`` layers are
cycled so that, as in a real step, the experts' weights come from memory, not from L2: on CUDA
one CUDA graph holds a call per layer (no launch cost in the figure); ``us`` is per call, and
``gbps`` the chosen experts' weight bytes over it.

Accuracy: every candidate's output against ``grouped_gemm_reference`` in fp32 (relative max error
1e-4 for fp32 IEEE dots, 2e-2 for bf16); a candidate that fails is reported and never chosen. The
check checks itself once per run (``accuracy_check_can_fail``): the best candidate run with its
groups' ends moved by one row must fail it.

The summary, per dtype: ``best`` (the candidate with the least total time over the cases),
``current`` (the tiles the kernel takes now: this GPU's tuned-tiles file or the defaults) and
``large_tiles`` totals in us, and
``best_vs_large_tiles`` (< 1: faster). On CPU (``TRITON_INTERPRET=1`` only: the interpreter) the
sizes are tiny and the times say nothing about a GPU; the run checks the candidates' accuracy.
Exit 1 when an accuracy check fails for every candidate or cannot fail.

``--save PATH`` writes the best tiles per dtype as the kernel reads them (``{"float32": [BLOCK_N,
BLOCK_K, num_warps, num_stages], ...}``); copied to ``moe_rl/kernels/configs/`` under the GPU
model's name (``saved.ship_as``) it becomes that GPU's default, and ``$MOE_RL_GROUPED_GEMM_CONFIG``
points a run at any such file.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from moe_rl.kernels import grouped_gemm as gg
from moe_rl.kernels.bench.logprobs import _device_name, _triton_version

GPU_DIMS = dict(experts=32, hidden=1024, width=512, top_k=4, layers=16)
CPU_DIMS = dict(experts=4, hidden=64, width=32, top_k=2, layers=2)
# 12 candidates (each a Triton build of its own on a cold machine: ~1 s), the default among them
GPU_CANDIDATES = [(bn, bk, 4, s) for bn in (32, 64) for bk in (64, 128, 256) for s in (3, 4)]
CPU_CANDIDATES = [(32, 16, 1, 1), (16, 32, 1, 1)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def decode_offs(rows: int, experts: int, top_k: int, gen: torch.Generator, device) -> torch.Tensor:
    """Group ends (int32) of ``rows // top_k`` tokens, each routed to ``top_k`` distinct experts."""
    tokens = max(rows // top_k, 1)
    chosen = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k]
    counts = torch.bincount(chosen.reshape(-1), minlength=experts)
    return counts.cumsum(0).to(torch.int32).to(device)


def _timer(calls, device, reps: int) -> float:
    """Median microseconds per call of ``calls`` (a list of thunks, one per layer)."""
    if device.type == "cuda":
        for c in calls:  # compile and warm up outside the capture
            c()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(max(reps, 5)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / (10 * len(calls)))
        return statistics.median(times)
    for c in calls:
        c()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for c in calls:
            c()
        times.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return statistics.median(times)


def _error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> float:
    want = gg.grouped_gemm_reference(x.float(), w.float(), offs)
    return float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def bench_dtype(dtype, dims, rows_list, candidates, device, reps, gen, progress=None) -> list[dict]:
    """One row per (provider, case): provider "candidate" (with its tiles), "large_tiles", "torch".
    ``progress(rows)``, if given, gets the rows so far after each rows case."""
    E, H, F, L = dims["experts"], dims["hidden"], dims["width"], dims["layers"]
    shapes = {"gate_up": (F, H), "down": (H, F)}  # name -> (N, K); gate and up share one shape
    weights = {name: [(torch.randn(E, n, k, generator=gen) / k ** 0.5).to(device, dtype) for _ in range(L)]
               for name, (n, k) in shapes.items()}
    large = gg.large_group_blocks(dtype, 64)  # the training shapes' tiles (64 rows or more per expert)
    providers = [("candidate", (16, *c)) for c in candidates] + [("large_tiles", large)]
    if device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0):
        providers.append(("torch", None))
    out = []
    for rows in rows_list:
        offs = decode_offs(rows, E, dims["top_k"], gen, device)
        x = {name: torch.randn(rows, k, generator=gen).to(device, dtype) for name, (n, k) in shapes.items()}
        used = int((torch.diff(offs.cpu(), prepend=offs.new_zeros(1).cpu()) > 0).sum())
        for provider, blocks in providers:
            for name, (n, k) in shapes.items():
                if provider == "torch":
                    run = [lambda w=w, xx=x[name]: torch._grouped_mm(xx, w.transpose(-2, -1), offs=offs) for w in weights[name]]
                else:
                    run = [lambda w=w, xx=x[name], b=blocks: gg._gmm_triton(xx, w, offs, blocks=b) for w in weights[name]]
                row = {"dtype": str(dtype).removeprefix("torch."), "rows": rows, "gemm": name, "N": n, "K": k,
                       "provider": provider, "blocks": list(blocks) if blocks else None}
                try:
                    err = _error(run[0](), x[name], weights[name][0], offs)
                    us = _timer(run, device, reps)
                except Exception as exc:  # e.g. a tile over the shared memory: that candidate only
                    row.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                    out.append(row)
                    continue
                bytes_moved = used * n * k * weights[name][0].element_size()
                row.update(us=round(us, 3), gbps=round(bytes_moved / us / 1e3, 1), max_rel_err=err,
                           accurate=err <= TOL[dtype], calls_per_layer=2 if name == "gate_up" else 1)
                out.append(row)
        if progress is not None:
            progress(out)
    return out


def summarise(rows: list[dict], dtype: torch.dtype, device: torch.device | None = None) -> dict:
    """Totals per provider/tiles over the cases (gate and up count twice: two calls a layer);
    ``current``: the tiles the kernel takes now on ``device``."""
    name = str(dtype).removeprefix("torch.")
    mine = [r for r in rows if r["dtype"] == name]
    cases = {(r["rows"], r["gemm"]) for r in mine}
    totals: dict[tuple, float] = {}
    for key in {(r["provider"], tuple(r["blocks"] or ())) for r in mine}:
        rs = [r for r in mine if (r["provider"], tuple(r["blocks"] or ())) == key]
        if len(rs) == len(cases) and all(r.get("accurate") for r in rs):
            totals[key] = sum(r["us"] * r["calls_per_layer"] for r in rs)
    cands = {k: v for k, v in totals.items() if k[0] == "candidate"}
    best = min(cands, key=cands.get) if cands else None
    current = ("candidate", gg._blocks(dtype, 1, 1, device)) if not gg.TRITON_INTERPRET else \
        ("candidate", (16, *gg.SMALL_GROUP_BLOCKS[dtype]))
    large = next((k for k in totals if k[0] == "large_tiles"), None)
    s = {"best": list(best[1]) if best else None, "best_us": cands.get(best),
         "current": list(current[1]), "current_us": totals.get(current),
         "large_tiles_us": totals.get(large) if large else None,
         "torch_us": totals.get(("torch", ())), "candidates_accurate": len(cands)}
    if best and large:
        s["best_vs_large_tiles"] = round(cands[best] / totals[large], 4)
    return s


def check_can_fail(dtype, dims, device, blocks, gen) -> bool:
    """The accuracy check on a known-bad call: the group ends moved one row down."""
    E, H, F = dims["experts"], dims["hidden"], dims["width"]
    offs = decode_offs(4 * dims["top_k"], E, dims["top_k"], gen, device)
    w = (torch.randn(E, F, H, generator=gen) / H ** 0.5).to(device, dtype)
    x = torch.randn(int(offs[-1]), H, generator=gen).to(device, dtype)
    bad = (offs - 1).clamp(min=0)
    bad[-1] = offs[-1]
    return _error(gg._gmm_triton(x, w, bad, blocks=blocks), x, w, offs) > TOL[dtype]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moe-rl bench grouped-gemm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", help="also write the JSON object to this file")
    ap.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, of {sorted(DTYPES)}")
    ap.add_argument("--rows", help="rows per call, comma-separated (default 4,256 on CUDA, 4,16 on CPU)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--reps", type=int, default=5, help="timing repetitions (median)")
    ap.add_argument("--save", metavar="PATH",
                    help="write the best tiles per dtype as a tuned-tiles file (the kernel reads this GPU "
                         "model's from moe_rl/kernels/configs/, or the one $%s names)" % gg.CONFIG_ENV)
    a = ap.parse_args(argv)
    device = torch.device(a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("moe-rl bench grouped-gemm: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if gg.triton is None or (device.type == "cpu" and not gg.TRITON_INTERPRET):
        print("moe-rl bench grouped-gemm: needs Triton, and on a CPU TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    try:
        dtypes = [DTYPES[d.strip()] for d in a.dtypes.split(",") if d.strip()]
        rows_list = [int(r) for r in (a.rows or ("4,256" if device.type == "cuda" else "4,16")).split(",")]
    except (KeyError, ValueError) as exc:
        print(f"moe-rl bench grouped-gemm: bad --dtypes or --rows ({exc})", file=sys.stderr)
        return 2
    dims = GPU_DIMS if device.type == "cuda" else CPU_DIMS
    candidates = GPU_CANDIDATES if device.type == "cuda" else CPU_CANDIDATES
    gen = torch.Generator().manual_seed(0)
    result = {"device": _device_name(device), "dims": dims,
              "software": {"torch": torch.__version__, "python": platform.python_version(),
                           "triton": _triton_version(), "triton_interpret": gg.TRITON_INTERPRET},
              "rows": [], "summary": {}}
    ok = True

    def save(rows: list[dict] = (), **extra) -> None:  # after each case: a run cut by a time cap keeps them
        if a.out:
            with open(a.out, "w") as f:
                json.dump({**result, "rows": result["rows"] + list(rows), **extra}, f)

    for dtype in dtypes:
        result["rows"] += bench_dtype(dtype, dims, rows_list, candidates, device, a.reps, gen,
                                      lambda rows: save(rows, stopped="during the cases"))
        s = summarise(result["rows"], dtype, device)
        if s["best"]:
            s["accuracy_check_can_fail"] = check_can_fail(dtype, dims, device, tuple(s["best"]), gen)
        ok &= bool(s["best"]) and s.get("accuracy_check_can_fail", False)
        result["summary"][str(dtype).removeprefix("torch.")] = s
        save()
        if not a.json:
            print(f"{dtype}: {json.dumps(s)}", file=sys.stderr)
    if a.save:
        tiles = {name: s["best"][1:] for name, s in result["summary"].items() if s.get("best")}
        with open(a.save, "w") as f:
            json.dump({"device": result["device"], **tiles}, f, indent=1)
        result["saved"] = {"path": a.save, "tiles": tiles,
                           "ship_as": gg.config_file(torch.cuda.get_device_name(device)) if device.type == "cuda" else None}
    if a.json:
        print(json.dumps(result))
    else:
        for r in result["rows"]:
            print("{dtype:9} rows {rows:4} {gemm:8} {provider:12} {blocks!s:22} ".format(**r)
                  + (f"{r['us']:9.2f} us {r['gbps']:8.1f} GB/s err {r['max_rel_err']:.1e}" if "us" in r else r["error"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

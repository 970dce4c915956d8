"""Microbenchmark: the chunked gated delta rule (Gated DeltaNet's token mixing,
``moe_rl.kernels.gated_delta``) with its Triton chunk scan, against the same rule with the torch
chunk scan and against flash-linear-attention's ``chunk_gated_delta_rule`` where it imports.

    moe-rl bench gated-delta [--json] [--shapes S,L,H,DK,DV;...] [--dtype bf16|fp32] [--device cuda|cpu]
    python -m moe_rl.kernels.bench.gated_delta ...

A shape packs S sequences of about L tokens (lengths alternate L + 37 and L - 37, so chunk tails
are partial) with H heads of key width DK and value width DV, an initial state per sequence.
Providers, each timed forward ("fwd": outputs and final states) and forward+backward ("fwd_bwd":
the gradients of q, k, v, the log-decay g and beta):

* ``triton``: ``chunk_gated_delta_rule(..., impl="triton")``, the intra-chunk work in torch and
  the sequential chunk scan as one Triton kernel (CUDA; on CPU under ``TRITON_INTERPRET=1`` only);
* ``torch``: the same rule with ``impl="torch"``: the chunk scan as a loop of batched torch ops;
* ``fla``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (fla-core; CUDA), called with
  ``scale=1`` on the same q, k, v, g, beta, ``cu_seqlens`` and initial state. Where it does not
  import the row says why, and the run goes on.

Accuracy (every provider that ran, at every shape): outputs and final states against the
token-by-token recurrence in float64 on the same inputs (``gated_delta_rule_reference``), and the
five gradients against that recurrence's own autograd at a small shape of the same widths (two
sequences of 100 and 37 tokens, 2 heads). The error is ||got - ref|| / ||ref|| per tensor;
the tolerance 1e-4 for a provider computing in fp32 (ours: inputs cast to fp32), 5e-2 where the
result is bf16 (fla keeps its inputs' dtype). The check checks itself once per run
(``accuracy_check_can_fail``): the torch provider run on a known-bad input, the gate dropped
(log-decay 0: the state never decays), must fail it.

``--providers`` picks some (default all three). Timing: ``triton.testing.do_bench`` on CUDA
(median, p20, p80 ms); on CPU the median of ``--reps`` runs. ``--json`` prints ``{"device",
"software", "rows": [...], "summary": {...}}``; the summary, for the largest shape:
``triton_vs_torch`` and ``triton_vs_fla`` per pass (ms ratio, < 1 = the Triton scan faster),
``ms``, ``accuracy_ok``, ``accuracy_check_can_fail``, ``fla`` (its version, or why it is
absent). Exit 1 when an accuracy check fails or cannot fail.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from moe_rl.kernels import gated_delta as gd
from moe_rl.kernels.bench.logprobs import _device_name, _time_ms, _triton_version

GPU_SHAPES = [(8, 1024, 16, 128, 128)]  # Qwen3-Next's head widths, 8k packed tokens
CPU_SHAPES = [(2, 128, 2, 32, 32)]
PROVIDERS = ("triton", "torch", "fla")
TOL = {torch.float32: 1e-4, torch.float64: 1e-4, torch.bfloat16: 5e-2}


def _parse_shapes(text: str) -> list[tuple[int, int, int, int, int]]:
    out = []
    for part in text.split(";"):
        dims = tuple(int(x) for x in part.split(","))
        if len(dims) != 5 or min(dims) < 1:
            raise ValueError(f"--shapes: {part!r} is not S,L,H,DK,DV (positive integers)")
        out.append(dims)
    return out


def lengths(seqs: int, length: int) -> list[int]:
    return [max(1, length + (37 if i % 2 == 0 else -37)) if seqs > 1 else length for i in range(seqs)]


def inputs(lens, heads, dk, dv, dtype, device, seed=0):
    """q, k (L2-normalised, q scaled by DK^-1/2), v, g (log-decay <= 0), beta, cu_seqlens, s0."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = gd.l2norm(torch.randn(T, heads, dk, generator=g)) * dk ** -0.5
    k = gd.l2norm(torch.randn(T, heads, dk, generator=g))
    v = torch.randn(T, heads, dv, generator=g)
    logdecay = -torch.rand(T, heads, generator=g) * 0.4
    beta = torch.rand(T, heads, generator=g)
    s0 = torch.randn(len(lens), heads, dk, dv, generator=g) * 0.1
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    return ([t.to(device, dtype) for t in (q, k, v, logdecay, beta)], cu.to(device),
            s0.to(device, torch.float32))


def _fla():
    """fla's chunk_gated_delta_rule, or the reason it is not there."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from importlib.metadata import version

        try:
            ver = version("fla-core")
        except Exception:
            ver = version("flash-linear-attention")
        return chunk_gated_delta_rule, ver
    except Exception as exc:  # not installed, or it does not import here
        return None, f"not available: {type(exc).__name__}: {exc}"[:200]


def providers(device) -> dict:
    """name -> fn(q, k, v, g, beta, cu, s0) -> (o [T, H, DV], final [S, H, DK, DV]), or the
    reason the provider cannot run here."""
    out = {}
    interp_or_cuda = gd.triton is not None and (device.type == "cuda" or gd.TRITON_INTERPRET)
    out["triton"] = ((lambda q, k, v, g, b, cu, s0: gd.chunk_gated_delta_rule(q, k, v, g, b, cu, s0, impl="triton"))
                     if interp_or_cuda else "needs CUDA (or TRITON_INTERPRET=1 set before the run)")
    out["torch"] = lambda q, k, v, g, b, cu, s0: gd.chunk_gated_delta_rule(q, k, v, g, b, cu, s0, impl="torch")
    fla, why = _fla()
    if fla is None:
        out["fla"] = why
    elif device.type != "cuda":
        out["fla"] = "fla's kernels run on CUDA"
    else:
        def run_fla(q, k, v, g, b, cu, s0):
            o, final = fla(q[None], k[None], v[None], g[None], b[None], scale=1.0, initial_state=s0,
                           output_final_state=True, cu_seqlens=cu.long())
            return o[0], final
        out["fla"] = run_fla
    return out


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| (an RMS measure: bf16 rounding of single elements does not dominate
    it; a wrong sequence or a missing gradient does)."""
    if got.shape != ref.shape:
        return float("inf")
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _grads(fn, ins, cu, s0, seed=7):
    """(o, final, dq, dk, dv, dg, dbeta) of fn, the backward from fixed random cotangents."""
    ins = [t.detach().requires_grad_() for t in ins]
    o, final = fn(*ins, cu, s0)
    g = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)
    wf = torch.randn(final.shape, generator=g, dtype=torch.float64).to(final)
    grads = torch.autograd.grad((o * wo).sum() + (final * wf).sum(), ins)
    return [o.detach(), final.detach(), *grads]


def check_accuracy(fn, shape, dtype, device) -> dict:
    """fn's outputs at ``shape`` and its gradients at the small shape against the float64
    recurrence: the relative errors, and ``ok`` against the tolerance of fn's result dtype."""
    S, L, H, dk, dv = shape
    ins, cu, s0 = inputs(lengths(S, L), H, dk, dv, dtype, device)
    with torch.no_grad():
        o, final = fn(*ins, cu, s0)
        ro, rfinal = gd.gated_delta_rule_reference(*(t.double() for t in ins), cu, s0.double())
    errs = {"o": rel_err(o, ro), "final": rel_err(final, rfinal)}
    tol = max(TOL.get(o.dtype, 5e-2), TOL.get(final.dtype, 5e-2))
    sins, scu, ss0 = inputs([100, 37], 2, dk, dv, dtype, device, seed=1)
    got = _grads(fn, sins, scu, ss0)
    want = _grads(gd.gated_delta_rule_reference, [t.double() for t in sins], scu, ss0.double())
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got[2:], want[2:]):
        errs[name] = rel_err(a, b)
        tol = max(tol, TOL.get(a.dtype, 5e-2))
    return {"errors": {k: float(f"{v:.3g}") for k, v in errs.items()}, "tolerance": tol,
            "ok": all(e <= tol for e in errs.values())}


def check_can_fail(shape, dtype, device) -> bool:
    """The output check fails the torch provider run on a known-bad input: the gate dropped
    (log-decay 0 for every token), against the recurrence of the true inputs."""
    S, L, H, dk, dv = shape
    ins, cu, s0 = inputs(lengths(S, L), H, dk, dv, dtype, device)
    q, k, v, g, beta = ins
    with torch.no_grad():
        o, final = gd.chunk_gated_delta_rule(q, k, v, torch.zeros_like(g), beta, cu, s0, impl="torch")
        ro, rfinal = gd.gated_delta_rule_reference(*(t.double() for t in ins), cu, s0.double())
    return min(rel_err(o, ro), rel_err(final, rfinal)) > TOL[torch.bfloat16]


def bench_shape(shape, dtype, device, reps: int, accuracy: bool, names=PROVIDERS) -> list[dict]:
    S, L, H, dk, dv = shape
    lens = lengths(S, L)
    ins, cu, s0 = inputs(lens, H, dk, dv, dtype, device)
    rows = []
    for name, fn in providers(device).items():
        if name not in names:
            continue
        base = {"shape": list(shape), "tokens": sum(lens), "dtype": str(dtype).replace("torch.", ""), "provider": name}
        if isinstance(fn, str):
            rows += [{**base, "pass": p, "error": fn} for p in ("fwd", "fwd_bwd")]
            continue
        acc = check_accuracy(fn, shape, dtype, device) if accuracy else None
        leaves = [t.detach().requires_grad_() for t in ins]
        do = torch.randn(sum(lens), H, dv, device=device)
        dfinal = torch.randn(S, H, dk, dv, device=device)

        def fwd(fn=fn):
            with torch.no_grad():
                return fn(*ins, cu, s0)

        def fwd_bwd(fn=fn, leaves=leaves, do=do, dfinal=dfinal):
            o, final = fn(*leaves, cu, s0)
            return torch.autograd.grad((o * do.to(o.dtype)).sum() + (final * dfinal).sum(), leaves)
        for pass_, f in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            try:
                med, p20, p80 = _time_ms(f, device, reps)
                row = {**base, "pass": pass_, "ms": round(med, 4), "p20": round(p20, 4), "p80": round(p80, 4)}
            except Exception as exc:  # a provider that fails here is a row, not the end of the run
                row = {**base, "pass": pass_, "error": f"{type(exc).__name__}: {exc}"[:300]}
            if acc is not None and pass_ == "fwd":
                row["accuracy"] = acc
                row["accuracy_ok"] = acc["ok"]
            rows.append(row)
    return rows


def summary(rows, shapes, dtype, device, can_fail: bool | None) -> dict:
    big = list(max(shapes, key=lambda s: s[0] * s[1] * s[2] * s[3] * s[4]))
    ms = {(r["provider"], r["pass"]): r["ms"] for r in rows if r["shape"] == big and "ms" in r}

    def ratio(a, b, p):
        return round(ms[a, p] / ms[b, p], 3) if (a, p) in ms and (b, p) in ms else None
    fla_rows = [r for r in rows if r["provider"] == "fla"]
    fla = (fla_rows[0]["error"] if fla_rows and "error" in fla_rows[0] else _fla()[1] if fla_rows
           else "not asked for (--providers)")
    out = {"shape": big, "dtype": str(dtype).replace("torch.", ""),
           "triton_vs_torch": {p: ratio("triton", "torch", p) for p in ("fwd", "fwd_bwd")},
           "triton_vs_fla": {p: ratio("triton", "fla", p) for p in ("fwd", "fwd_bwd")},
           "ms": {f"{a}_{p}": v for (a, p), v in ms.items()},
           "fla": fla,
           "accuracy_ok": all(r.get("accuracy_ok", True) for r in rows),
           "accuracy_check_can_fail": can_fail}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moe-rl bench gated-delta", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--shapes", help="S,L,H,DK,DV;... (default: GPU %s, CPU %s)" % (GPU_SHAPES, CPU_SHAPES))
    ap.add_argument("--dtype", choices=["bf16", "fp32"], help="input dtype (default bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--reps", type=int, default=3, help="CPU repetitions (median)")
    ap.add_argument("--providers", default=",".join(PROVIDERS),
                    help=f"comma-separated, of {PROVIDERS} (fla's first call autotunes its kernels: tens of seconds)")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the float64 checks")
    a = ap.parse_args(argv)
    device = torch.device(a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("moe-rl bench gated-delta: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    try:
        shapes = _parse_shapes(a.shapes) if a.shapes else (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    except ValueError as exc:
        print(f"moe-rl bench gated-delta: {exc}", file=sys.stderr)
        return 2
    names = [n.strip() for n in a.providers.split(",") if n.strip()]
    if not names or set(names) - set(PROVIDERS):
        print(f"moe-rl bench gated-delta: --providers {a.providers!r}: choose from {PROVIDERS}", file=sys.stderr)
        return 2
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    rows = []
    for shape in shapes:
        rows += bench_shape(shape, dtype, device, a.reps, not a.no_accuracy, names)
        if not a.json:
            print(f"done {shape}", file=sys.stderr)
    can_fail = None if a.no_accuracy else check_can_fail(shapes[0], dtype, device)
    result = {"device": _device_name(device),
              "software": {"torch": torch.__version__, "python": platform.python_version(),
                           "triton": _triton_version(), "triton_interpret": gd.TRITON_INTERPRET},
              "rows": rows, "summary": summary(rows, shapes, dtype, device, can_fail)}
    if a.json:
        print(json.dumps(result))
    else:
        for r in rows:
            what = r.get("error") or f"{r['ms']:.3f} ms (p20 {r['p20']:.3f}, p80 {r['p80']:.3f})"
            acc = f"  accuracy {r['accuracy']['errors']} ok={r['accuracy_ok']}" if "accuracy" in r else ""
            print(f"{'x'.join(map(str, r['shape'])):>20} {r['provider']:>7} {r['pass']:>8}  {what}{acc}")
        print("summary:", json.dumps(result["summary"]))
    s = result["summary"]
    return 0 if s["accuracy_ok"] and s["accuracy_check_can_fail"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())

"""Microbenchmark: fused LM-head log-probs + entropy, and the fused LM-head policy loss, against
materialising baselines.

    moe-rl bench logprobs [--json] [--shapes N,H,V;...] [--dtype bf16|fp32] [--no-compile]
    python -m moe_rl.kernels.bench.logprobs ...        python kernels/bench/logprobs.py ...

Providers, each measured in the same run, forward ("fwd") and forward+backward ("fwd_bwd"):

* ``fused``: ``moe_rl.kernels.fused_logprobs(..., return_entropy=True)`` (Triton on CUDA,
  the chunked torch implementation on CPU): the general path, backward recomputes the logits.
* ``eager``: ``hidden @ weight.T`` materialised, ``.float() / T``, ``log_softmax``, gather and
  entropy; ``compile``: ``torch.compile`` of the same function.
* ``gemm``: the bare LM-head GEMM ``hidden @ weight.T`` (fwd) and the three GEMMs of its
  forward+backward (``x W^T``, ``g W``, ``g^T x``; fwd_bwd). The practical roofline.
* ``liger``: Liger-Kernel's fused linear cross-entropy (CUDA; the NLL only, no entropy).

and, forward+backward only (a loss: its gradients are the point):

* ``fused_loss``: ``moe_rl.kernels.fused_token_loss`` with the trainer's policy loss
  (``moe_rl.algo.token_loss.TokenLoss``) configured as Liger's ``dapo`` loss: PPO clip
  0.2/0.28 against the old (behaviour) log-probs (``algo.ratio_anchor=behaviour``, as
  configs/tiny.yaml), token mean, no TIS/IcePop/KL, over ``--seqs`` sequences: d_hidden and
  d_weight made in the forward, three GEMMs.
* ``liger_grpo``: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` on the same inputs
  (``loss_type="dapo"``, the same clip, ``beta=0``), its default chunking: the same loss
  (tests/kernels/test_fused_token_loss.py checks value and gradients agree where Liger is
  installed).

A Liger row whose import fails says so ("not installed") instead of stopping the run.

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
gradients, and the fused loss's value and gradients, against fp64 references (row-chunked,
so they fit next to the 150k vocabulary), with the test suite's tolerances (the gradients
both as a whole, norm-relative, and element by element, max-relative): ``accuracy_ok``
on the ``fused`` fwd row and the ``fused_loss`` row. The check checks itself once per run: a
copy of the outputs with one planted error per output must be flagged
(``accuracy_check_can_fail`` in the summary; false means the check is blind).
``--profile DIR`` writes torch.profiler op tables, Chrome traces and a per-kernel breakdown
(``profile.json``) of one fused forward, forward+backward and fused loss at the largest shape.

``--json`` prints one object: ``{"device", "software", "rows": [...], "summary": {...}}``,
the summary for the largest shape run: ``fwd_vs_gemm`` (fused fwd / bare GEMM fwd),
``fwd_bwd_vs_gemm`` (fused fwd+bwd / three GEMMs), ``extra_mem_fraction`` (the larger of the
fused fwd and fwd+bwd extra memory / materialised fp32 logits ``N*V*4`` bytes),
``extra_mem_fraction_fwd``, ``materialised_fp32_logits_mib``, ``fwd_faster_than`` /
``fwd_bwd_faster_than`` (which of eager/compile/liger the fused op beats), ``accuracy_ok``,
``targets``, ``device``; and for the fused loss ``fused_loss_vs_gemm`` (fused_loss / three
GEMMs), ``fused_loss_extra_mem_fraction``, ``fused_loss_faster_than`` (of liger_grpo, fused,
compile, eager), ``fused_loss_accuracy_ok``; ``accuracy_check_can_fail``; ``plans`` (the
backward's row slab / vocab chunk and the fused loss's slab, with their planned scratch MiB).
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from moe_rl.kernels.fused_logprobs import _plan, fused_logprobs, plan_scratch_bytes
from moe_rl.kernels.fused_token_loss import _plan_fused, fused_scratch_bytes, fused_token_loss

GPU_SHAPES = [(4096, 4096, 151936), (8192, 4096, 151936)]
CPU_SHAPES = [(256, 256, 8192), (1024, 512, 32000)]
TARGETS = {"fwd_vs_gemm": 1.15, "fwd_bwd_vs_gemm": 1.35, "extra_mem_fraction": 0.01,
           "fused_loss_vs_gemm": 1.15}
LIGER_MISSING = "liger-kernel not installed (pip install liger-kernel)"


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


# ----------------------------------------------------------------------------------------------
# the policy-loss inputs: the trainer's default loss on `seqs` sequences of N/seqs tokens
# ----------------------------------------------------------------------------------------------
def loss_inputs(hidden, weight, labels, temperature, seqs: int, seed: int = 2):
    """Old (behaviour) log-probs near the current policy's, per-sequence advantages, mask,
    sequence ids; the TokenLoss of Liger's ``dapo`` loss (clip against the old log-probs,
    token mean, no TIS/IcePop)."""
    from moe_rl.algo.token_loss import TokenLoss
    from moe_rl.config import AlgoConfig

    n, dev = hidden.shape[0], hidden.device
    seqs = max(1, min(seqs, n))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        cur = fused_logprobs(hidden, weight, labels, temperature)
    behav = cur + (0.3 * torch.randn(n, generator=gen)).to(dev)
    seq_ids = (torch.arange(n) * seqs // n).to(dev)
    adv = torch.randn(seqs, generator=gen).to(dev)[seq_ids]
    mask = torch.ones(n, device=dev)
    cfg = AlgoConfig(ratio_anchor="behaviour", tis_cap=None, icepop_low=None, icepop_high=None)
    return dict(cfg=cfg, behav=behav, adv=adv, mask=mask, seq_ids=seq_ids, seqs=seqs,
                token_loss=TokenLoss(cfg, behav, adv, mask, seq_ids, num_tokens_global=n))


def _providers(hidden, weight, labels, temperature, device, use_compile, use_liger, seqs):
    """name -> {pass: fn | Exception}; each fn returns its outputs (for the memory accounting)."""
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

    g_logits = torch.randn(n, v, device=device, dtype=hidden.dtype)  # an input of the 3 GEMMs

    def gemm_fwd_bwd():
        logits = hidden @ weight.T
        del logits
        return g_logits @ weight, g_logits.T @ hidden

    li = loss_inputs(hidden, weight, labels, temperature, seqs)

    def fused_loss():
        loss, _, _ = fused_token_loss(hg, wg, labels, li["token_loss"], temperature)
        return torch.autograd.grad(loss, [hg, wg])

    # in the order they run: the targets' rows first (fused and fused loss against the GEMMs),
    # then the baselines, Liger's (Triton builds of seconds) before torch.compile's (its compiles
    # took the rest of a 40 s stage on an H100): a run cut short keeps what ran
    provs = {
        "fused": {"fwd": lambda: fused(hidden, weight, labels, temperature),
                  "fwd_bwd": fwd_bwd_of(fused)},
        "gemm": {"fwd": lambda: hidden @ weight.T, "fwd_bwd": gemm_fwd_bwd},
        "fused_loss": {"fwd_bwd": fused_loss},
        "eager": {"fwd": lambda: eager_logprobs(hidden, weight, labels, temperature),
                  "fwd_bwd": fwd_bwd_of(eager_logprobs)},
    }
    if use_liger:
        provs["liger"] = {p: f for p, f in _liger_flce(hidden, weight, hg, wg, labels, device).items()}
        provs["liger_grpo"] = {"fwd_bwd": _liger_grpo(hg, wg, labels, temperature, li)}
    if use_compile:
        compiled = torch.compile(eager_logprobs, dynamic=False)
        provs["compile"] = {"fwd": lambda: compiled(hidden, weight, labels, temperature),
                            "fwd_bwd": fwd_bwd_of(compiled)}
    return provs


def _liger_flce(hidden, weight, hg, wg, labels, device):
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        err = RuntimeError(LIGER_MISSING)
        return {"fwd": err, "fwd_bwd": err}
    except Exception as exc:  # an API this version lacks
        return {"fwd": exc, "fwd_bwd": exc}
    if device.type != "cuda":
        err = RuntimeError("Liger's fused linear cross-entropy runs Triton kernels on CUDA only")
        return {"fwd": err, "fwd_bwd": err}
    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")
    return {"fwd": lambda: loss_fn(weight, hidden, labels),
            "fwd_bwd": lambda: torch.autograd.grad(loss_fn(wg, hg, labels), [hg, wg])}


def _liger_grpo(hg, wg, labels, temperature, li):
    """Liger's fused linear GRPO loss on the same tokens as [seqs, N/seqs] sequences."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError:
        return RuntimeError(LIGER_MISSING)
    except Exception as exc:
        return exc
    cfg, seqs = li["cfg"], li["seqs"]
    n = hg.shape[0]
    if n % seqs:
        return ValueError(f"liger_grpo needs N={n} divisible by --seqs={seqs}")
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo",
                                       epsilon_low=cfg.clip_low, epsilon_high=cfg.clip_high,
                                       temperature=temperature, compiled=hg.is_cuda)
    shape = (seqs, n // seqs)
    ids, mask = labels.view(shape), li["mask"].view(shape)
    adv, old = li["adv"].view(shape)[:, 0].contiguous(), li["behav"].view(shape)

    def run():
        loss, _ = loss_fn(hg.view(*shape, -1), wg, ids, mask, adv, old_per_token_logps=old)
        return torch.autograd.grad(loss, [hg, wg])

    return run


def bench_inputs(n, h, v, dtype, device):
    """Seeded hidden states [n, h], LM head [v, h] and labels, drawn on ``device`` (the
    151936 x 4096 head's 622 M normals take seconds on a host)."""
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, generator=gen, device=device).to(dtype)
    weight = (torch.randn(v, h, generator=gen, device=device) / h**0.5).to(dtype)
    return hidden, weight, torch.randint(0, v, (n,), generator=gen, device=device)


def bench_shape(n, h, v, dtype, temperature, device, reps, use_compile, use_liger,
                accuracy=True, seqs=8, on_row=lambda row: None):
    """The rows of one shape; ``on_row`` is called with each as it is done. The accuracy checks
    against float64 run first and go into the fused rows (a run cut short keeps them)."""
    hidden, weight, labels = bench_inputs(n, h, v, dtype, device)
    flops = {"fwd": 2 * n * h * v, "fwd_bwd": 8 * n * h * v}
    rows = []
    acc = {("fused", "fwd"): check_accuracy(hidden, weight, labels, temperature),
           ("fused_loss", "fwd_bwd"): check_loss_accuracy(hidden, weight, labels, temperature, seqs)} if accuracy else {}
    provs = _providers(hidden, weight, labels, temperature, device, use_compile, use_liger, seqs)
    for name, fns in provs.items():
        for pas, fn in fns.items():
            row = {"shape": [n, h, v], "dtype": str(dtype).replace("torch.", ""),
                   "temperature": temperature, "provider": name, "pass": pas, **acc.get((name, pas), {})}
            if isinstance(fn, Exception):
                row["error"] = f"{type(fn).__name__}: {fn}"[:300]
                rows.append(row)
                on_row(row)
                continue
            try:
                ms, p20, p80 = _time_ms(fn, device, reps)
                row.update(ms=round(ms, 4), ms_p20=round(p20, 4), ms_p80=round(p80, 4),
                           extra_mib=round(_extra_mib(fn, device), 3),
                           tflops=round(flops[pas] / (ms * 1e-3) / 1e12, 6))
            except Exception as exc:  # one failing baseline must not sink the whole run
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            on_row(row)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    del provs
    return rows


# ----------------------------------------------------------------------------------------------
# accuracy against fp64 references
# ----------------------------------------------------------------------------------------------
# dtype -> (log-prob max abs error, entropy max abs error, gradient relative L2 error); the same
# bounds as tests/kernels/test_fused_logprobs.py
TOLERANCES = {torch.float32: (1e-5, 1e-5, 1e-5), torch.bfloat16: (2e-3, 5e-3, 1e-2)}
# the gradients element by element: max |got - ref| over max |ref|. The norm-relative error alone
# is blind, at these sizes, to one wrong element or tile (a planted error of the size of the
# largest element moved it by ~1e-3 at 8192 x 4096 x 151936: the H100 round's self-test said so)
MAX_TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def fp64_reference(hidden, weight, labels, temperature, g_logp, g_ent, rows_per_chunk=1024):
    """Exact-ish log-probs, entropy and the gradients of sum(g_logp*logp + g_ent*ent) w.r.t.
    hidden and weight, in fp64, materialising at most ``rows_per_chunk`` rows of logits.
    ``g_logp``/``g_ent`` may be callables of the chunk's fp64 (logp, ent, rows) giving the
    upstream gradients there (a loss's gradient at the exact log-probs)."""
    w64 = weight.detach().double().requires_grad_()
    logp, ent, d_hidden = [], [], []
    for lo in range(0, hidden.shape[0], rows_per_chunk):
        rows = slice(lo, lo + rows_per_chunk)
        h64 = hidden[rows].detach().double().requires_grad_()
        y = labels[rows]
        z = (h64 @ w64.T) / temperature
        lp_all = torch.log_softmax(z, dim=-1)
        del z
        e = -(lp_all.exp() * lp_all).sum(-1)
        lp = lp_all.gather(1, y.clamp(min=0)[:, None])[:, 0]
        keep = y != -100
        lp, e = torch.where(keep, lp, 0.0), torch.where(keep, e, 0.0)
        gl, ge = g_logp, g_ent
        if callable(gl):
            gl, ge = gl(lp.detach(), e.detach(), rows)
        else:
            gl, ge = gl[rows], ge[rows]
        ((gl.double() * lp).sum() + (ge.double() * e).sum()).backward()
        del lp_all
        logp.append(lp.detach())
        ent.append(e.detach())
        d_hidden.append(h64.grad)
    return torch.cat(logp), torch.cat(ent), torch.cat(d_hidden), w64.grad


def _rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))


def _max_rel(a, b) -> float:
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _grads_report(ref_dh, ref_dw, got_dh, got_dw, dtype) -> tuple[dict, bool]:
    """Both gradients' norm-relative and max-relative errors, and whether all are within
    tolerance."""
    tol, tol_max = TOLERANCES[dtype][2], MAX_TOLERANCES[dtype]
    out = {"rel_err_d_hidden": _rel(got_dh, ref_dh), "rel_err_d_weight": _rel(got_dw, ref_dw),
           "max_rel_err_d_hidden": _max_rel(got_dh, ref_dh), "max_rel_err_d_weight": _max_rel(got_dw, ref_dw)}
    ok = (out["rel_err_d_hidden"] <= tol and out["rel_err_d_weight"] <= tol
          and out["max_rel_err_d_hidden"] <= tol_max and out["max_rel_err_d_weight"] <= tol_max)
    return out, ok


def accuracy_report(ref, got, dtype) -> dict:
    """Errors of ``got`` = (logp, entropy, d_hidden, d_weight) against ``ref`` (fp64), and
    whether each is within the tolerance for the input dtype."""
    tol_lp, tol_ent, _ = TOLERANCES[dtype]
    grads, grads_ok = _grads_report(ref[2], ref[3], got[2], got[3], dtype)
    out = {
        "max_abs_err_logp": float((got[0].double() - ref[0]).abs().max()),
        "max_abs_err_entropy": float((got[1].double() - ref[1]).abs().max()),
        **grads,
    }
    out["accuracy_ok"] = bool(out["max_abs_err_logp"] <= tol_lp and
                              out["max_abs_err_entropy"] <= tol_ent and grads_ok)
    return out


def loss_accuracy_report(ref, got, dtype) -> dict:
    """Errors of ``got`` = (loss, logp, d_hidden, d_weight) of the fused loss against ``ref`` =
    (loss, logp, d_hidden, d_weight, sum_t |dL/dlogp_t|) in fp64. The loss may be off by what
    the log-probs are: |dL| <= sum_t |dL/dlogp_t| |d logp_t|."""
    tol_lp = TOLERANCES[dtype][0]
    grads, grads_ok = _grads_report(ref[2], ref[3], got[2], got[3], dtype)
    out = {
        "abs_err_loss": abs(float(got[0]) - float(ref[0])),
        "max_abs_err_logp": float((got[1].double() - ref[1]).abs().max()),
        **grads,
    }
    out["accuracy_ok"] = bool(out["abs_err_loss"] <= tol_lp * float(ref[4]) + 1e-12 and
                              out["max_abs_err_logp"] <= tol_lp and grads_ok)
    return out


def _plant_errors(report_fn, ref, got, dtype) -> bool:
    """Whether ``report_fn`` flags a planted error in each output: one element moved by 10x
    the output's scale of tolerance."""
    for i in range(len(got)):
        bad = [g.clone() if isinstance(g, torch.Tensor) else g for g in got]
        if bad[i].dim() == 0:
            bad[i] = bad[i] + 1.0 + abs(float(bad[i]))
        else:
            flat = bad[i].view(-1)
            flat[flat.numel() // 2] += 1.0 + float(flat.abs().max())
        if report_fn(ref, tuple(bad), dtype)["accuracy_ok"]:
            return False
    return True


_SELF_TEST: dict[str, bool] = {}


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
    out = accuracy_report(ref, got, hidden.dtype)
    if "fused" not in _SELF_TEST:
        _SELF_TEST["fused"] = _plant_errors(accuracy_report, ref, got, hidden.dtype)
    return out


def check_loss_accuracy(hidden, weight, labels, temperature, seqs) -> dict:
    """The fused loss's value, log-probs and gradients against fp64: the token loss's gradient
    taken at the fp64 log-probs, pushed through the materialised fp64 logits."""
    li = loss_inputs(hidden, weight, labels, temperature, seqs)
    tl = li["token_loss"]
    hg = hidden.detach().clone().requires_grad_()
    wg = weight.detach().clone().requires_grad_()
    loss, logp, _ = fused_token_loss(hg, wg, labels, tl, temperature)
    d_hidden, d_weight = torch.autograd.grad(loss, [hg, wg])
    got = (loss.detach(), logp, d_hidden, d_weight)
    del hg, wg
    ref_loss = torch.zeros((), dtype=torch.float64)
    abs_g = torch.zeros((), dtype=torch.float64)

    def upstream(lp, ent, rows):
        nonlocal ref_loss, abs_g
        lp = lp.clone().requires_grad_()
        val = tl(lp, None, rows).sum()
        (g,) = torch.autograd.grad(val, [lp])
        ref_loss = ref_loss + val.detach().cpu()
        abs_g = abs_g + g.abs().sum().cpu()
        return g, torch.zeros_like(ent)

    r = fp64_reference(hidden, weight, labels, temperature, upstream, None)
    ref = (ref_loss, r[0], r[2], r[3], abs_g)
    out = loss_accuracy_report(ref, got, hidden.dtype)
    if "fused_loss" not in _SELF_TEST:
        _SELF_TEST["fused_loss"] = _plant_errors(loss_accuracy_report, ref, got, hidden.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# profile: where a fused call's time goes
# ----------------------------------------------------------------------------------------------
def profile_fused(n, h, v, dtype, temperature, device, out_dir, seqs=8) -> dict:
    """One fused forward, forward+backward and fused loss under torch.profiler. Writes the op
    table (sorted by device time on CUDA, CPU time otherwise), a Chrome trace per pass and
    ``profile.json``: per pass, every kernel/op with its call count and total time."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hidden, weight, labels = bench_inputs(n, h, v, dtype, device)
    provs = _providers(hidden, weight, labels, temperature, device, False, False, seqs)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    summary = {"shape": [n, h, v], "dtype": str(dtype).replace("torch.", ""),
               "temperature": temperature, "device": _device_name(device), "passes": {}}
    passes = (("fwd", provs["fused"]["fwd"]), ("fwd_bwd", provs["fused"]["fwd_bwd"]),
              ("fused_loss", provs["fused_loss"]["fwd_bwd"]))
    for name, fn in passes:
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


def _plans(n, h, v, dtype, device) -> dict:
    """The chunking the fused ops choose at this shape, and its planned scratch."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    impl = "triton" if device.type == "cuda" else "torch"
    bwd = _plan(n, h, v, itemsize, impl)
    fl = _plan_fused(n, h, v, itemsize, impl)
    out = {"impl": impl, "backward": {"rows": bwd.rows, "vocab": bwd.vocab},
           "fused_loss": {"rows": fl.rows}}
    if impl == "triton":
        out["backward"]["scratch_mib"] = round(plan_scratch_bytes(bwd, n, h, v, itemsize) / 2**20, 3)
        out["fused_loss"]["scratch_mib"] = round(fused_scratch_bytes(fl, n, h, v, itemsize) / 2**20, 3)
    return out


def _summary(rows, device, dtype):
    ok = [r for r in rows if "ms" in r]
    if not ok:
        return {"device": _device_name(device)}
    big = max((tuple(r["shape"]) for r in ok), key=lambda s: s[0] * s[1] * s[2])
    get = {(r["provider"], r["pass"]): r for r in ok if tuple(r["shape"]) == big}
    n, h, v = big
    out = {"shape": list(big), "device": _device_name(device)}
    logits = n * v * 4 / 2**20
    fused_f, fused_fb = get.get(("fused", "fwd")), get.get(("fused", "fwd_bwd"))
    gemm_f, gemm_fb = get.get(("gemm", "fwd")), get.get(("gemm", "fwd_bwd"))
    if fused_f and gemm_f:
        out["fwd_vs_gemm"] = round(fused_f["ms"] / gemm_f["ms"], 4)
    if fused_fb and gemm_fb:
        out["fwd_bwd_vs_gemm"] = round(fused_fb["ms"] / gemm_fb["ms"], 4)
    if fused_f and fused_fb:
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
    fl = get.get(("fused_loss", "fwd_bwd"))
    if fl:
        if gemm_fb:
            out["fused_loss_vs_gemm"] = round(fl["ms"] / gemm_fb["ms"], 4)
        out["fused_loss_extra_mem_fraction"] = round(fl["extra_mib"] / logits, 6)
        others = {p: r["ms"] for (p, q), r in get.items() if q == "fwd_bwd" and p in
                  ("liger_grpo", "fused", "compile", "eager")}
        out["fused_loss_faster_than"] = sorted(p for p, ms in others.items() if fl["ms"] < ms)
    checked = [r["accuracy_ok"] for r in rows if "accuracy_ok" in r and r["provider"] == "fused"]
    if checked:  # every benchmarked shape, not only the largest
        out["accuracy_ok"] = all(checked)
    checked = [r["accuracy_ok"] for r in rows if "accuracy_ok" in r and r["provider"] == "fused_loss"]
    if checked:
        out["fused_loss_accuracy_ok"] = all(checked)
    if _SELF_TEST:
        out["accuracy_check_can_fail"] = all(_SELF_TEST.values())
    out["plans"] = _plans(n, h, v, dtype, device)
    out["targets"] = TARGETS
    return out


def tuned_configs() -> dict:
    """The config each autotuned LM-head kernel chose, per tuning key (empty before a GPU run)."""
    from .. import fused_logprobs, fused_token_loss

    launches = {"fwd": getattr(fused_logprobs, "_fwd_launch", None),
                "dlogits": getattr(fused_logprobs, "_dlogits_launch", None),
                "probs": getattr(fused_token_loss, "_probs_launch", None)}
    try:
        from triton.runtime import Autotuner
    except Exception:  # no Triton: nothing tuned
        return {}
    return {name: {str(key): str(cfg) for key, cfg in launch.cache.items()}
            for name, launch in launches.items() if isinstance(launch, Autotuner) and launch.cache}


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
    parser.add_argument("--seqs", type=int, default=8,
                        help="sequences the N tokens of the loss rows are split into (default 8)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    parser.add_argument("--no-liger", action="store_true", help="skip the Liger rows")
    parser.add_argument("--no-accuracy", action="store_true",
                        help="skip the fp64 accuracy checks of the fused outputs and gradients")
    parser.add_argument("--out", metavar="FILE",
                        help="also write the JSON object to FILE, rewritten after every row (a run "
                             "stopped early keeps the rows it finished)")
    parser.add_argument("--profile", metavar="DIR",
                        help="also profile one fused fwd, fwd+bwd and fused loss at the largest "
                             "shape with torch.profiler: op tables, Chrome traces and "
                             "profile.json in DIR")
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
    _SELF_TEST.clear()
    rows = []

    def result() -> dict:
        return {"device": _device_name(device),
                "software": {"torch": torch.__version__, "python": platform.python_version(),
                             "triton": _triton_version(), "liger_kernel": _liger_version()},
                "rows": rows, "summary": _summary(rows, device, dtype), "tuned_configs": tuned_configs()}

    def on_row(row) -> None:
        rows.append(row)
        if args.out:
            tmp = Path(args.out).with_name(Path(args.out).name + ".tmp")
            tmp.write_text(json.dumps(result()))
            tmp.replace(args.out)

    for n, h, v in shapes:
        bench_shape(n, h, v, dtype, args.temperature, device, args.reps, not args.no_compile,
                    not args.no_liger, not args.no_accuracy, args.seqs, on_row=on_row)
        if not args.json:
            print(f"done {n}x{h}x{v}", file=sys.stderr)
    if args.profile:
        big = max(shapes, key=lambda s: s[0] * s[1] * s[2])
        prof = profile_fused(*big, dtype, args.temperature, device, args.profile, args.seqs)
        if not args.json:
            for name, p in prof["passes"].items():
                print(f"profile {name}: {p['total_ms']:.2f} ms, top: " +
                      ", ".join(f"{o['name']} x{o['count']}" for o in p["top"][:5]),
                      file=sys.stderr)
    final = result()
    if args.json:
        print(json.dumps(final))
    else:
        _print_table(final)
    return 0


def _triton_version():
    try:
        import triton

        return triton.__version__
    except Exception:
        return None


def _liger_version():
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:
        return None


def _print_table(result):
    print(f"device: {result['device']}  software: {result['software']}")
    hdr = f"{'shape':>22} {'dtype':>8} {'provider':>10} {'pass':>8} {'ms':>10} " \
          f"{'p20':>10} {'p80':>10} {'extra MiB':>10} {'TFLOP/s':>8}"
    print(hdr)
    for r in result["rows"]:
        shape = "x".join(map(str, r["shape"]))
        if "error" in r:
            print(f"{shape:>22} {r['dtype']:>8} {r['provider']:>10} {r['pass']:>8}  "
                  f"error: {r['error']}")
            continue
        print(f"{shape:>22} {r['dtype']:>8} {r['provider']:>10} {r['pass']:>8} {r['ms']:>10.3f} "
              f"{r['ms_p20']:>10.3f} {r['ms_p80']:>10.3f} {r['extra_mib']:>10.2f} "
              f"{r['tflops']:>8.3f}")
    print("summary:", json.dumps(result["summary"]))


if __name__ == "__main__":
    sys.exit(main())

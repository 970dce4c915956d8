"""Microbenchmark: the batch-invariant ("exact") kernels against the torch ops the model runs
today, at the tiny config's shapes and at a medium CPU shape.

    moe-rl bench exact [--json] [--shapes tiny,medium] [--threads N] [--rounds R] [--dtype fp32|bf16]
    python -m moe_rl.kernels.bench.exact ...

Per shape (``SHAPES``: hidden, heads, head dim, vocab, experts, top-k, expert width, context,
decode rows, prefill/training tokens) and per case, the exact op (``moe_rl.kernels.exact``) and
its torch counterpart are timed in turn, ``--rounds`` times, each round the mean of enough
calls to fill ~20 ms; the figures are the medians over rounds (microseconds) and ``ratio`` =
exact / torch. The clock (``--clock``): on a CPU with ``--threads 1`` (the default) the calling
thread's CPU time, which other processes on a shared machine barely move (every op, torch's
and the exact kernels', runs in that thread); wall time otherwise. Cases:

* ``linear_decode`` / ``linear_tokens`` (q_proj shape: H -> heads * head_dim), ``lm_head``:
  ``F.linear``;  ``grouped_gate_up``: ``torch._grouped_mm`` over expert-sorted rows;
* ``rms_norm``: the model's ``weight * F.rms_norm(x.float()).to(dtype)``;  ``log_softmax``:
  ``torch.log_softmax``;  ``combine``: the model's ``bmm`` over the k slots;  ``silu_mul``:
  ``F.silu(g) * u``;  ``sample``: ``torch.multinomial`` of the probabilities;
* ``attention_decode``: the engine's decode step (the cache rows gathered, masked SDPA);
  ``attention_prefill``: one ``context``-token prompt (SDPA, causal); ``attention_packed``: a
  training micro-batch of sequences of 10-40 tokens (the model's ``PackedCausal``);
* ``layer_decode`` / ``layer_tokens``: one whole MoE decoder layer's forward (norms,
  projections, attention, router, top-k, dispatch, experts, combine) with exact ops vs torch
  ops, the glue (top-k, sort, gathers) shared: the kernels' cost in context, an upper bound on
  what a step pays (a step also runs Python, sampling and bookkeeping that the key leaves alone).

Checks (they can fail; ``checks_can_fail`` in the summary shows the invariance check flags a
planted one-bit change): every exact case's output against float64 (``accuracy_ok``), and a row
(token, query) computed alone against the same row in the batch (``invariant``; the torch
op's own result is reported as ``torch_invariant``).

``--json`` prints ``{"device", "software", "load", "rows": [...], "summary": {...}}``; the
summary gives each shape's ``layer_decode_ratio`` / ``layer_tokens_ratio`` and the largest
per-case ratio, ``accuracy_ok``, ``invariant`` and ``checks_can_fail``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_rl.kernels import exact as E


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int
    top_k: int
    expert_width: int
    context: int
    decode_rows: int
    tokens: int


SHAPES = {
    # configs/tiny.yaml (max_position_embeddings raised to a 512-token context); 32 requests decode
    # together (8 prompts x 4 samples), a training micro-batch packs ~512 tokens
    "tiny": Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=64, experts=8, top_k=2, expert_width=32,
                  context=512, decode_rows=32, tokens=512),
    "medium": Shape(hidden=512, heads=8, kv_heads=4, head_dim=64, vocab=8192, experts=16, top_k=2, expert_width=256,
                    context=1024, decode_rows=32, tokens=1024),
}


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def _timed(fn, device, clock, target_s: float = 0.02) -> float:
    """Seconds per call, averaged over enough calls to fill ~target_s."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    t0 = clock()
    fn()
    sync()
    one = max(clock() - t0, 1e-6)
    n = max(1, min(2000, int(target_s / one)))
    t0 = clock()
    for _ in range(n):
        fn()
    sync()
    return (clock() - t0) / n


def _compare(exact, ref, device, rounds: int, clock) -> dict:
    """Interleaved timing: exact, torch, exact, torch ... medians over rounds (microseconds)."""
    te, tt = [], []
    for _ in range(rounds):
        te.append(_timed(exact, device, clock))
        tt.append(_timed(ref, device, clock))
    me, mt = statistics.median(te) * 1e6, statistics.median(tt) * 1e6
    return {"exact_us": round(me, 2), "torch_us": round(mt, 2), "ratio": round(me / mt, 3)}


def _close(got: torch.Tensor, want: torch.Tensor, dtype) -> bool:
    tol = 2e-5 if dtype == torch.float32 else 2 ** -6
    return bool(((got.double() - want.double()).abs() <= tol * (want.double().abs() + 1)).all())


def _row_equal(fn, batch: torch.Tensor, at: int) -> bool:
    """fn(batch)[at] equals fn of that row alone."""
    return torch.equal(fn(batch)[at], fn(batch[at:at + 1])[0])


def _rope_free_attention_inputs(s: Shape, n, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, s.head_dim, generator=g).to(dtype).to(device) for h in (s.heads, s.kv_heads, s.kv_heads)]


class _Ops:
    """One decoder layer's kernels, exact or torch: the functions ``layer`` calls."""

    def __init__(self, exact: bool, eps: float = 1e-6):
        self.exact, self.eps = exact, eps

    def linear(self, x, w):
        return E.linear(x, w) if self.exact else F.linear(x, w)

    def norm(self, x, w):
        return E.rms_norm(x, w, self.eps) if self.exact else w * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def softmax(self, x):
        return E.softmax(x) if self.exact else F.softmax(x, dim=-1, dtype=torch.float)

    def grouped(self, x, w, offs):
        return E.grouped_linear(x, w, offs) if self.exact else torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def silu_mul(self, g, u):
        return E.silu_mul(g, u) if self.exact else F.silu(g) * u

    def combine(self, e, w):
        if self.exact:
            return E.moe_combine(e, w)
        return torch.bmm(w.to(e.dtype).unsqueeze(1), e.view(w.shape[0], w.shape[1], -1)).squeeze(1)


def _layer_params(s: Shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)
    return {"n1": 1 + r(s.hidden), "n2": 1 + r(s.hidden), "q": r(s.heads * s.head_dim, s.hidden),
            "kv": r(2 * s.kv_heads * s.head_dim, s.hidden), "o": r(s.hidden, s.heads * s.head_dim),
            "router": r(s.experts, s.hidden), "gate_up": r(s.experts, 2 * s.expert_width, s.hidden),
            "down": r(s.experts, s.hidden, s.expert_width)}


def _layer(ops: _Ops, p: dict, s: Shape, h: torch.Tensor, attend) -> torch.Tensor:
    """One MoE decoder layer's forward over tokens h [N, H] (RoPE left out: elementwise, the same
    on both sides); ``attend(q, k, v)`` -> [N, heads, head_dim]."""
    N = h.shape[0]
    x = ops.norm(h, p["n1"])
    q = ops.linear(x, p["q"]).view(N, s.heads, s.head_dim)
    k, v = ops.linear(x, p["kv"]).view(N, 2, s.kv_heads, s.head_dim).unbind(1)
    h = h + ops.linear(attend(q, k, v).reshape(N, -1), p["o"])
    x = ops.norm(h, p["n2"])
    probs = ops.softmax(ops.linear(x, p["router"]))
    w, ids = probs.topk(s.top_k, dim=-1)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.searchsorted(flat[order], torch.arange(1, s.experts + 1, device=h.device)).to(torch.int32)
    gu = ops.grouped(x.index_select(0, order // s.top_k), p["gate_up"], offs)
    y = ops.grouped(ops.silu_mul(gu[:, :s.expert_width].contiguous(), gu[:, s.expert_width:].contiguous()),
                    p["down"], offs)
    expert_out = torch.empty_like(y).index_copy_(0, order, y)
    return h + ops.combine(expert_out, w)


def _cases(s: Shape, dtype, device, seed=0):
    """(name, exact fn, torch fn, reference fn or None, invariance probe or None) per case."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(device)

    H, D = s.hidden, s.heads * s.head_dim
    out = []
    # linears
    w_q, w_lm = rnd(D, H, scale=H ** -0.5), rnd(s.vocab, H, scale=H ** -0.5)
    for name, rows, w in (("linear_decode", s.decode_rows, w_q), ("linear_tokens", s.tokens, w_q),
                          ("lm_head", s.decode_rows, w_lm)):
        x = rnd(rows, H)
        out.append((name, (lambda x=x, w=w: E.linear(x, w)), (lambda x=x, w=w: F.linear(x, w)),
                    (lambda x=x, w=w: x.double() @ w.double().T),
                    (lambda fn, x=x, at=rows // 2: _row_equal(fn, x, at), lambda x_, w=w: E.linear(x_, w),
                     lambda x_, w=w: F.linear(x_, w))))
    # grouped expert GEMM
    rows = s.tokens * s.top_k
    xg, wg = rnd(rows, H), rnd(s.experts, 2 * s.expert_width, H, scale=H ** -0.5)
    offs = torch.linspace(0, rows, s.experts + 1)[1:].round().to(torch.int32).to(device)
    from moe_rl.kernels.grouped_gemm import grouped_gemm_reference
    out.append(("grouped_gate_up", lambda: E.grouped_linear(xg, wg, offs),
                lambda: torch._grouped_mm(xg, wg.transpose(-2, -1), offs=offs),
                lambda: grouped_gemm_reference(xg.double(), wg.double(), offs), None))
    # norm, log-softmax, combine, silu
    xn, wn = rnd(s.tokens, H), 1 + rnd(H, scale=0.1)
    out.append(("rms_norm", lambda: E.rms_norm(xn, wn, 1e-6),
                lambda: wn * F.rms_norm(xn.float(), (H,), eps=1e-6).to(dtype),
                lambda: E.rms_norm_reference(xn.double(), wn.double(), 1e-6),
                (lambda fn: _row_equal(fn, xn, 7), lambda t: E.rms_norm(t, wn, 1e-6),
                 lambda t: wn * F.rms_norm(t.float(), (H,), eps=1e-6).to(dtype))))
    xl = rnd(s.tokens, s.vocab, scale=3.0)
    out.append(("log_softmax", lambda: E.log_softmax(xl), lambda: torch.log_softmax(xl.float(), -1),
                lambda: torch.log_softmax(xl.double(), -1),
                (lambda fn: _row_equal(fn, xl, 7), E.log_softmax, lambda t: torch.log_softmax(t.float(), -1))))
    e, cw = rnd(s.tokens * s.top_k, H), torch.rand(s.tokens, s.top_k, generator=g).to(device)
    out.append(("combine", lambda: E.moe_combine(e, cw),
                lambda: torch.bmm(cw.to(dtype).unsqueeze(1), e.view(s.tokens, s.top_k, H)).squeeze(1),
                lambda: (cw.double()[:, :, None] * e.double().view(s.tokens, s.top_k, H)).sum(1), None))
    gg, uu = rnd(s.tokens * s.top_k, s.expert_width, scale=3.0), rnd(s.tokens * s.top_k, s.expert_width)
    out.append(("silu_mul", lambda: E.silu_mul(gg, uu), lambda: F.silu(gg) * uu,
                lambda: F.silu(gg.double()) * uu.double(),
                (lambda fn: _row_equal(fn, torch.cat([gg, uu], 1), 5),
                 lambda t: E.silu_mul(t[:, :s.expert_width].contiguous(), t[:, s.expert_width:].contiguous()),
                 lambda t: F.silu(t[:, :s.expert_width].contiguous()) * t[:, s.expert_width:].contiguous())))
    lp = torch.log_softmax(rnd(s.decode_rows, s.vocab, dt=torch.float32), -1)
    seeds, pos = torch.arange(s.decode_rows, device=device), torch.arange(s.decode_rows, device=device) + 100
    out.append(("sample", lambda: E.seeded_sample(lp, seeds, pos), lambda: torch.multinomial(lp.exp(), 1)[:, 0],
                None, None))
    out += _attention_cases(s, dtype, device, g)
    out += _layer_cases(s, dtype, device)
    return out


def _attention_cases(s: Shape, dtype, device, g):
    out = []
    hkv, d, ctx, B = s.kv_heads, s.head_dim, s.context, s.decode_rows
    scale = d ** -0.5
    # decode against the engine's cache [slots, Hkv, ctx, D], contexts between ctx/2 and ctx
    kc = torch.randn(B + 1, hkv, ctx, d, generator=g).to(dtype).to(device)
    vc = torch.randn(B + 1, hkv, ctx, d, generator=g).to(dtype).to(device)
    q = torch.randn(B, s.heads, d, generator=g).to(dtype).to(device)
    pos = torch.randint(ctx // 2, ctx, (B,), generator=g).to(device)
    slots = torch.arange(B, device=device)
    cu = torch.arange(B + 1, dtype=torch.int32, device=device)
    lmax = int(pos.max()) + 1
    mask = (torch.arange(lmax, device=device)[None, :] <= pos[:, None])[:, None, None, :]

    def torch_decode():
        ks, vs = kc[:, :, :lmax].index_select(0, slots), vc[:, :, :lmax].index_select(0, slots)
        return F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=mask, enable_gqa=True).squeeze(2)

    def exact_decode():
        return E.cached_attention(q, kc, vc, cu, slots, pos.to(torch.int32))

    def ref_decode():
        z = torch.zeros(B, dtype=torch.long, device=device)
        return E.attention_reference(q.double(), kc.transpose(1, 2).double(), vc.transpose(1, 2).double(), cu,
                                     pos, slots, z, scale)
    out.append(("attention_decode", exact_decode, torch_decode, ref_decode, None))
    # one long prompt, causal
    qp, kp, vp = _rope_free_attention_inputs(s, ctx, dtype, device, 1)
    cu1 = torch.tensor([0, ctx], dtype=torch.int32, device=device)

    def torch_prefill():
        return F.scaled_dot_product_attention(qp.transpose(0, 1)[None], kp.transpose(0, 1)[None],
                                              vp.transpose(0, 1)[None], is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    z1 = torch.zeros(1, dtype=torch.int32, device=device)
    out.append(("attention_prefill", lambda: E.packed_attention(qp, kp, vp, cu1), torch_prefill,
                lambda: E.attention_reference(qp.double(), kp.double(), vp.double(), cu1, z1, z1.long(), z1.long(),
                                              scale), None))
    # a packed training micro-batch
    from moe_rl.model.transformer import PackedCausal
    lens = torch.randint(10, 41, (max(1, s.tokens // 25),), generator=g)
    cu2 = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(device)
    tot = int(cu2[-1])
    q2, k2, v2 = _rope_free_attention_inputs(s, tot, dtype, device, 2)
    pc = PackedCausal(cu2, tot)
    cu2i = cu2.to(torch.int32)
    zs = torch.zeros(lens.numel(), dtype=torch.long, device=device)
    out.append(("attention_packed", lambda: E.packed_attention(q2, k2, v2, cu2i), lambda: pc(0, q2, k2, v2),
                lambda: E.attention_reference(q2.double(), k2.double(), v2.double(), cu2i, zs, zs, cu2[:-1], scale),
                None))
    return out


def _layer_cases(s: Shape, dtype, device):
    from moe_rl.model.transformer import PackedCausal
    p = _layer_params(s, dtype, device)
    out = []
    g = torch.Generator().manual_seed(5)
    exact_ops, torch_ops = _Ops(True), _Ops(False)
    # decode: 32 rows against the cache (their new K/V written first), contexts ctx/2..ctx
    B, ctx = s.decode_rows, s.context
    kc = torch.randn(B, s.kv_heads, ctx, s.head_dim, generator=g).to(dtype).to(device)
    vc = torch.randn_like(kc)
    pos = torch.randint(ctx // 2, ctx, (B,), generator=g).to(device)
    slots = torch.arange(B, device=device)
    cu = torch.arange(B + 1, dtype=torch.int32, device=device)
    lmax = int(pos.max()) + 1
    mask = (torch.arange(lmax, device=device)[None, :] <= pos[:, None])[:, None, None, :]

    def write(k, v):
        kc[slots, :, pos] = k
        vc[slots, :, pos] = v

    def exact_decode_attend(q, k, v):
        write(k, v)
        return E.cached_attention(q, kc, vc, cu, slots, pos.to(torch.int32))

    def torch_decode_attend(q, k, v):
        write(k, v)
        ks, vs = kc[:, :, :lmax].index_select(0, slots), vc[:, :, :lmax].index_select(0, slots)
        return F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=mask, enable_gqa=True).squeeze(2)
    hd = torch.randn(B, s.hidden, generator=g).to(dtype).to(device)
    out.append(("layer_decode", lambda: _layer(exact_ops, p, s, hd, exact_decode_attend),
                lambda: _layer(torch_ops, p, s, hd, torch_decode_attend), None, None))
    # a packed micro-batch of sequences of 10-40 tokens (training forward, prefill)
    lens = torch.randint(10, 41, (max(1, s.tokens // 25),), generator=g)
    cu2 = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(device)
    tot = int(cu2[-1])
    pc = PackedCausal(cu2, tot)
    cu2i = cu2.to(torch.int32)
    ht = torch.randn(tot, s.hidden, generator=g).to(dtype).to(device)
    out.append(("layer_tokens", lambda: _layer(exact_ops, p, s, ht, lambda q, k, v: E.packed_attention(q, k, v, cu2i)),
                lambda: _layer(torch_ops, p, s, ht, lambda q, k, v: pc(0, q, k, v)), None, None))
    return out


def run(shape_names, dtype, device, rounds: int, clock) -> dict:
    rows = []
    for sname in shape_names:
        s = SHAPES[sname]
        for name, exact, ref, want, probe in _cases(s, dtype, device):
            row = {"shape": sname, "case": name, **_compare(exact, ref, device, rounds, clock)}
            if want is not None:
                row["accuracy_ok"] = _close(exact(), want(), dtype)
            if probe is not None:
                check, exact_fn, torch_fn = probe
                row["invariant"] = check(exact_fn)
                row["torch_invariant"] = check(torch_fn)
            rows.append(row)
            print(f"  {sname:6s} {name:18s} exact {row['exact_us']:10.1f} us  torch {row['torch_us']:10.1f} us  "
                  f"ratio {row['ratio']:.2f}", file=sys.stderr, flush=True)
    return {"rows": rows, "summary": _summary(rows, shape_names)}


def _self_test() -> bool:
    """The invariance check flags a row that differs from itself alone in its last bit."""
    x = torch.randn(8, 16)

    def planted(t):
        out = E.log_softmax(t)
        if t.shape[0] > 1:
            out.view(torch.int32)[3, 0] ^= 1
        return out
    return _row_equal(E.log_softmax, x, 3) and not _row_equal(planted, x, 3)


def _summary(rows, shape_names) -> dict:
    out = {}
    for sname in shape_names:
        mine = {r["case"]: r for r in rows if r["shape"] == sname}
        kernel = [r for r in mine.values() if not r["case"].startswith("layer_")]
        out[sname] = {"layer_decode_ratio": mine["layer_decode"]["ratio"],
                      "layer_tokens_ratio": mine["layer_tokens"]["ratio"],
                      "max_kernel_ratio": max(r["ratio"] for r in kernel),
                      "max_kernel_ratio_case": max(kernel, key=lambda r: r["ratio"])["case"]}
    out["accuracy_ok"] = all(r.get("accuracy_ok", True) for r in rows)
    out["invariant"] = all(r.get("invariant", True) for r in rows)
    out["torch_variant_cases"] = sorted({r["case"] for r in rows if r.get("torch_invariant") is False})
    out["checks_can_fail"] = _self_test()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-rl bench exact", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--shapes", default="tiny,medium", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads of torch and of the exact kernels (default 1: steadier on a shared machine)")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds per case (median)")
    parser.add_argument("--clock", choices=["auto", "wall", "cpu"], default="auto",
                        help="cpu: the calling thread's CPU time (steady on a shared machine; only with --threads 1 "
                             "on a CPU, where every op runs in that thread); auto: cpu there, wall otherwise")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    bad = [n for n in names if n not in SHAPES]
    if bad:
        print(f"moe-rl bench exact: unknown shape(s) {bad}; choose from {sorted(SHAPES)}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("moe-rl bench exact: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    clock = args.clock
    if clock == "auto":
        clock = "cpu" if device.type == "cpu" and args.threads == 1 else "wall"
    if clock == "cpu" and (device.type != "cpu" or args.threads != 1):
        print("moe-rl bench exact: --clock cpu measures one thread: only with --device cpu --threads 1",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    E.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    load0 = os.getloadavg()
    result = run(names, dtype, device, args.rounds, CLOCKS[clock])
    result.update({
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or 'cpu'}, "
                  f"{os.cpu_count()} cores, exact kernels: {E.isa()}",
        "software": {"torch": torch.__version__, "python": platform.python_version()},
        "load": {"loadavg_1m_start": round(load0[0], 2), "loadavg_1m_end": round(os.getloadavg()[0], 2)},
        "settings": {"threads": args.threads, "rounds": args.rounds, "dtype": args.dtype, "clock": clock},
        "shapes": {n: SHAPES[n].__dict__ for n in names},
    })
    if args.json:
        print(json.dumps(result))
    else:
        print("summary:", json.dumps(result["summary"]))
    return 0 if result["summary"]["accuracy_ok"] and result["summary"]["invariant"] else 1


if __name__ == "__main__":
    sys.exit(main())

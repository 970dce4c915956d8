"""Tokens/s and MFU of one training step, native backend vs megatron backend.

    python -m moe_rl.train.megatron.bench [--preset tiny|small|medium|large]
        [--backends native,native_eager,native_fused,native_graphs,megatron,megatron_recompute]
        [--device cuda|cpu]
        [--compile auto|true|false] [--json] [--out FILE] [--profile] [--profile-dir DIR]
    python -m moe_rl.train.megatron.bench --device cpu --baseline /tmp/base --rounds 3   # A/B on CPU

One step = forward (routing replayed from a fixed record), the trainer's policy loss
(``policy_loss``, decoupled PPO with the proximal policy = this forward), backward over every
micro-batch, then ``optimizer_step`` (in bf16 both backends step fp32 main params with AdamW,
fused on a GPU). All backends start from the same weights (the native
seeded init) and see the same batch; each is built, warmed up, timed and freed in turn, and
the JSON (``--out``) is rewritten as each row fills (``build_s``, ``first_step_s``, the timed
figures; ``stopped`` says where a cut row ended), so a run stopped midway keeps what it measured.
Native rows: ``native`` (``train.compile`` as ``--compile`` says, default auto: compiled on
CUDA, eager on a CPU; the general loss path: log-probs, then the loss, then backward),
``native_eager`` (``train.compile=false``) and ``native_fused`` (``--compile``'s blocks and
the loss fused into the LM head, ``train.fused_loss``: ``backend.token_loss``) and
``native_graphs`` (the compiled blocks replayed as CUDA graphs, ``train.cuda_graphs``; CUDA
only: on a CPU the row records the config's refusal). Each native row
says ``compiled``, ``loss_path`` and ``first_step_s`` (the first warm-up step: with compile,
most of the compile time is in it; ``compile_s`` = it minus a timed step). On CPU (fp32,
native only by default) it prints tokens/s; ``--baseline DIR`` runs the native step of another
checkout (DIR on PYTHONPATH, this file as the driver) and of this one alternately in fresh
processes and reports medians and their ratio.

On CUDA each row also has ``issue_s`` (the host's time to issue a step, before the closing
synchronize: near ``step_s``, the step is host-bound) and ``host_syncs`` (one more step under
CUDA's sync debug mode: how many synchronizing calls, and from which source lines).

MFU = model FLOPs / (step time x the device's dense bf16 peak). Model FLOPs per step =
6 x (active matmul parameters per token) x tokens + causal attention: 6 x L^2 x heads x head_dim
per sequence of length L per layer (QK^T and PV, 2 FLOPs per MAC, the causal half, forward x 3
for forward+backward). Active parameters: attention projections, the router, top_k experts'
three projections (or the dense MLP), and the LM head; not the embedding (a lookup).
Figures go to docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

PRESETS = {
    # the CPU dry run of scripts/gpu_round.sh and the tests: a fraction of a second per step on a CPU
    "tiny": dict(arch=dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_experts=8, num_experts_per_tok=2),
                 seq=64, seqs_per_micro=2, micro=2),
    # a smoke size: seconds per step on any GPU
    "small": dict(arch=dict(vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                            num_experts=16, num_experts_per_tok=4),
                  seq=256, seqs_per_micro=4, micro=2),
    # ~0.5B parameters, Qwen3-MoE-shaped (GQA 16/4, 32 experts top-4, one 32k vocab)
    "medium": dict(arch=dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                             num_experts=32, num_experts_per_tok=4),
                   seq=512, seqs_per_micro=4, micro=4),
    # Qwen3-30B-A3B's layer shapes (hidden 2048, expert width 768, top-8 of 64 here, GQA 32/4 x 128,
    # its 151936 vocab), 6 layers: ~2.7B parameters, fits one 80 GB GPU with AdamW state; 16k tokens/step
    "large": dict(arch=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=64, num_experts_per_tok=8),
                  seq=2048, seqs_per_micro=2, micro=4),
}

# dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from NVIDIA's data sheets; matched in order
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
                    ("H20", 148.0), ("A100", 312.0), ("L40S", 362.0), ("B200", 2250.0)]


def peak_tflops(device_name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def model_flops(preset: dict) -> dict:
    """Model FLOPs of one training step (see the module docstring for what is counted)."""
    a = preset["arch"]
    H, L = a["hidden_size"], a["num_hidden_layers"]
    q, kv = a["num_attention_heads"] * a["head_dim"], a["num_key_value_heads"] * a["head_dim"]
    attn = 2 * H * q + 2 * H * kv
    moe = H * a["num_experts"] + a["num_experts_per_tok"] * 3 * H * a["moe_intermediate_size"]
    active = L * (attn + moe) + H * a["vocab_size"]  # every layer MoE (the presets have no dense layers)
    seqs = preset["seqs_per_micro"] * preset["micro"]
    tokens = seqs * preset["seq"]
    attention = 6 * preset["seq"] ** 2 * q * L * seqs
    return dict(active_params=active, tokens=tokens, flops=6 * active * tokens + attention, attention_flops=attention)


def _cfg(preset: dict, backend: str, dtype: str, recompute: bool, device: str = "cuda", compile="auto",
         cuda_graphs: bool = False):
    from moe_rl.config import ExperimentConfig

    return ExperimentConfig.model_validate(dict(
        model=dict(preset["arch"], dtype=dtype, max_position_embeddings=4096, rope_theta=1_000_000.0),
        pools=dict(trainer=1, rollout=0), engine=dict(kind="sglang", urls=["http://127.0.0.1:1"]),
        train=dict(backend=backend, device=device, lr=1e-5, megatron_recompute=recompute,
                   megatron_dispatcher="alltoall" if device == "cuda" else "allgather",
                   **({} if compile == "auto" else {"compile": compile}),  # (--baseline: an older schema)
                   **({"cuda_graphs": True} if cuda_graphs else {})),
        # decoupled PPO with the proximal policy taken from this forward, no TIS/IcePop: every
        # token trains (a loss both paths compute, train.fused_loss's per-token form)
        algo=dict(ratio_anchor="proximal", tis_cap=None, icepop_low=None, icepop_high=None),
    ))


# native rows -> (train.compile: None = --compile's, the loss path, train.cuda_graphs)
NATIVE_ROWS = {"native": (None, "general", False), "native_eager": (False, "general", False),
               "native_fused": (None, "fused", False), "native_graphs": (None, "general", True)}
BACKENDS = (*NATIVE_ROWS, "megatron", "megatron_recompute")


def _batch(preset: dict):
    from moe_rl.train.backend import MicroBatch

    arch = preset["arch"]
    g = torch.Generator().manual_seed(0)
    L, S = preset["seq"], preset["seqs_per_micro"]
    n_moe = arch["num_hidden_layers"]
    mbs = []
    for _ in range(preset["micro"]):
        T = L * S
        ids = torch.randint(0, arch["vocab_size"], (1, T), generator=g)
        cu = torch.arange(0, T + 1, L)
        labels = ids[0].roll(-1).clone()
        labels[cu[1:] - 1] = -100
        replay = [torch.rand(T, arch["num_experts"], generator=g).argsort(1)[:, : arch["num_experts_per_tok"]]
                  for _ in range(n_moe)]
        mbs.append(MicroBatch(ids, cu, labels, replay))
    return mbs


def _measure(backend, mbs, steps: int, warmup: int, flops: float, peak: float | None, profile: bool = False,
             table: Path | None = None, loss_path: str = "general", algo=None, progress=None) -> dict:
    """The row of one backend. ``progress(figures)``, if given, gets what is known so far: the
    first step's time once it ends, then the timed figures before the profiled step (a run
    stopped by a time cap keeps them)."""
    from moe_rl.algo import policy_loss
    from moe_rl.algo.token_loss import TokenLoss

    n_loss = sum(int((mb.labels != -100).sum()) for mb in mbs)
    tokens = sum(mb.num_tokens for mb in mbs)
    cuda = backend.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dev = backend.device
    # per micro-batch: the label rows, and per loss token a behaviour log-prob, an advantage,
    # a mask and its sequence (as the trainer's Micro holds them), on the device
    data = []
    for i, mb in enumerate(mbs):
        rows = (mb.labels != -100).nonzero()[:, 0]
        g = torch.Generator().manual_seed(i)
        seq = torch.searchsorted(mb.cu_seqlens[1:], rows, right=True)
        data.append(dict(rows=rows.to(dev), behav=(-4.0 - torch.rand(len(rows), generator=g)).to(dev),
                         adv=torch.randn(len(rows), generator=g).to(dev), mask=torch.ones(len(rows), device=dev),
                         seq=seq.to(dev)))

    def step():
        for mb, d in zip(mbs, data):
            if loss_path == "fused":
                tl = TokenLoss(algo, d["behav"], d["adv"], d["mask"], d["seq"], num_tokens_global=n_loss)
                loss = backend.token_loss(mb, d["rows"], 1.0, tl)[0]
            else:
                logp = backend.logprobs(mb, 1.0)[0][d["rows"]]
                loss = policy_loss(logp, logp.detach(), d["behav"], d["adv"], d["mask"], d["seq"], algo,
                                   num_tokens_global=n_loss)[0]
            loss.backward()
        backend.optimizer_step()

    first = None
    for i in range(warmup):
        t0 = time.perf_counter()
        step()
        sync()
        if i == 0:
            first = time.perf_counter() - t0
            if progress is not None:
                progress({"first_step_s": first, "stopped": "during the warm-up or timed steps"})
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, cpu_times, issue_times = [], [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        issue_times.append(time.perf_counter() - t0)  # the host done issuing the step (no sync yet)
        sync()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    mean = sum(times) / len(times)
    # CPU seconds of this process: on a shared machine (other processes taking the cores) a
    # steadier measure of the work a CPU step does than wall time
    cpu_mean = sum(cpu_times) / len(cpu_times)
    row = dict(tokens_per_step=tokens, step_s=mean, step_s_min=min(times), tokens_per_s=tokens / mean,
               cpu_s=cpu_mean, tokens_per_cpu_s=tokens / cpu_mean,
               model_tflops_per_s=flops / mean / 1e12, mfu=flops / mean / (peak * 1e12) if peak else None,
               peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               first_step_s=first, loss_path=loss_path, issue_s=sum(issue_times) / len(issue_times))
    if cuda:  # where the host waits for the device inside a step (a wait there serialises host and GPU)
        row["host_syncs"] = _host_syncs(step, sync)
    if profile:
        if progress is not None:
            progress(dict(row, stopped="during the profiled step"))
        row["profile_top_ops"] = _profile_top(step, sync, cuda, table)
    return row


def _host_syncs(step, sync, n: int = 8) -> dict:
    """One more step under CUDA's sync debug mode: how many synchronizing calls it makes and the
    ``n`` source lines making most of them (``{"count", "where": {"file:line": calls}}``)."""
    import warnings
    from collections import Counter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync()
    where = Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught
                    if "synchroniz" in str(w.message))
    return {"count": sum(where.values()), "where": dict(where.most_common(n))}


def _profile_top(step, sync, cuda: bool, table: Path | None = None, n: int = 15) -> list[dict]:
    """One more step under torch.profiler: the ``n`` aten ops with the most self time (device
    time on CUDA, CPU time otherwise), to see where a step goes; ``table``: also torch's op
    table of the step in that file."""
    from torch.profiler import profile

    from moe_rl.profiling import activities, top_ops, write_ops_table

    with profile(activities=activities(cuda)) as prof:
        step()
        sync()
    if table is not None:
        write_ops_table(prof, cuda, table)
    return top_ops(prof, cuda, n)


def _compare(args) -> int:
    """Native tokens/s of this checkout vs ``--baseline`` DIR, alternating fresh processes."""
    here = str(Path(__file__).resolve().parents[3])
    driver = ("import runpy, sys; sys.argv = sys.argv[1:]; "
              f"runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')")
    cmd = [sys.executable, "-c", driver, "bench", "--preset", args.preset, "--device", args.device, "--dtype",
           args.dtype, "--backends", "native", "--steps", str(args.steps), "--warmup", str(args.warmup), "--json"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    runs = {"this": [], "baseline": []}
    cpu_runs = {"this": [], "baseline": []}
    for r in range(args.rounds):
        for side in (("this", "baseline") if r % 2 == 0 else ("baseline", "this")):
            # the side's checkout first; the rest of PYTHONPATH (e.g. wheels unpacked into a folder) kept
            root = here if side == "this" else args.baseline
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
            out = subprocess.run(cmd, env=env, cwd="/tmp", capture_output=True, text=True)
            if out.returncode:
                print(out.stdout + out.stderr, file=sys.stderr)
                return out.returncode
            native = json.loads(out.stdout)["native"]
            runs[side].append(native["tokens_per_s"])
            cpu_runs[side].append(native["tokens_per_cpu_s"])
            print(f"round {r}: {side:8s} {native['tokens_per_s']:8.1f} tok/s  "
                  f"{native['tokens_per_cpu_s']:8.1f} tok/CPU-s  (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    # the machine may be shared: each round's two runs are adjacent in time, so the median of the
    # per-round ratios is the figure to quote; tokens per CPU-second (this process's CPU time)
    # is steadier than wall time when other processes take the cores
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = [a / b for a, b in zip(runs["this"], runs["baseline"])]
    cpu_ratios = [a / b for a, b in zip(cpu_runs["this"], cpu_runs["baseline"])]
    result = dict(preset=args.preset, device=args.device, dtype=args.dtype, threads=args.threads,
                  baseline=args.baseline, runs=runs, cpu_runs=cpu_runs, median_tokens_per_s=med,
                  round_ratios=ratios, speedup=statistics.median(ratios), round_cpu_ratios=cpu_ratios,
                  cpu_speedup=statistics.median(cpu_ratios), load=os.getloadavg())
    print(json.dumps(result, indent=2) if args.json else
          f"native tokens/s over {args.rounds} rounds: this {med['this']:.1f}, baseline {med['baseline']:.1f} "
          f"(medians); per-round ratios {', '.join(f'{r:.2f}' for r in ratios)} -> median "
          f"{result['speedup']:.2f}x; per CPU-second {', '.join(f'{r:.2f}' for r in cpu_ratios)} -> median "
          f"{result['cpu_speedup']:.2f}x  (load {result['load'][0]:.2f})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: medium (cuda), small (cpu)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bf16 (cuda), fp32 (cpu)")
    ap.add_argument("--backends", default=None, help=f"comma list of {', '.join(BACKENDS)}, run in that order; default "
                    "all (cuda), native (cpu)")
    ap.add_argument("--compile", choices=["auto", "true", "false"], default="auto",
                    help="train.compile of the native and native_fused rows (auto: on with --device cuda)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recompute", action="store_true", help="also measure megatron_recompute (full activation recompute)")
    ap.add_argument("--peak-tflops", type=float, help="dense peak for MFU (default: by device name on CUDA)")
    ap.add_argument("--baseline", help="another checkout's root: compare its native tokens/s with this one's")
    ap.add_argument("--rounds", type=int, default=3, help="--baseline: alternating runs per side")
    ap.add_argument("--threads", type=int, help="torch CPU threads (1 is steadier on a shared machine)")
    ap.add_argument("--profile", action="store_true", help="also profile one step per backend (top ops in the JSON)")
    ap.add_argument("--profile-dir", type=Path, help="with --profile (implied): torch.profiler's op table of each "
                    "backend's profiled step in DIR/<backend>_ops.txt")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON result here")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.profile = args.profile or args.profile_dir is not None
    table = (lambda name: args.profile_dir / f"{name}_ops.txt") if args.profile_dir else (lambda name: None)
    args.preset = args.preset or ("medium" if cuda else "small")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    if cuda and not torch.cuda.is_available():
        print("bench: --device cuda needs a CUDA GPU (use --device cpu)", file=sys.stderr)
        return 2
    if args.baseline:
        return _compare(args)
    backends = (args.backends or (",".join(BACKENDS) if cuda else "native")).split(",")
    if args.recompute and "megatron_recompute" not in backends:
        backends.append("megatron_recompute")
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        print(f"bench: unknown --backends {sorted(unknown)} ({', '.join(BACKENDS)})", file=sys.stderr)
        return 2
    compile_mode = {"auto": "auto", "true": True, "false": False}[args.compile]

    import torch.distributed as dist

    from moe_rl.model import MoEForCausalLM, hf_state_dict, iter_local_hf_tensors
    from moe_rl.train.backend import NativeBackend

    preset = PRESETS[args.preset]
    mbs = _batch(preset)
    flops = model_flops(preset)
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = args.peak_tflops or (peak_tflops(device_name) if cuda else None)
    result = dict(device=device_name, torch=torch.__version__, preset=args.preset, dtype=args.dtype,
                  threads=torch.get_num_threads(),
                  backends=backends, steps=args.steps, arch=preset["arch"], model_flops=flops,
                  peak_tflops=peak)
    if any(b.startswith("megatron") for b in backends):
        from moe_rl.train.megatron import MegatronBackend
        from moe_rl.train.megatron.model import cpu_forward_shims

        if cuda:
            torch.cuda.set_device(0)
        if not dist.is_initialized():  # one rank: an in-process store, no port to collide on
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            import megatron.core

            result["megatron_core"] = megatron.core.__version__
        except Exception:
            pass
    arch = _cfg(preset, "native", args.dtype, False, args.device).model.arch()
    hf = hf_state_dict(MoEForCausalLM(arch).init_weights(0)) if any(b.startswith("megatron") for b in backends) else None

    def save() -> None:
        if args.out:  # what is measured so far survives a run stopped by a time cap
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    def run_backend(name: str) -> None:
        """Builds, measures and frees one backend; a failure is recorded in its row (and the exit
        code) and the other backends are still measured. The row is saved as it fills: its build
        time, its first step's, then the timed figures ("stopped" says where a cut run ended)."""
        t0 = time.perf_counter()
        partial = {"stopped": "while building the model"}

        def progress(figures: dict) -> None:
            result[name] = {**partial, **figures}
            save()

        try:
            progress({})
            if name in NATIVE_ROWS:
                comp, loss_path, graphs = NATIVE_ROWS[name]
                cfg = _cfg(preset, "native", args.dtype, False, args.device, compile_mode if comp is None else comp,
                           graphs)
                backend = NativeBackend(cfg)
                if hf is not None:
                    with torch.no_grad():
                        for n, t in iter_local_hf_tensors(backend.model):
                            t.copy_(hf[n])
                partial = {"build_s": time.perf_counter() - t0, "compiled": getattr(backend, "compiled", False)}
                progress({"stopped": "during the first step"})
                row = _measure(backend, mbs, args.steps, args.warmup, flops["flops"], peak, args.profile,
                               table(name), loss_path, cfg.algo, progress)
                row = dict(row, build_s=partial["build_s"], compiled=partial["compiled"])
                first = row["first_step_s"]
                row["compile_s"] = first - row["step_s"] if row["compiled"] and first else None
                result[name] = row
            else:
                with (cpu_forward_shims() if not cuda else contextlib.nullcontext()):
                    cfg = _cfg(preset, "megatron", args.dtype, name == "megatron_recompute", args.device)
                    backend = MegatronBackend(cfg, None, hf_state=hf)
                    result["megatron_spec"] = "te" if backend.opts.use_te else "local"
                    result["megatron_experts"] = backend.experts_desc()
                    partial = {"build_s": time.perf_counter() - t0}
                    progress({"stopped": "during the first step"})
                    row = _measure(backend, mbs, args.steps, args.warmup, flops["flops"], peak,
                                   args.profile, table(name), "general", cfg.algo, progress)
                    result[name] = dict(row, build_s=partial["build_s"])
        except Exception as exc:
            traceback.print_exc()
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        backend = None
        torch._dynamo.reset()  # each row compiles its own graphs; frees the CUDA graph trees' pool too
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def ratios() -> set:
        ok = {k for k in backends if k in result and "error" not in result[k]}
        if {"native", "megatron"} <= ok:
            result["speedup"] = result["megatron"]["tokens_per_s"] / result["native"]["tokens_per_s"]
        if {"megatron", "megatron_recompute"} <= ok:  # the issue's target: <= 1.4 on a GPU
            result["recompute_step_ratio"] = result["megatron_recompute"]["step_s"] / result["megatron"]["step_s"]
            result["recompute_cpu_ratio"] = result["megatron_recompute"]["cpu_s"] / result["megatron"]["cpu_s"]
        if {"native", "native_eager"} <= ok:  # train.compile's effect (> 1: compiled is faster)
            result["compile_speedup"] = result["native_eager"]["step_s"] / result["native"]["step_s"]
        if {"native", "native_fused"} <= ok:  # train.fused_loss's effect, same blocks
            result["fused_loss_speedup"] = result["native"]["step_s"] / result["native_fused"]["step_s"]
        if {"native", "native_graphs"} <= ok:  # train.cuda_graphs's effect, same blocks
            result["cuda_graphs_speedup"] = result["native"]["step_s"] / result["native_graphs"]["step_s"]
        return ok

    for name in dict.fromkeys(backends):  # in the order asked: a time cap cuts the last rows
        run_backend(name)
        ratios()
        save()
    ok = ratios()

    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        print(f"{result['device']}  preset={args.preset} dtype={args.dtype} tokens/step={flops['tokens']} "
              f"active params={flops['active_params'] / 1e6:.0f}M model TFLOP/step={flops['flops'] / 1e12:.2f} "
              f"peak={peak or '?'} TFLOP/s")
        for k in backends:
            r = result[k]
            if "error" in r:
                print(f"  {k:12s} failed: {r['error']}")
                continue
            mfu = f"MFU {100 * r['mfu']:5.1f}%" if r["mfu"] is not None else "MFU n/a (no --peak-tflops)"
            mem = f"peak {r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else ""
            print(f"  {k:12s} {r['tokens_per_s']:>10.0f} tok/s  step {r['step_s'] * 1e3:8.1f} ms  "
                  f"{r['model_tflops_per_s']:7.2f} TFLOP/s  {mfu}  {mem}")
        if "speedup" in result:
            print(f"  megatron/native: {result['speedup']:.2f}x  (megatron spec: {result['megatron_spec']})")
        if "megatron_experts" in result:
            print(f"  megatron experts: {result['megatron_experts']}")
        if "compile_speedup" in result:
            both = "" if result["native"]["compiled"] else " (native is eager too: --compile auto is off on a CPU)"
            print(f"  native eager/compiled step time: {result['compile_speedup']:.2f}x{both}")
        if "fused_loss_speedup" in result:
            print(f"  native general/fused loss step time: {result['fused_loss_speedup']:.2f}x")
        if "cuda_graphs_speedup" in result:
            print(f"  native compiled/graphed step time: {result['cuda_graphs_speedup']:.2f}x")
        if "recompute_step_ratio" in result:
            print(f"  megatron step with / without full recompute: {result['recompute_step_ratio']:.2f}x "
                  f"(CPU-seconds {result['recompute_cpu_ratio']:.2f}x)")
    if any(b.startswith("megatron") for b in backends):
        from moe_rl.train.megatron.model import destroy_parallel_state

        destroy_parallel_state()  # megatron's groups die with the process group: leave no stale state
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok == set(backends) else 1


if __name__ == "__main__":
    sys.exit(main())

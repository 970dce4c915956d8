"""Tokens/s of one training step, native backend vs megatron backend, on one GPU.

    python -m moe_rl.train.megatron.bench [--preset medium] [--json] [--out FILE]

One step = forward (routing replayed from a fixed record), a policy-gradient surrogate loss,
backward over every micro-batch, then ``optimizer_step``. Both backends start from the same
weights (the native seeded init) and see the same batch; each is built, warmed up, timed and
freed in turn. Figures go to docs/benchmarks.md ("Megatron backend (issue 8)").
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

PRESETS = {
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
}


def _cfg(preset: dict, backend: str, dtype: str, recompute: bool, device: str = "cuda"):
    from moe_rl.config import ExperimentConfig

    return ExperimentConfig.model_validate(dict(
        model=dict(preset["arch"], dtype=dtype, max_position_embeddings=4096, rope_theta=1_000_000.0),
        pools=dict(trainer=1, rollout=0), engine=dict(kind="sglang", urls=["http://127.0.0.1:1"]),
        train=dict(backend=backend, device=device, lr=1e-5, megatron_recompute=recompute,
                   megatron_dispatcher="alltoall" if device == "cuda" else "allgather"),
    ))


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


def _measure(backend, mbs, steps: int, warmup: int) -> dict:
    n_loss = sum(int((mb.labels != -100).sum()) for mb in mbs)
    tokens = sum(mb.num_tokens for mb in mbs)
    cuda = backend.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    adv = [torch.ones(mb.num_tokens, device=backend.device) for mb in mbs]

    def step():
        for mb, a in zip(mbs, adv):
            lp, _ = backend.logprobs(mb, 1.0)
            (-(a * lp).sum() / n_loss).backward()
        backend.optimizer_step()

    for _ in range(warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    mean = sum(times) / len(times)
    return dict(tokens_per_step=tokens, step_s=mean, step_s_min=min(times), tokens_per_s=tokens / mean,
                peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="medium")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recompute", action="store_true", help="megatron: full activation recompute")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON result here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU", file=sys.stderr)
        return 2

    import torch.distributed as dist

    from moe_rl.model import MoEForCausalLM, hf_state_dict, iter_local_hf_tensors
    from moe_rl.train.backend import NativeBackend
    from moe_rl.train.megatron import MegatronBackend

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    preset = PRESETS[args.preset]
    mbs = _batch(preset)
    arch = _cfg(preset, "native", args.dtype, False).model.arch()
    hf = hf_state_dict(MoEForCausalLM(arch).init_weights(0))
    result = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, preset=args.preset,
                  dtype=args.dtype, recompute=args.recompute, steps=args.steps, arch=preset["arch"])
    try:
        import megatron.core

        result["megatron_core"] = megatron.core.__version__
    except Exception:
        pass

    native = NativeBackend(_cfg(preset, "native", args.dtype, False))
    with torch.no_grad():
        for name, t in iter_local_hf_tensors(native.model):
            t.copy_(hf[name])
    result["native"] = _measure(native, mbs, args.steps, args.warmup)
    del native
    gc.collect()
    torch.cuda.empty_cache()

    meg = MegatronBackend(_cfg(preset, "megatron", args.dtype, args.recompute), None, hf_state=hf)
    result["megatron_spec"] = "te" if meg.opts.use_te else "local"
    result["megatron"] = _measure(meg, mbs, args.steps, args.warmup)
    result["speedup"] = result["megatron"]["tokens_per_s"] / result["native"]["tokens_per_s"]

    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        print(f"{result['device']}  preset={args.preset} dtype={args.dtype} tokens/step={result['native']['tokens_per_step']}")
        for k in ("native", "megatron"):
            r = result[k]
            print(f"  {k:9s} {r['tokens_per_s']:>10.0f} tok/s  step {r['step_s'] * 1e3:8.1f} ms  peak {r['peak_mem_gib']:.1f} GiB")
        print(f"  megatron/native: {result['speedup']:.2f}x  (megatron spec: {result['megatron_spec']})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

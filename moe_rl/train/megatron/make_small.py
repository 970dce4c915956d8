"""Writes a seeded random Qwen3-MoE checkpoint (HF format) for trying the megatron backend.

    python -m moe_rl.train.megatron.make_small OUT_DIR [--preset medium] [--dtype bfloat16]

Presets are the benchmark's (moe_rl.train.megatron.bench.PRESETS): "small" (~10M parameters)
and "medium" (~0.5B, Qwen3-MoE-shaped). The weights are the native model's seeded init, which
is also what the megatron backend starts from when no model.path is set.
"""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    from moe_rl.model import MoEArch, MoEForCausalLM, save_hf

    from .bench import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="medium")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    arch = MoEArch(**PRESETS[args.preset]["arch"], max_position_embeddings=4096, rope_theta=1_000_000.0)
    model = MoEForCausalLM(arch).init_weights(args.seed).to(getattr(torch, args.dtype))
    path = save_hf(model, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {path} ({n / 1e6:.0f}M parameters, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

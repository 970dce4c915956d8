"""Compile every Triton kernel of moe_rl for an H100/H200 (sm_90) on a machine without a GPU.

The CPU suite runs the kernels under ``TRITON_INTERPRET=1``, which executes their Python with
numpy and accepts code that the real compiler rejects, and never sees the GPU configurations
(the Hopper autotune configs, the 128x128x64 grouped-GEMM tiles, ``DOT_FP32=False``). Triton's
wheel carries its LLVM and ``ptxas``, so the GPU build can be made here: each kernel's launcher is
called on CPU tensors with the kernel replaced by a recorder; the recorder specialises the call
exactly as ``JITFunction.run`` would on a GPU (Triton's own binder: dtypes, 16-byte alignment,
integers divisible by 16 or equal to 1) and compiles it for ``GPUTarget("cuda", 90, 32)`` with
every config the GPU path would try, down to a cubin. Nothing is launched, so the launchers' CPU
outputs are garbage and are not looked at.

Run it without ``TRITON_INTERPRET`` (the GPU branch of each module must be the one imported):
``python tests/kernels/sm90_compile.py [--json OUT]``; tests/kernels/test_sm90_compile.py runs it
in a subprocess. Per compile: kernel, dtype, constexpr variant, config, shared memory (bytes),
registers and stack (bytes of local memory per thread, from ``cuobjdump -res-usage``: register
spills), whether the K loop was software-pipelined (multi-buffered shared memory), seconds.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# The largest dynamic shared memory one block may use on sm_90 (227 KiB): a config above it
# fails at launch with OutOfResources (an autotuner drops it; a plain launch crashes).
SM90_MAX_SHARED = 232448


def _target():
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", 90, 32)


def _cuobjdump() -> str:
    """Triton's wheel carries cuobjdump beside its ptxas (3.6 and 3.9); else the CUDA toolkit's."""
    from triton.backends.nvidia import compiler
    bundled = Path(compiler.__file__).parent / "bin" / "cuobjdump"
    found = str(bundled) if bundled.exists() else shutil.which("cuobjdump")
    if found is None:
        raise RuntimeError("sm90_compile: no cuobjdump (neither in Triton's wheel nor on PATH)")
    return found


def res_usage(cubin: bytes) -> dict:
    """Registers and stack (bytes of local memory per thread: register spills, or arrays the
    compiler could not keep in registers) of the one kernel in ``cubin``, from
    ``cuobjdump -res-usage``. A GEMM tile whose stack is not 0 spills its accumulators or
    operands to local memory on every K step, which costs far more than a smaller tile."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", out)
    if m is None:
        raise RuntimeError(f"sm90_compile: cannot read cuobjdump -res-usage's output: {out[:500]!r}")
    return {"regs": int(m.group(1)), "stack": int(m.group(2))}


class Recorder:
    """Stands in for a module's kernel (a JITFunction or an Autotuner): ``kernel[grid](...)``
    compiles the call for sm_90 with each config the GPU path would run, and launches nothing."""

    def __init__(self, name: str, kernel, results: list):
        self.name, self.kernel, self.results = name, kernel, results

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.compile_call(args, kwargs)

    def compile_call(self, args, kwargs):
        import triton
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature
        target = _target()
        backend = make_backend(target)
        tuned = isinstance(self.kernel, triton.runtime.Autotuner)
        fn = self.kernel.fn if tuned else self.kernel  # (a JITFunction's own .fn is the Python function)
        configs = self.kernel.configs if tuned else [None]
        if tuned and self.kernel.early_config_prune is not None:  # the configs the autotuner would try
            configs = self.kernel.early_config_prune(configs, dict(zip(fn.arg_names, args)), **kwargs)
        dtype = next(str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor))
        variant = ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items()) if isinstance(v, bool))
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        for cfg in configs:
            kw = dict(kwargs, debug=False)
            if cfg is not None:
                kw.update(cfg.all_kwargs())
            label = ", ".join(f"{k}={v}" for k, v in sorted(kw.items())
                              if k.startswith(("BLOCK", "num_warps", "num_stages")))
            row = {"kernel": self.name, "dtype": dtype, "variant": variant, "config": label, "ok": False}
            t0 = time.perf_counter()
            try:
                bound, spec, options = binder(*args, **kw)
                options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, options)
                compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                          options=options.__dict__)
                ttgir = compiled.asm["ttgir"]
                row.update(ok=True, shared=int(compiled.metadata.shared),
                           pipelined=bool(re.search(r"local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<\d+x", ttgir)),
                           signature={k: v for k, v in signature.items() if v != "constexpr"},
                           **res_usage(compiled.asm["cubin"]))
            except Exception as e:  # reported per config, the caller decides
                row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            row["seconds"] = round(time.perf_counter() - t0, 2)
            self.results.append(row)
            print(f"  {self.name} {dtype} ({variant}) [{row['config']}]: " + (
                f"shared {row['shared']} B, {row['regs']} registers, stack {row['stack']} B, "
                f"pipelined {row['pipelined']}, {row['seconds']} s" if row["ok"]
                else row["error"].splitlines()[0][:300]), file=sys.stderr, flush=True)


def _patch(module, names: list[str], results: list):
    for n in names:
        setattr(module, n, Recorder(n, getattr(module, n), results))


# every Triton kernel the package launches on a GPU, by module (a new one belongs here and in
# drive_every_launch)
LAUNCHES = {"moe_rl.kernels.fused_logprobs": ["_fwd_launch", "_dlogits_launch"],
            "moe_rl.kernels.fused_token_loss": ["_probs_launch", "_dz_kernel"],
            "moe_rl.kernels.grouped_gemm": ["_gmm_kernel", "_gmm_wgrad_kernel"],
            "moe_rl.kernels.bucket_pack": ["_bucket_copy_kernel"],
            "moe_rl.kernels.gated_delta": ["_gdn_scan_fwd_kernel", "_gdn_scan_bwd_kernel"]}


def run_all() -> list[dict]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("sm90_compile: unset TRITON_INTERPRET (the GPU branch of each kernel module must be imported)")
    results: list[dict] = []
    for module, names in LAUNCHES.items():
        _patch(importlib.import_module(module), names, results)
    drive_every_launch()
    _compile_exact_kernels(results)
    return results


def drive_every_launch() -> None:
    """Calls each kernel's launcher the way the GPU path does, on CPU tensors, with whatever the
    caller put in place of the kernels (LAUNCHES): nothing here reads the outputs."""
    fl = importlib.import_module("moe_rl.kernels.fused_logprobs")
    ftl = importlib.import_module("moe_rl.kernels.fused_token_loss")
    gg = importlib.import_module("moe_rl.kernels.grouped_gemm")
    bp = importlib.import_module("moe_rl.kernels.bucket_pack")
    gd = importlib.import_module("moe_rl.kernels.gated_delta")
    torch.manual_seed(0)

    # The LM head in bf16 (its 16-bit configs) and fp32 (its own: e.g. configs/gpu_1x.yaml's
    # trainer), shapes divisible by 16 as in training.
    n, h, v = 256, 128, 1024
    labels = torch.randint(0, v, (n,))
    inv_t = 1.0

    def token_loss(logp, ent_, rows):
        return logp + (ent_ if ent_ is not None else 0.0)
    for dt in (torch.bfloat16, torch.float32):
        hidden = torch.randn(n, h, dtype=dt)
        weight = torch.randn(v, h, dtype=dt)
        # forward partials (with entropy), then the backward's d_logits with both upstream
        # gradients; 16-bit tracks the rounding of d_logits (TRACK_ERR), fp32 is exact
        fl._partials_triton(hidden, weight, labels, inv_t, True)
        mx = torch.zeros(n); log_s = torch.zeros(n); ent = torch.zeros(n)
        out = torch.empty(n, v, dtype=dt)
        err = torch.zeros(v // fl._ERR_GROUP, n) if dt != torch.float32 else None
        fl._dlogits_triton(hidden, weight, labels, mx, log_s, ent, torch.ones(n), torch.ones(n), 0, inv_t, out, err)
        if dt != torch.float32:
            fl._dlogits_triton(hidden, weight, labels, mx, log_s, None, torch.ones(n), None, 0, inv_t, out, None)
        # the fused policy loss: the whole Triton path (probabilities, d_logits), loss and gradients
        ftl_plan = ftl._plan_fused(n, h, v, dt.itemsize)
        ftl._fused_triton(hidden, weight, labels, labels < 0, token_loss, inv_t, True, ftl_plan, None, True, True)

    # grouped GEMM (the MoE experts): every dtype the Triton path serves, forward and weight grad
    # (float32's row tile follows the mean group: 16 rows at 16 a group, 64 at 128 a group)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for rows in (64, 512):
            x = torch.randn(rows, 128, dtype=dt)
            w = torch.randn(4, 256, 128, dtype=dt)
            offs = torch.arange(1, 5, dtype=torch.int32) * (rows // 4)
            gg._gmm_triton(x, w, offs)
            gg._gmm_wgrad_triton(torch.randn(rows, 256, dtype=dt), x, offs)

    # the weight-sync bucket copy
    tensors = [torch.randn(300, dtype=torch.bfloat16), torch.randn(64, 32, dtype=torch.bfloat16)]
    plan = bp.BucketCopy(tensors, [0, 320], torch.bfloat16)
    flat = torch.empty(320 + 64 * 32, dtype=torch.bfloat16)
    plan.pack(flat)

    # Gated DeltaNet's chunk scan at Qwen3-Next's / Qwen3.5's head dims (Dk = Dv = 128), fp32:
    # the forward, and the backward (which re-runs the forward storing each chunk's state)
    NC, H, C, D = 4, 2, gd.CHUNK, 128
    qg, kd, w = (torch.randn(NC, H, C, D) for _ in range(3))
    u, aqk, decay = torch.randn(NC, H, C, D), torch.randn(NC, H, C, C), torch.rand(NC, H)
    first, nch, s0 = torch.tensor([0, 1]), torch.tensor([1, 3]), torch.randn(2, H, D, D)
    gd._scan_fwd_triton(qg, kd, w, u, aqk, decay, first, nch, s0)
    gd._scan_bwd_triton(qg, kd, w, u, aqk, decay, first, nch, s0, torch.randn(NC, H, C, D), torch.randn(2, H, D, D))


def _compile_exact_kernels(results: list) -> None:
    """The batch-invariant ("exact") kernels: the one config of each dtype (grouped GEMM: above)."""
    ex = {n: importlib.import_module(f"moe_rl.kernels.exact.{n}") for n in ("linear", "norm", "softmax", "attention", "moe")}
    _patch(ex["linear"], ["_exact_linear_kernel"], results)
    _patch(ex["norm"], ["_exact_rms_norm_kernel"], results)
    _patch(ex["softmax"], ["_exact_softmax_kernel"], results)
    _patch(ex["attention"], ["_exact_attention_kernel"], results)
    _patch(ex["moe"], ["_exact_combine_kernel"], results)
    for dt in (torch.float32, torch.bfloat16):
        x, w = torch.randn(64, 128, dtype=dt), torch.randn(96, 128, dtype=dt)
        ex["linear"]._linear_triton(x, w, torch.randn(96, dtype=dt))
        ex["norm"]._rms_norm_triton(x, torch.ones(128, dtype=dt), torch.empty_like(x), 1e-6)
        ex["softmax"]._softmax_triton(x, torch.empty(64, 128), None, True)
        ex["softmax"]._softmax_triton(x, torch.empty(64), torch.zeros(64, dtype=torch.long), True)
        q, kc = torch.randn(48, 8, 128, dtype=dt), torch.randn(4, 512, 2, 128, dtype=dt)
        cu = torch.tensor([0, 16, 47, 48], dtype=torch.int32)
        ex["attention"]._attention_triton(q, kc, kc, torch.empty_like(q), cu, torch.tensor([0, 3, 7], dtype=torch.int32),
                                          torch.tensor([0, 1, 3]), torch.zeros(3, dtype=torch.long), 0.1, 64,
                                          torch.zeros(8))
        ex["moe"]._combine_triton(torch.randn(128, 128, dtype=dt), torch.rand(64, 2), torch.empty(64, 128, dtype=dt))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the per-compile rows here")
    a = ap.parse_args(argv)
    import triton
    print(f"triton {triton.__version__}, torch {torch.__version__}: compiling for sm_90", file=sys.stderr)
    rows = run_all()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"triton": triton.__version__, "max_shared": SM90_MAX_SHARED, "rows": rows}, f, indent=1)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows)} compiles, {len(bad)} failed", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

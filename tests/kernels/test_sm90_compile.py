"""Every Triton kernel of moe_rl compiles for an H100/H200 (sm_90) with the configs its GPU path
runs, checked on a CPU machine (tests/kernels/sm90_compile.py: Triton's own binder and compiler,
down to ptxas; nothing launched).

Why: the rest of the CPU suite runs the kernels under TRITON_INTERPRET=1, which never compiles
them and never sees their GPU configs; a kernel that only the interpreter has run can fail to
build on its first GPU (tl.dot shapes, shared memory per config, dtype rules). This test catches
that in CI, against the installed Triton (3.9 on the CPU machines; the H200 image has 3.6, checked
by hand: docs/gpu.md). The planted cases show the checks can fail: a kernel the interpreter
runs that does not compile, and a tile that spills registers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "sm90_compile.py"
# every Triton kernel the package launches on a GPU (a new one belongs in sm90_compile.LAUNCHES)
KERNELS = {"_fwd_launch", "_dlogits_launch", "_probs_launch", "_dz_kernel", "_gmm_kernel",
           "_gmm_wgrad_kernel", "_bucket_copy_kernel", "_gdn_scan_fwd_kernel", "_gdn_scan_bwd_kernel"}
GEMMS = {"_fwd_launch", "_dlogits_launch", "_probs_launch", "_gmm_kernel", "_gmm_wgrad_kernel"}
# the batch-invariant ("exact") kernels, moe_rl.kernels.exact
KERNELS |= {"_exact_linear_kernel", "_exact_rms_norm_kernel", "_exact_softmax_kernel", "_exact_attention_kernel",
            "_exact_combine_kernel"}
GEMMS |= {"_exact_linear_kernel"}
# Known spills, bytes of stack per thread at most: a spill in any other kernel fails. The
# forward's 128 x 128 bf16 tiles keep 8 bytes on the stack with Triton 3.9 (CI's), none with 3.6
# (the GPU image's).
KNOWN_SPILLS: dict[str, int] = {"_fwd_launch": 8}


def _nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except Exception:
        return False
    ptxas = Path(compiler.__file__).parent / "bin" / "ptxas"
    return ptxas.exists()


pytestmark = pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its NVIDIA backend / ptxas")


def _env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the GPU branch of each kernel module
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


def test_every_kernel_compiles_for_sm90_with_its_gpu_configs(tmp_path):
    out = tmp_path / "sm90.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], env=_env(),
                       capture_output=True, text=True, timeout=600)
    assert out.exists(), p.stderr[-4000:]
    report = json.loads(out.read_text())
    rows, max_shared = report["rows"], report["max_shared"]
    failed = [(r["kernel"], r["config"], r["error"][:500]) for r in rows if not r["ok"]]
    assert not failed, failed
    assert p.returncode == 0, p.stderr[-4000:]
    assert {r["kernel"] for r in rows} == KERNELS
    too_big = [(r["kernel"], r["config"], r["shared"]) for r in rows if r["shared"] > max_shared]
    assert not too_big, f"configs over sm_90's {max_shared} B of shared memory: {too_big}"
    # no register spills: a config whose cubin uses stack (local memory) reloads its tile from
    # memory on every K step (the LM head's 128x256 bf16 tiles spilled 0.4-1.2 KB per thread)
    spills = [(r["kernel"], r["dtype"], r["variant"], r["config"], r["stack"]) for r in rows
              if r["stack"] > KNOWN_SPILLS.get(r["kernel"], 0)]
    assert not spills, f"configs with stack (spilled registers) on sm_90: {spills}"
    # the LM head is built for both operand widths, each with its own configs
    lm_head = {"_fwd_launch", "_dlogits_launch", "_probs_launch", "_dz_kernel"}
    assert {(r["kernel"], r["dtype"]) for r in rows if r["kernel"] in lm_head} == {
        (k, d) for k in lm_head for d in ("bfloat16", "float32")}
    # the GEMM K loops are software-pipelined (multi-buffered), as they are when a GPU launch
    # specialises 16-byte-aligned pointers and strides: the binder saw what a GPU would
    unpiped = [(r["kernel"], r["config"]) for r in rows if r["kernel"] in GEMMS and not r["pipelined"]]
    assert not unpiped, unpiped


def test_the_stack_check_sees_a_tile_that_spills(tmp_path):
    # a 256x256 fp32 accumulator on 4 warps is 512 registers per thread, twice what sm_90 has
    code = textwrap.dedent(f"""
        import sys, torch, triton, triton.language as tl
        sys.path.insert(0, {str(HERE)!r})
        from sm90_compile import Recorder

        @triton.jit
        def big_tile(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
            m = tl.arange(0, BM); n = tl.arange(0, BN); k = tl.arange(0, BK)
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                a = tl.load(a_ptr + m[:, None] * K + (k0 + k)[None, :])
                b = tl.load(b_ptr + (k0 + k)[:, None] * BN + n[None, :])
                acc = tl.dot(a, b, acc)
            tl.store(c_ptr + m[:, None] * BN + n[None, :], acc)

        rows = []
        a = torch.zeros(256, 64, dtype=torch.bfloat16); b = torch.zeros(64, 256, dtype=torch.bfloat16)
        Recorder("big_tile", big_tile, rows)[(1,)](a, b, torch.zeros(256, 256), 64, BM=256, BN=256, BK=16,
                                                   num_warps=4)
        print(rows[0]["ok"], rows[0].get("stack"), rows[0].get("regs"))
    """)
    planted = tmp_path / "planted_spill.py"
    planted.write_text(code)
    p = subprocess.run([sys.executable, str(planted)], env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ok, stack, regs = p.stdout.split()
    assert ok == "True" and int(stack) > 0 and int(regs) <= 255, p.stdout


def test_the_check_fails_on_a_kernel_only_the_interpreter_runs(tmp_path):
    # tl.dot needs K >= 16 on the tensor cores; the interpreter (numpy) multiplies anyway
    code = textwrap.dedent(f"""
        import sys, torch, triton, triton.language as tl
        sys.path.insert(0, {str(HERE)!r})
        from sm90_compile import Recorder

        @triton.jit
        def bad(a_ptr, b_ptr, c_ptr, BM: tl.constexpr, BK: tl.constexpr):
            r = tl.arange(0, BM); k = tl.arange(0, BK)
            a = tl.load(a_ptr + r[:, None] * BK + k[None, :])
            b = tl.load(b_ptr + k[:, None] * BM + r[None, :])
            tl.store(c_ptr + r[:, None] * BM + r[None, :], tl.dot(a, b))

        rows = []
        a = torch.zeros(64, 8, dtype=torch.bfloat16); b = torch.zeros(8, 64, dtype=torch.bfloat16)
        Recorder("bad", bad, rows)[(1,)](a, b, torch.zeros(64, 64), BM=64, BK=8)
        print("OK" if rows[0]["ok"] else "FAILED:" + rows[0]["error"][:200])
    """)
    planted = tmp_path / "planted.py"  # triton.jit reads the kernel's source from its file
    planted.write_text(code)
    p = subprocess.run([sys.executable, str(planted)], env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().startswith("FAILED:"), p.stdout

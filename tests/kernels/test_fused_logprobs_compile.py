"""The fused LM-head Triton kernels compile for Hopper (sm_90) on a machine without a GPU.

The interpreter checks the maths; this checks that the real compiler accepts the kernels and
that the bf16 build is what the design needs: wgmma tensor-core dots and cp.async pipelining
in the GEMM kernels (every autotune config), no register spills, shared memory within an
H100's 227 KiB. It uses the ptxas shipped in the Triton wheel, in a subprocess without
TRITON_INTERPRET. Where a GPU exists the GPU tests compile and run the kernels for real, so
this one is skipped there.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import importlib, json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fl = importlib.import_module("moe_rl.kernels.fused_logprobs")
    ft = importlib.import_module("moe_rl.kernels.fused_token_loss")

    def build(fn, sig, consts, meta, num_warps, num_stages):
        # what a launch specialises: unit strides become constants, pointers and leading
        # strides are 16-divisible
        sig, consts = dict(sig), dict(consts)
        for name in ("stride_hk", "stride_wk", "stride_dn", "stride_en"):
            if name in sig:
                sig[name] = "constexpr"
                consts[name] = 1
        names = list(sig)
        div = [["tt.divisibility", 16]]
        attrs = {(i,): div for i, n in enumerate(names)
                 if n.endswith("_ptr") or n in ("stride_hn", "stride_wv", "stride_dm", "stride_em",
                                                 "stride_sg", "H")}
        consts.update(meta)
        k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps, "num_stages": num_stages})
        return {"smem": k.metadata.shared, "wgmma": "warp_group_dot" in k.asm["ttgir"],
                "async_copy": "async_copy" in k.asm["ttgir"],
                "local": k.asm["ptx"].count(".local")}

    i32, f32 = "i32", "fp32"
    const = lambda *names: {k: "constexpr" for k in names}
    tile = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "DOT_FP32")
    fwd = {"h_ptr": "*bf16", "w_ptr": "*bf16", "labels_ptr": "*i64", "m_ptr": "*fp32",
           "s_ptr": "*fp32", "u_ptr": "*fp32", "zy_ptr": "*fp32", "N": i32, "V": i32, "H": i32,
           "stride_hn": i32, "stride_hk": i32, "stride_wv": i32, "stride_wk": i32, "inv_t": f32,
           **const("SPLIT_V", "COMPUTE_ENTROPY", *tile)}
    bwd = {"h_ptr": "*bf16", "w_ptr": "*bf16", "labels_ptr": "*i64", "mx_ptr": "*fp32",
           "logs_ptr": "*fp32", "ent_ptr": "*fp32", "gl_ptr": "*fp32", "ge_ptr": "*fp32",
           "dz_ptr": "*bf16", "err_ptr": "*fp32", "R": i32, "C": i32, "H": i32, "v_off": i32,
           "stride_hn": i32, "stride_hk": i32, "stride_wv": i32, "stride_wk": i32,
           "stride_dm": i32, "stride_dn": i32, "stride_eg": i32, "inv_t": f32,
           **const("HAS_GL", "HAS_GE", "TRACK_ERR", "ERR_GROUP", *tile)}
    probs = {"h_ptr": "*bf16", "w_ptr": "*bf16", "labels_ptr": "*i64", "e_ptr": "*bf16",
             "m_ptr": "*fp32", "s_ptr": "*fp32", "u_ptr": "*fp32", "zy_ptr": "*fp32",
             "R": i32, "V": i32, "H": i32, "stride_hn": i32, "stride_hk": i32, "stride_wv": i32,
             "stride_wk": i32, "stride_em": i32, "stride_en": i32, "stride_sg": i32, "inv_t": f32,
             **const("COMPUTE_ENTROPY", "STAT_GROUP", *tile)}
    dz = {"e_ptr": "*bf16", "dz_ptr": "*bf16", "labels_ptr": "*i64", "m_ptr": "*fp32",
          "mx_ptr": "*fp32", "logs_ptr": "*fp32", "ent_ptr": "*fp32", "gl_ptr": "*fp32",
          "ge_ptr": "*fp32", "err_ptr": "*fp32", "R": i32, "V": i32, "stride_em": i32,
          "stride_en": i32, "stride_sg": i32, "inv_t": f32,
          **const("HAS_GL", "HAS_GE", "TRACK_ERR", "BLOCK_M", "STAT_GROUP")}
    gemms = {
        "fwd": (fl._fwd_kernel, fwd, dict(SPLIT_V=fl._SPLIT_V, COMPUTE_ENTROPY=True, DOT_FP32=False)),
        "dlogits": (fl._dlogits_kernel, bwd, dict(HAS_GL=True, HAS_GE=True, TRACK_ERR=True,
                                                  ERR_GROUP=fl._ERR_GROUP, DOT_FP32=False)),
        "probs": (ft._probs_kernel, probs, dict(COMPUTE_ENTROPY=True, STAT_GROUP=ft._STAT_GROUP,
                                                DOT_FP32=False)),
    }
    out = {}
    for name, (fn, sig, consts) in gemms.items():
        configs = list(enumerate(fl.lm_head_configs(name, 2)))  # the bf16 configs
        for i, cfg in (configs if ALL_CONFIGS else configs[:1]):
            out[f"{name}[{i}]"] = dict(build(fn, sig, consts, cfg.kwargs, cfg.num_warps,
                                             cfg.num_stages), gemm=True)
    out["dz"] = dict(build(ft._dz_kernel, dz, dict(HAS_GL=True, HAS_GE=True, TRACK_ERR=True),
                           dict(BLOCK_M=ft._DZ_BLOCK_M, STAT_GROUP=ft._STAT_GROUP), 4, 1),
                     gemm=False)
    print("RESULT " + json.dumps(out))
""")


def _version(v: str) -> tuple[int, int]:
    major, minor = v.split(".")[:2]
    return int(major), int(minor)


def _compile(all_configs: bool) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", f"ALL_CONFIGS = {all_configs}\n" + SCRIPT], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


needs_cpu_compile = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the GPU tests compile"),
    pytest.mark.skipif(_version(triton.__version__) < (3, 9),
                       reason="ASTSource signature/constexpr API as of Triton 3.9"),
]


EVERY_CONFIG = os.environ.get("MOE_RL_COMPILE_EVERY_CONFIG", "0") not in ("", "0")


@pytest.mark.parametrize("all_configs", [
    False,
    pytest.param(True, marks=[pytest.mark.slow, pytest.mark.skipif(
        not EVERY_CONFIG, reason="set MOE_RL_COMPILE_EVERY_CONFIG=1 (~1.5 min on 2 shared cores)")]),
], ids=["first_config", "every_config"])
@needs_cpu_compile[0]
@needs_cpu_compile[1]
def test_kernels_compile_for_sm90(all_configs):
    # the first autotune config of each GEMM kernel and the d_logits kernel (~20 s); all the
    # bf16 autotune configs of each when MOE_RL_COMPILE_EVERY_CONFIG=1 (the autotuner on a GPU would
    # drop a config that fails to compile, so this is a check, not a crash guard)
    result = _compile(all_configs)
    assert len(result) == (7 if all_configs else 4)
    for name, k in result.items():
        if k["gemm"]:
            assert k["wgmma"], (name, "no wgmma: the bf16 dot is not on Hopper tensor cores")
            assert k["async_copy"], (name, "loads not pipelined")
        assert k["local"] == 0, (name, "register spills / local memory")
        assert 0 <= k["smem"] <= 227 * 1024, (name, k["smem"])

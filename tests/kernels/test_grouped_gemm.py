"""moe_rl.kernels.grouped_gemm against a per-group float64 matmul reference.

Both implementations: "torch" (torch._grouped_mm's CPU kernel behind the custom op) always,
"triton" under Triton's interpreter (TRITON_INTERPRET=1, as `make test` runs) or on CUDA. Also:
the tile plan covers every row once, the op traces under torch.compile with no graph break
(torch._grouped_mm alone cannot: its meta kernel is bf16-only), and the Triton kernels compile
for sm_90 on a machine without a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moe_rl.kernels import grouped_gemm as gg

INTERP_OR_CUDA = gg.triton is not None and (gg.TRITON_INTERPRET or torch.cuda.is_available())
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not INTERP_OR_CUDA, reason="needs triton with TRITON_INTERPRET=1 or a GPU"))]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(dtype, seed=0, rows=45, k=24, n=40, offs=(10, 10, 33, 45)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(len(offs), n, k, generator=g).to(dtype)
    gy = torch.randn(rows, n, generator=g).to(dtype)
    return x.to(DEV), w.to(DEV), torch.tensor(offs, dtype=torch.int32, device=DEV), gy.to(DEV)


def _grads(fn, x, w, offs, gy, dtype):
    x, w = x.to(dtype).detach().requires_grad_(), w.to(dtype).detach().requires_grad_()
    y = fn(x, w, offs)
    (y * gy.to(dtype)).sum().backward()
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w_view"])
def test_matches_a_per_group_reference(impl, dtype, transposed):
    """Ragged groups with an empty one (group 1) and a row count that no tile size divides; w
    as stored or as a transposed view (the input gradient's layout). fp32 within 1e-5; bf16
    within 2^-7 of each tensor's largest magnitude."""
    x, w, offs, gy = _case(dtype)
    if transposed:  # the same weights held as w[e] = v[e].T
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    got = _grads(lambda a, b, o: gg.grouped_gemm(a, b, o, impl=impl), x, w, offs, gy, dtype)
    want = _grads(gg.grouped_gemm_reference, x, w, offs, gy, torch.float64)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.dtype == dtype and a.shape == b.shape, name
        if dtype == torch.float32:
            torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)
        else:
            assert (a.double() - b).abs().max() <= 2**-7 * b.abs().max(), name
    assert got[2][1].abs().max() == 0  # the empty group's weight gets no gradient


@pytest.mark.parametrize("impl", IMPLS)
def test_an_expanded_output_gradient(impl):
    """The gradient of y.sum() arrives expanded (strides 0), which torch._grouped_mm refuses."""
    x, w, offs, _ = _case(torch.float32)
    x.requires_grad_(), w.requires_grad_()
    gg.grouped_gemm(x, w, offs, impl=impl).sum().backward()
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    gg.grouped_gemm_reference(xr, wr, offs).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), wr.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not INTERP_OR_CUDA, reason="needs triton with TRITON_INTERPRET=1 or a GPU")
@pytest.mark.parametrize("offs,rows", [((0, 0, 37, 37, 50), 60), ((16, 32, 48), 48), ((3,), 3),
                                       ((5, 5, 5, 5, 5, 5, 90), 100)])
def test_each_program_finds_its_tile_as_the_plan_does(offs, rows):
    """The Triton kernel works out each row tile's group and first row itself (no tile plan
    launched): empty groups first, last and between, a group count that is not a power of two,
    groups of whole tiles, rows after the last group (left undefined, not compared)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 24, generator=g).to(DEV)
    w = torch.randn(len(offs), 40, 24, generator=g).to(DEV)
    o = torch.tensor(offs, dtype=torch.int32, device=DEV)
    got = gg.grouped_gemm(x, w, o, impl="triton")[: offs[-1]]
    want = gg.grouped_gemm_reference(x.double(), w.double(), o)[: offs[-1]]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_tile_plan_covers_every_row_once():
    for offs, bm in (([0, 5, 5, 40, 41], 16), ([64, 64, 128], 64), ([3, 3, 3], 4), ([0, 0, 0], 8)):
        o = torch.tensor(offs, dtype=torch.int32)
        rows = offs[-1]
        group, first = gg.tile_plan(o, rows, bm)
        assert group.shape[0] == -(-rows // bm) + len(offs)  # static: rows and E only
        hit = torch.zeros(rows, dtype=torch.long)
        starts = [0] + offs[:-1]
        for g, r in zip(group.tolist(), first.tolist()):
            if g == len(offs):
                continue
            assert starts[g] <= r < offs[g]
            hit[r:min(r + bm, offs[g])] += 1
        assert torch.equal(hit, torch.ones(rows, dtype=torch.long)), (offs, bm)


def test_traces_under_compile_without_a_graph_break():
    """float32: torch._grouped_mm itself breaks the graph (its meta kernel refuses float32); the
    custom op's fake keeps it one graph, forward and backward, with the eager values."""
    x, w, offs, gy = _case(torch.float32)

    def f(x, w, offs):
        return gg.grouped_gemm(x, w, offs).sin()

    assert torch._dynamo.explain(f)(x, w, offs).graph_break_count == 0
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    got = _grads(compiled, x, w, offs, gy, torch.float32)
    want = _grads(f, x, w, offs, gy, torch.float32)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_bad_inputs_raise():
    x, w, offs, _ = _case(torch.float32)
    with pytest.raises(TypeError, match="int32"):
        gg.grouped_gemm(x, w, offs.long())
    with pytest.raises(ValueError, match=r"w \[E, N, K\]"):
        gg.grouped_gemm(x, w[..., :3], offs)
    with pytest.raises(TypeError, match="dtype"):
        gg.grouped_gemm(x.double(), w.double(), offs)


SM90 = textwrap.dedent("""
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from moe_rl.kernels import grouped_gemm as gg

    def build(fn, sig, meta, warps, stages, dtype):
        sig = dict(sig)
        for name in ("stride_xk", "stride_wk", "stride_yn", "stride_dyn"):
            if name in sig:
                sig[name] = "constexpr"
                meta = dict(meta, **{name: 1})
        names = list(sig)
        div = [["tt.divisibility", 16]]
        attrs = {(i,): div for i, n in enumerate(names) if n.endswith("_ptr")}
        for n in meta:
            sig[n] = "constexpr"
        k = triton.compile(ASTSource(fn, sig, constexprs=meta, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": stages})
        return {"local": k.asm["ptx"].count(".local"), "smem": k.metadata.shared,
                "wgmma": "warp_group_dot" in k.asm["ttgir"], "mma": "mma.sync" in k.asm["ptx"]}

    out = {}
    for dt, t, tiles, rows in (("fp32", "torch.float32", "", 0), ("bf16", "torch.bfloat16", "", 0),
                               ("fp32", "torch.float32", "small_", 64), ("bf16", "torch.bfloat16", "small_", 64)):
        import torch
        bm, bn, bk, warps, stages = gg._blocks(eval(t), rows, 32)  # rows 64 of 32 groups: a decode step
        i32 = "i32"
        fwd = {"x_ptr": "*" + dt, "w_ptr": "*" + dt, "y_ptr": "*" + dt, "offs_ptr": "*i32", "N": i32, "K": i32,
               "E": i32, "stride_xm": i32,
               "stride_xk": i32, "stride_we": i32, "stride_wn": i32, "stride_wk": i32, "stride_ym": i32,
               "stride_yn": i32}
        wgrad = {"dy_ptr": "*" + dt, "x_ptr": "*" + dt, "dw_ptr": "*" + dt, "offs_ptr": "*i32", "N": i32, "K": i32,
                 "stride_dym": i32, "stride_dyn": i32, "stride_xm": i32, "stride_xk": i32, "stride_we": i32,
                 "stride_wn": i32, "stride_wk": i32}
        prec = gg._precision(eval(t))
        meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=prec, DOT_FP32=False)
        out["fwd_" + tiles + dt] = build(gg._gmm_kernel, fwd, dict(meta, E_P2=128), warps, stages, dt)
        out["wgrad_" + tiles + dt] = build(gg._gmm_wgrad_kernel, wgrad, dict(meta, BLOCK_K=min(bk, bn)), warps, stages, dt)
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the GPU tests run the kernels")
@pytest.mark.skipif(gg.triton is None, reason="needs triton")
def test_kernels_compile_for_sm90():
    """The real compiler (Triton's ptxas, no TRITON_INTERPRET) accepts both kernels in fp32 and
    bf16 for an H100/H200; the bf16 dots land on wgmma tensor cores, nothing spills to local
    memory, shared memory fits (227 KiB)."""
    ptxas = os.path.join(os.path.dirname(gg.triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SM90], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert len(result) == 8
    for name, k in result.items():
        assert k["local"] == 0 and k["smem"] <= 227 * 1024, (name, k)
        if name.endswith("bf16"):  # 16-row tiles are below wgmma's 64: mma.sync, tensor cores still
            assert k["mma" if "small" in name else "wgmma"], (name, "the bf16 dot is not on tensor cores")


def test_a_float32_row_tile_follows_the_mean_group(monkeypatch):
    """On a GPU a float32 row tile is as tall as the mean group (16 at least, 64 at most): a
    decode step's few rows per expert do not pay for 64-row tiles; 16-bit tiles stay 128."""
    monkeypatch.setattr(gg, "TRITON_INTERPRET", False)
    E = 32
    assert [gg._blocks(torch.float32, rows, E)[0] for rows in (4, 256, 640, 1024, 1056, 32768)] == [16, 16, 32, 32, 64, 64]
    assert gg._blocks(torch.bfloat16, 1024, E)[0] == gg._blocks(torch.float16, 32768, E)[0] == 128
    # at most 16 rows per group on the mean (a decode step), every dtype takes the narrow, deep tiles
    for dt in gg.DTYPES:
        assert gg._blocks(dt, 256, E) == (16, *gg.SMALL_GROUP_BLOCKS[dt])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [32768, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_on_a_gpu_at_expert_shapes(dtype, rows):
    """Medium-preset shapes (32 experts, hidden 1024, width 2 x 512; 8192 x 4 rows as in
    training, 64 x 4 as in a decode step): the Triton op against torch's per-group loop, no host
    sync (CUDA's sync debug mode errors on one)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    E, K, N = 32, 1024, 1024
    counts = torch.distributions.Dirichlet(torch.ones(E)).sample() * rows
    offs = counts.cumsum(0).round().clamp(max=rows).to(torch.int32).cuda()
    offs[-1] = rows
    x = torch.randn(rows, K, device="cuda", generator=g, dtype=dtype)
    w = torch.randn(E, N, K, device="cuda", generator=g, dtype=dtype) / K ** 0.5
    want = gg.grouped_gemm_reference(x.float(), w.float(), offs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = gg.grouped_gemm(x, w, offs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max() <= tol * want.abs().max()


def test_small_group_tiles_come_from_the_gpu_models_tuned_file(monkeypatch, tmp_path):
    """On a CUDA device the decode tiles are read once from configs/grouped_gemm_<GPU name>.json
    (or the file $MOE_RL_GROUPED_GEMM_CONFIG names); a GPU without one takes the defaults; a file
    named but missing is an error."""
    monkeypatch.setattr(gg, "TRITON_INTERPRET", False)
    monkeypatch.setattr(gg, "CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(gg, "_TUNED", {})
    monkeypatch.delenv(gg.CONFIG_ENV, raising=False)
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA A100-SXM4-80GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: names[i])
    (tmp_path / "grouped_gemm_NVIDIA_H100_80GB_HBM3.json").write_text(
        '{"device": "NVIDIA H100 80GB HBM3", "float32": [64, 256, 8, 3]}')
    h100, a100 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert gg._blocks(torch.float32, 256, 32, h100) == (16, 64, 256, 8, 3)
    assert gg._blocks(torch.bfloat16, 256, 32, h100) == (16, *gg.SMALL_GROUP_BLOCKS[torch.bfloat16])
    assert gg._blocks(torch.float32, 256, 32, a100) == (16, *gg.SMALL_GROUP_BLOCKS[torch.float32])
    assert gg._blocks(torch.float32, 32768, 32, h100) == gg._blocks(torch.float32, 32768, 32)  # training tiles
    other = tmp_path / "mine.json"
    other.write_text('{"float32": [16, 64, 2, 2]}')
    monkeypatch.setattr(gg, "_TUNED", {})
    monkeypatch.setenv(gg.CONFIG_ENV, str(other))
    assert gg._blocks(torch.float32, 4, 32, h100) == (16, 16, 64, 2, 2)
    monkeypatch.setattr(gg, "_TUNED", {})
    monkeypatch.setenv(gg.CONFIG_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError):
        gg._blocks(torch.float32, 4, 32, h100)

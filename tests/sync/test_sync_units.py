"""Planner, receiver checks (one process: sender and receiver ranks in two threads) and the
bucket pack kernel (Triton under TRITON_INTERPRET=1, against the plain-torch reference)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest
import torch

from moe_rl.kernels.bucket_pack import contiguous_offsets, pack, pack_reference, unpack, unpack_reference
from moe_rl.model import MoEForCausalLM, hf_param_specs
from moe_rl.sync import SyncGroup, WeightReceiver, WeightSyncError, checksum, free_port, model_specs, plan_buckets
from tests.sync import helpers as H


# --- planner ----------------------------------------------------------------------------
def test_plan_limits_order_dtypes():
    specs = [("a", (10,), torch.float32), ("b", (300,), torch.float32), ("c", (20,), torch.bfloat16),
             ("d", (30,), torch.float32), ("e", (40,), torch.float32), ("f", (5,), torch.bfloat16)]
    plan = plan_buckets(specs, bucket_bytes=200)
    got = [(b.dtype, b.names) for b in plan.buckets]
    assert got == [(torch.float32, ("a",)), (torch.float32, ("b",)), (torch.float32, ("d",)),
                   (torch.float32, ("e",)), (torch.bfloat16, ("c", "f"))]
    plan = plan_buckets(specs, bucket_bytes=400)
    assert [b.names for b in plan.buckets] == [("a",), ("b",), ("d", "e"), ("c", "f")]
    for b in plan.buckets:
        assert b.nbytes <= 400 or len(b.names) == 1  # only an oversized tensor exceeds a bucket
        assert list(b.offsets) == [sum(b.numels()[:j]) for j in range(len(b.names))]
    with pytest.raises(ValueError, match="appears twice"):
        plan_buckets(specs + [("a", (1,), torch.float32)], 100)


def test_plan_covers_model_in_canonical_order():
    model = MoEForCausalLM(H.arch()).init_weights(0)
    plan = plan_buckets(model_specs(model), int(H.BUCKET_MB * 2**20))
    names = [n for b in plan.buckets for n in b.names]
    assert names == [n for n, _ in hf_param_specs(model.arch)]
    assert all(b.nbytes <= plan.bucket_bytes or len(b.names) == 1 for b in plan.buckets)
    bf = plan_buckets(model_specs(model, torch.bfloat16), 1 << 20)
    assert {b.dtype for b in bf.buckets} == {torch.bfloat16} and len(bf.buckets) == 1


def test_plan_keeps_the_glm_correction_bias_fp32_on_a_16_bit_wire():
    """GLM's e_score_correction_bias travels (and stays) in fp32 whatever the wire dtype: bf16
    would round it, and SGLang's parameter is fp32; everything else takes the wire dtype."""
    glm = H.arch(model_type="glm4_moe", mlp_only_layers=[], first_k_dense_replace=1, n_shared_experts=1)
    model = MoEForCausalLM(glm).init_weights(0)
    bias = {n for n, _ in hf_param_specs(glm) if n.endswith("e_score_correction_bias")}
    assert len(bias) == 2
    for specs in (model_specs(model, torch.bfloat16), model_specs(model.to(torch.bfloat16))):
        plan = plan_buckets(specs, 1 << 20)
        assert {n for b in plan.buckets if b.dtype == torch.float32 for n in b.names} == bias
        assert {b.dtype for b in plan.buckets} == {torch.float32, torch.bfloat16}


# --- receiver checks ----------------------------------------------------------------------
def _params():
    return {"w.a": torch.zeros(3, 4), "w.b": torch.zeros(5)}


def _exchange(rx_call, payload: torch.Tensor, params=None):
    """Rank 0 (this thread) broadcasts ``payload``; rank 1 (a thread) runs ``rx_call(rx)``."""
    rx, outs = _exchanges([rx_call], [payload], params)
    return rx, outs[0]


def _exchanges(rx_calls, payloads, params=None):
    """Like ``_exchange``, for several calls in turn on one receiver and group."""
    port = free_port()
    rx = WeightReceiver(params or _params(), timeout_s=20)
    outs = [{} for _ in rx_calls]

    def rank1():
        try:
            rx.init_group("127.0.0.1", port, 1, 2, "g")
        except Exception as e:
            outs[0]["err"] = e
            return
        for call, out in zip(rx_calls, outs):
            try:
                out["ret"] = call(rx)
            except Exception as e:
                out["err"] = e

    t = threading.Thread(target=rank1)
    t.start()
    g = SyncGroup("127.0.0.1", port, 0, 2, "g", timeout_s=20)
    for payload in payloads:
        g.wait_work(g.broadcast(payload))
    t.join(30)
    g.close()
    return rx, outs


def test_receiver_stages_then_commits():
    payload = torch.arange(17, dtype=torch.float32)
    names, shapes = ["w.a", "w.b"], [[3, 4], [5]]
    rx, out = _exchange(lambda r: r.receive_bucket(names, ["float32"] * 2, shapes, "g", "flattened_bucket", "7",
                                                   checksum(payload)), payload)
    assert out.get("ret") is True, out
    assert torch.count_nonzero(rx.params["w.a"]) == 0  # untouched until commit
    rx.commit()
    assert torch.equal(rx.params["w.a"].flatten(), payload[:12]) and torch.equal(rx.params["w.b"], payload[12:])
    assert rx.weight_version == "7"


@pytest.mark.parametrize("names,shapes,dtype,cs,match", [
    (["w.a", "w.zzz"], [[3, 4], [5]], "float32", None, "unknown tensor 'w.zzz'"),
    (["w.a", "w.b"], [[4, 3], [5]], "float32", None, r"shape mismatch for w.a: sent \(4, 3\)"),
    (["w.a", "w.b"], [[3, 4], [5]], "float32", "crc32:00000000", "checksum mismatch"),
])
def test_receiver_rejects_with_name(names, shapes, dtype, cs, match):
    payload = torch.arange(17, dtype=torch.float32)
    rx, out = _exchange(lambda r: r.receive_bucket(names, [dtype] * 2, shapes, "g", "flattened_bucket", "1", cs),
                        payload)
    err = out.get("err")
    assert isinstance(err, WeightSyncError), out
    assert re.search(match, str(err)), str(err)
    assert "parameters unchanged (still the initial weights)" in str(err)
    assert all(torch.count_nonzero(t) == 0 for t in rx.params.values())
    with pytest.raises(WeightSyncError, match="incomplete"):
        rx.commit()


def test_receiver_checks_a_layout_like_a_cached_one():
    """Layouts are found by (dtype, count, first and last name) and confirmed by comparing the
    lists: an update that differs only in the middle is checked afresh, not served the cache."""
    params = {"w.a": torch.zeros(3, 4), "w.m": torch.zeros(2), "w.b": torch.zeros(5)}
    good = (["w.a", "w.m", "w.b"], [[3, 4], [2], [5]])
    calls = [
        lambda r: r.receive_bucket(*good[:1], ["float32"] * 3, good[1], "g", "flattened_bucket", "1"),
        lambda r: r.receive_bucket(["w.a", "w.zz", "w.b"], ["float32"] * 3, good[1], "g", "flattened_bucket", "2"),
        lambda r: r.receive_bucket(good[0], ["float32"] * 3, [[3, 4], [1], [6]], "g", "flattened_bucket", "3"),
        lambda r: r.receive_bucket(*good[:1], ["float32"] * 3, good[1], "g", "flattened_bucket", "4"),
    ]
    payloads = [torch.arange(19.0), torch.zeros(19), torch.zeros(19), torch.arange(19.0) + 1]
    rx, outs = _exchanges(calls, payloads, params)
    assert outs[0].get("ret") is True and outs[3].get("ret") is True, outs
    assert "unknown tensor 'w.zz'" in str(outs[1].get("err")), outs[1]
    assert "shape mismatch for w.m: sent (1,)" in str(outs[2].get("err")), outs[2]
    rx.commit()
    assert rx.weight_version == "4" and torch.equal(rx.params["w.b"], torch.arange(14.0, 19.0) + 1)


def test_receiver_dtype_mismatch_names_tensor():
    payload = torch.arange(17, dtype=torch.float32).to(torch.bfloat16)
    _, out = _exchange(lambda r: r.receive_bucket(["w.a", "w.b"], ["bfloat16"] * 2, [[3, 4], [5]], "g"), payload)
    assert "dtype mismatch for w.a" in str(out.get("err")), out


def test_receiver_without_group():
    rx = WeightReceiver(_params())
    with pytest.raises(WeightSyncError, match="init_weights_update_group"):
        rx.receive_bucket(["w.b"], ["float32"], [[5]], "nope")


# --- pack kernel ----------------------------------------------------------------------------
def _tensors(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(7,), (3, 5), (4097,), (1,), (2, 3, 4), (9000,)]  # straddles the 4096-element chunk
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 1: torch.uint8, 8: torch.int64}[t.element_size()])


def check_triton_pack():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ts = _tensors(dtype)
        offs, pos = [], 3  # gaps between tensors, as in an EP-gathered bucket
        for t in ts:
            offs.append(pos)
            pos += t.numel() + 2
        ref = pack_reference(ts, torch.zeros(pos, dtype=dtype), offs)
        got = pack(ts, torch.zeros(pos, dtype=dtype), offs, use_triton=True)
        assert torch.equal(_bits(got), _bits(ref)), dtype
        outs = [torch.empty_like(t) for t in ts]
        unpack(got, outs, offs, use_triton=True)
        refs = [torch.empty_like(t) for t in ts]
        unpack_reference(ref, refs, offs)
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(outs, refs)), dtype
        flat = pack(ts, use_triton=True)  # back to back
        assert torch.equal(_bits(flat), _bits(torch.cat([t.flatten() for t in ts])))
    check_triton_pack_aligned()


def check_triton_pack_aligned(device="cpu"):
    """16-byte aligned layouts take 16-byte accesses; tensors carved from one buffer in
    reverse order put the others below the first (negative offsets from the anchor); a plan
    cached for a layout serves a second, different flat buffer."""
    from moe_rl.kernels.bucket_pack import BucketCopy

    g = torch.Generator().manual_seed(1)
    store = torch.randn(4 * 8192, generator=g).to(torch.bfloat16).to(device)
    sizes = [8, 4096, 8200, 16, 3000 * 8]  # elements: all multiples of 8 bf16 = 16 bytes
    ts, pos = [], store.numel()
    for s in sizes:
        pos -= s
        ts.append(store[pos : pos + s])
    offs = [o + 16 for o in contiguous_offsets(ts)]
    plan = BucketCopy(ts, offs, torch.bfloat16, chunk_bytes=4096)
    assert (plan.align, plan.vec, plan.int_dtype) == (16, 4, torch.int32)
    total = offs[-1] + ts[-1].numel()
    for fill in (0.0, 1.0):  # a fresh buffer each time, as a sync does
        ref = pack_reference(ts, torch.full((total,), fill, dtype=torch.bfloat16, device=device), offs)
        got = plan.pack(torch.full((total,), fill, dtype=torch.bfloat16, device=device))
        assert torch.equal(_bits(got), _bits(ref))
        got2 = pack(ts, torch.full((total,), fill, dtype=torch.bfloat16, device=device), offs, use_triton=True)
        assert torch.equal(_bits(got2), _bits(ref))
    outs = [torch.zeros_like(t) for t in ts]
    BucketCopy(outs, offs, torch.bfloat16).unpack(ref)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(outs, ts))
    with pytest.raises(ValueError, match="does not fit"):
        plan.pack(torch.zeros(total - 1, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="aligned"):
        plan.pack(torch.zeros(total + 8, dtype=torch.bfloat16, device=device)[1:])


def test_pack_torch_path_matches_reference():
    ts = _tensors(torch.float32)
    assert torch.equal(pack(ts, use_triton=False), torch.cat([t.flatten() for t in ts]))
    offs = [0, 10, 30, 4200, 4210, 4240]
    out = pack(ts, torch.zeros(13300), offs, use_triton=False)
    assert torch.equal(out, pack_reference(ts, torch.zeros(13300), offs))
    back = [torch.empty_like(t) for t in ts]
    unpack(out, back, offs, use_triton=False)
    assert all(torch.equal(a, b) for a, b in zip(back, ts))
    with pytest.raises(ValueError, match="overruns"):
        pack(ts, torch.zeros(100), offs)


def test_pack_triton_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        check_triton_pack()
        return
    # Triton picks interpreter mode at import: check in a fresh process
    code = "from tests.sync.test_sync_units import check_triton_pack; check_triton_pack()"
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.gpu
def test_pack_triton_cuda():
    ts = [t.cuda() for t in _tensors(torch.bfloat16)]
    flat = pack(ts)
    assert torch.equal(_bits(flat), _bits(torch.cat([t.flatten() for t in ts])))
    outs = [torch.empty_like(t) for t in ts]
    unpack(flat, outs)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(outs, ts))
    check_triton_pack_aligned("cuda")


COMPILE_SCRIPT = """
import importlib, json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
bp = importlib.import_module("moe_rl.kernels.bucket_pack")
sig = {"flat_ptr": "*i32", "anchor_ptr": "*i32", "t_off_ptr": "*i64", "f_off_ptr": "*i64", "n_ptr": "*i32",
       "TO_FLAT": "constexpr", "CHUNK": "constexpr", "VEC": "constexpr"}
attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}  # what a launch with aligned pointers gives
out = {}
for to_flat in (True, False):
    k = triton.compile(ASTSource(bp._bucket_copy_kernel, sig, constexprs={"TO_FLAT": to_flat, "CHUNK": 4096, "VEC": 4},
                                 attrs=attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    out[str(to_flat)] = sorted(set(re.findall(r"(?:ld|st)\\.global[.\\w]*", k.asm["ptx"])))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the GPU test runs the kernel")
def test_bucket_copy_compiles_to_16_byte_accesses():
    """Bandwidth needs 16-byte loads and stores: the alignment hints must reach the compiler."""
    triton = pytest.importorskip("triton")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("ASTSource signature/constexpr API as of Triton 3.9")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    res = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    for direction, ops in res.items():
        assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops, (direction, ops)

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

from moe_rl.kernels.bucket_pack import pack, pack_reference, unpack, unpack_reference
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


# --- receiver checks ----------------------------------------------------------------------
def _params():
    return {"w.a": torch.zeros(3, 4), "w.b": torch.zeros(5)}


def _exchange(rx_call, payload: torch.Tensor):
    """Rank 0 (this thread) broadcasts ``payload``; rank 1 (a thread) runs ``rx_call(rx)``."""
    port = free_port()
    rx = WeightReceiver(_params(), timeout_s=20)
    out = {}

    def rank1():
        try:
            rx.init_group("127.0.0.1", port, 1, 2, "g")
            out["ret"] = rx_call(rx)
        except Exception as e:
            out["err"] = e

    t = threading.Thread(target=rank1)
    t.start()
    g = SyncGroup("127.0.0.1", port, 0, 2, "g", timeout_s=20)
    g.wait_work(g.broadcast(payload))
    t.join(30)
    g.close()
    return rx, out


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

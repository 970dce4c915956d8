"""``moe-rl bench replay [--json]``: size and speed of the routing-replay log.

Shape: a Qwen3-30B-A3B-like model (48 MoE layers, top-8 of 128 experts), one record of
``--tokens`` tokens. Reports bytes per token of the log against the SGLang wire format (int32,
and its base64) and int16/uint8 arrays; encode and decode throughput of the C++ codec in GB/s of
int32-equivalent input (``tokens * layers * top_k * 4`` bytes / seconds), and of a vectorised
numpy implementation of the same format measured in the same run; and the store's append/get
throughput through files and mmap. Timings are medians of ``--reps`` runs, pinned to one core.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np

from moe_rl import _C
from moe_rl.replay.codec import bits_for, pack_numpy, unpack_numpy
from moe_rl.replay.log import ReplayLog


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _pin_one_core() -> int | None:
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return cpu
    except (AttributeError, OSError):
        return None


def _median_s(fn, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def make_record(tokens: int, layers: int, top_k: int, experts: int, seed: int = 0) -> np.ndarray:
    """Realistic ids: each (token, layer) row is top_k distinct experts in random order."""
    rng = np.random.default_rng(seed)
    pool = np.argsort(rng.random((4096, experts), dtype=np.float32), axis=1)[:, :top_k]
    return pool[rng.integers(0, 4096, (tokens, layers))].astype(np.int32)


def run(tokens: int, layers: int, top_k: int, experts: int, reps: int, records: int) -> dict:
    cpu = _pin_one_core()
    ids = make_record(tokens, layers, top_k, experts)
    flat = ids.reshape(-1)
    n = flat.size
    gb = ids.nbytes / 1e9  # int32-equivalent input
    bits = bits_for(experts)

    # correctness first: both implementations write the same bytes and read them back
    packed = _C.pack(flat, experts)
    assert np.array_equal(packed, pack_numpy(flat, experts)), "C++ and numpy bytes differ"
    out32 = np.empty(n, dtype=np.int32)
    out64 = np.empty(n, dtype=np.int64)
    assert np.array_equal(_C.unpack(packed, n, experts, "int32", 0, out32), flat)
    assert np.array_equal(unpack_numpy(packed, n, experts, dtype=np.int32), flat)

    t_enc = _median_s(lambda: _C.pack(flat, experts), reps)
    t_dec = _median_s(lambda: _C.unpack(packed, n, experts, "int32", 0, out32), reps)
    t_dec64 = _median_s(lambda: _C.unpack(packed, n, experts, "int64", 0, out64), reps)
    t_np_enc = _median_s(lambda: pack_numpy(flat, experts), reps)
    t_np_dec = _median_s(lambda: unpack_numpy(packed, n, experts, dtype=np.int32, out=out32), reps)
    t_crc = _median_s(lambda: _C.crc32c(packed), reps)

    # the store: files + index + mmap, as the trainer uses it
    with tempfile.TemporaryDirectory(prefix="moe-rl-bench-replay-") as d:
        log = ReplayLog(d, layers, top_k, experts)
        uids = [f"sample-{i:08d}-{'x' * 20}" for i in range(records)]  # uuid-length keys
        t0 = time.perf_counter()
        for u in uids:
            log.append(u, ids, versions=[1, 2])
        t_append = (time.perf_counter() - t0) / records
        st = log.stats()
        reader = ReplayLog(d, mode="r")
        t_get = _median_s(lambda: reader.get(uids[0], dtype=np.int32), reps)
        buf = np.empty((layers, tokens, top_k), dtype=np.int64)
        t_align = _median_s(lambda: reader.read_into(uids[0], buf, 0, 0, tokens), reps)
        reader.close()
        log.close()
    tok = st["tokens"]

    payload_bpt = st["payload_bytes"] / tok
    disk_bpt = st["disk_bytes"] / tok
    int32_bpt = layers * top_k * 4
    summary = {
        "bytes_per_token": round(disk_bpt, 3),
        "payload_bytes_per_token": payload_bpt,
        "int32_bytes_per_token": int32_bpt,
        "int16_bytes_per_token": layers * top_k * 2,
        "uint8_bytes_per_token": layers * top_k,
        "base64_int32_bytes_per_token": int32_bpt * 4 / 3,
        "bits_per_id": bits,
        "compression_vs_int32": round(int32_bpt / disk_bpt, 3),
        "encode_gbps": round(gb / t_enc, 3),
        "decode_gbps": round(gb / t_dec, 3),
        "numpy_encode_gbps": round(gb / t_np_enc, 3),
        "numpy_decode_gbps": round(gb / t_np_dec, 3),
        "encode_speedup_vs_numpy": round(t_np_enc / t_enc, 2),
        "decode_speedup_vs_numpy": round(t_np_dec / t_dec, 2),
    }
    detail = {
        "shape": {"tokens": tokens, "layers": layers, "top_k": top_k, "experts": experts},
        "decode_int64_gbps": round(gb / t_dec64, 3),
        "crc32c_payload_gbps": round(packed.nbytes / 1e9 / t_crc, 3),
        "store_append_gbps": round(gb / t_append, 3),
        "store_get_gbps": round(gb / t_get, 3),
        "store_read_into_layer_major_int64_gbps": round(gb / t_align, 3),
        "store": {"records": st["records"], "tokens": tok, "payload_bytes": st["payload_bytes"],
                  "record_bytes": st["record_bytes"], "index_bytes": st["index_bytes"],
                  "disk_bytes": st["disk_bytes"],
                  "record_overhead_bytes": (st["record_bytes"] - st["payload_bytes"]) // records,
                  "index_bytes_per_record": st["index_bytes"] / records},
        "timing": {"reps": reps, "statistic": "median", "pinned_cpu": cpu},
        "machine": {"cpu": _cpu_name(), "logical_cpus": os.cpu_count(),
                    "python": platform.python_version(), "numpy": np.__version__},
    }
    return {"bench": "replay", "summary": summary, **detail}


def _table(res: dict) -> str:
    s, d = res["summary"], res
    sh = d["shape"]
    lines = [
        f"routing-replay log: {sh['tokens']} tokens x {sh['layers']} layers x top-{sh['top_k']} "
        f"of {sh['experts']} experts ({s['bits_per_id']} bits/id), one core, median of "
        f"{d['timing']['reps']}",
        f"  {d['machine']['cpu']}",
        "",
        "  bytes per token",
        f"    int32 (SGLang wire)      {s['int32_bytes_per_token']:>9.1f}",
        f"    base64(int32)            {s['base64_int32_bytes_per_token']:>9.1f}",
        f"    int16                    {s['int16_bytes_per_token']:>9.1f}",
        f"    uint8                    {s['uint8_bytes_per_token']:>9.1f}",
        f"    log payload (packed)     {s['payload_bytes_per_token']:>9.1f}",
        f"    log on disk (all files)  {s['bytes_per_token']:>9.3f}   "
        f"({s['compression_vs_int32']}x smaller than int32)",
        "",
        "  throughput, GB/s of int32-equivalent ids      C++     numpy   speedup",
        f"    encode                                   {s['encode_gbps']:>7.2f}  "
        f"{s['numpy_encode_gbps']:>7.2f}  {s['encode_speedup_vs_numpy']:>6.1f}x",
        f"    decode                                   {s['decode_gbps']:>7.2f}  "
        f"{s['numpy_decode_gbps']:>7.2f}  {s['decode_speedup_vs_numpy']:>6.1f}x",
        f"    decode to int64                          {d['decode_int64_gbps']:>7.2f}",
        f"    store append (pack+CRC+write)            {d['store_append_gbps']:>7.2f}",
        f"    store get (mmap+CRC+decode)              {d['store_get_gbps']:>7.2f}",
        f"    store read_into [L,N,k] int64            "
        f"{d['store_read_into_layer_major_int64_gbps']:>7.2f}",
        f"  per record: {d['store']['record_overhead_bytes']} B header in the segment, "
        f"{d['store']['index_bytes_per_record']:.0f} B index entry",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="moe-rl bench replay", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tokens", type=int, default=8192, help="tokens in the record")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--records", type=int, default=8, help="records appended to the store")
    a = p.parse_args(argv)
    res = run(a.tokens, a.layers, a.top_k, a.experts, a.reps, a.records)
    print(json.dumps(res, indent=1) if a.json else _table(res))
    return 0

"""The on-disk replay log: API, errors, readers, corruption and crashes."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from moe_rl.replay import CorruptRecordError, ReplayLog

L, K, E = 4, 3, 16
GEN0 = "gen-000000"  # the first generation's folder: its segments and index (moe_rl/replay/log.py)


def rec(seed, tokens=None):
    rng = np.random.default_rng(seed)
    tokens = int(rng.integers(1, 40)) if tokens is None else tokens
    return np.argsort(rng.random((tokens, L, E)), axis=-1)[..., :K].astype(np.int32)


def test_roundtrip_and_mapping_api(tmp_path):
    with ReplayLog(tmp_path / "log", L, K, E) as log:
        for i in range(5):
            log.append(f"s{i}", rec(i), versions=[i, i + 1])
        log.append("torch", torch.from_numpy(rec(9)).long(), versions=7)
        log.append("empty", np.zeros((0, L, K), dtype=np.int64))
        assert len(log) == 7 and "s3" in log and "nope" not in log
        assert list(log) == [f"s{i}" for i in range(5)] + ["torch", "empty"]
        got = log.get("s2")
        assert got.dtype == np.int64 and np.array_equal(got, rec(2))
        assert log.get("s2", dtype=np.int32).dtype == np.int32
        assert log.versions("s4") == (4, 5) and log.versions("torch") == (7,)
        assert log.num_tokens("s1") == rec(1).shape[0]
        assert log.get("empty").shape == (0, L, K)
        t = log.get_tensor("torch")
        assert t.dtype == torch.long and torch.equal(t, torch.from_numpy(rec(9)).long())
        with pytest.raises(KeyError, match="nope"):
            log.get("nope")
    # reopen: everything is still there, and appends continue
    with ReplayLog(tmp_path / "log") as log:
        assert (log.num_layers, log.top_k, log.num_experts) == (L, K, E)
        assert np.array_equal(log.get("s0"), rec(0))
        log.append("s5", rec(5))
        assert len(log) == 8


def test_bad_input_is_a_clear_value_error(tmp_path):
    log = ReplayLog(tmp_path, L, K, E)
    with pytest.raises(ValueError, match=r"shape \(5, 4, 2\).*\[tokens, 4, 3\]"):
        log.append("a", np.zeros((5, L, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="integer"):
        log.append("a", np.zeros((5, L, K), dtype=np.float32))
    bad = rec(0, 6)
    bad[2, 1, 0] = E
    with pytest.raises(ValueError, match=r"ids\[2, 1, 0\] = 16 is out of range"):
        log.append("a", bad)
    bad = rec(0, 6)
    bad[3, 2, 1] = -1
    with pytest.raises(ValueError, match=r"ids\[3, 2, 1\] = -1"):
        log.append("a", bad)
    bad = rec(0, 6)
    bad[4, 0, 2] = bad[4, 0, 0]
    with pytest.raises(ValueError, match=r"ids\[4, 0, :\] repeats"):
        log.append("a", bad)
    log.append("a", rec(0))
    with pytest.raises(ValueError, match="already in the log"):
        log.append("a", rec(1))
    with pytest.raises(ValueError, match="num_experts=16, opened with num_experts=32"):
        ReplayLog(tmp_path, L, K, 32, mode="r")
    with pytest.raises(FileNotFoundError):
        ReplayLog(tmp_path / "missing", mode="r")
    assert len(log) == 1 and np.array_equal(log.get("a"), rec(0))


def test_one_writer_many_readers(tmp_path):
    w = ReplayLog(tmp_path, L, K, E)
    with pytest.raises(RuntimeError, match="already has a writer"):
        ReplayLog(tmp_path, L, K, E)
    w.append("a", rec(1))
    r1, r2 = ReplayLog(tmp_path, mode="r"), ReplayLog(tmp_path, mode="r")
    assert "a" in r1 and len(r2) == 1
    w.append("b", rec(2))
    assert np.array_equal(r1.get("b"), rec(2))  # a miss refreshes
    assert r2.refresh() == 1 and r2.uids() == ["a", "b"]
    with pytest.raises(RuntimeError, match="read-only"):
        r1.append("c", rec(3))
    w.close()
    ReplayLog(tmp_path, L, K, E).close()  # the lock goes with the writer


def test_segments_roll_over(tmp_path):
    log = ReplayLog(tmp_path, L, K, E, segment_bytes=300)
    for i in range(20):
        log.append(str(i), rec(i, 30))  # 30*4*3*4 bits = 180 B + 16 per record
    assert len(list((tmp_path / GEN0).glob("segment-*.bin"))) == 20
    log.close()
    log = ReplayLog(tmp_path, mode="r")
    assert all(np.array_equal(log.get(str(i)), rec(i, 30)) for i in range(20))


def test_overhead_is_16_bytes_per_record(tmp_path):
    log = ReplayLog(tmp_path, 48, 8, 128)
    ids = np.tile(np.arange(8, dtype=np.int32), (100, 48, 1))
    log.append("x", ids)
    st = log.stats()
    assert st["payload_bytes"] == 100 * 48 * 8 * 7 // 8  # 7 bits per id
    assert st["record_bytes"] == st["payload_bytes"] + 16
    assert (tmp_path / GEN0 / "segment-000000.bin").stat().st_size == st["record_bytes"]
    assert st["disk_bytes"] == st["record_bytes"] + st["index_bytes"] + (
        tmp_path / "meta.json").stat().st_size


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_corrupted_byte_names_uid_and_segment(tmp_path):
    log = ReplayLog(tmp_path, L, K, E)
    for i in range(3):
        log.append(f"u{i}", rec(i, 20))
    seg = tmp_path / GEN0 / "segment-000000.bin"
    info = log.info("u1")
    _flip(seg, info["offset"] + 16 + 7)  # payload byte of u1
    with pytest.raises(CorruptRecordError, match=r"uid 'u1' in segment .*segment-000000\.bin"):
        log.get("u1")
    out = np.zeros((L, 20, K), dtype=np.int64)
    with pytest.raises(CorruptRecordError, match="u1"):
        log.read_into("u1", out, 0, 0, 5)
    assert np.array_equal(log.get("u0"), rec(0, 20)) and np.array_equal(log.get("u2"), rec(2, 20))
    _flip(seg, log.info("u2")["offset"] + 9)  # header (token count) of u2
    with pytest.raises(CorruptRecordError, match="uid 'u2'.*damaged header"):
        log.get("u2")
    # every single-byte flip anywhere in a record is caught, never returned as ids
    _flip(seg, info["offset"] + 16 + 7)
    size = 16 + (20 * L * K * 4 + 7) // 8
    for off in range(0, size, 7):
        _flip(seg, info["offset"] + off)
        with pytest.raises(CorruptRecordError):
            log.get("u1")
        _flip(seg, info["offset"] + off)
    assert np.array_equal(log.get("u1"), rec(1, 20))


def test_corrupted_index_entry_is_reported(tmp_path):
    log = ReplayLog(tmp_path, L, K, E)
    for i in range(3):
        log.append(f"u{i}", rec(i))
    log.close()
    _flip(tmp_path / GEN0 / "index.bin", 30)  # inside the first entry, not the tail
    with pytest.raises(CorruptRecordError, match=r"index\.bin is corrupted at byte 0"):
        ReplayLog(tmp_path, mode="r")


@pytest.mark.parametrize("cut", ["segment", "index"])
def test_torn_last_record_dropped_on_reopen(tmp_path, cut):
    log = ReplayLog(tmp_path, L, K, E)
    for i in range(4):
        log.append(f"u{i}", rec(i, 25))
    log.close()
    seg, idx = tmp_path / GEN0 / "segment-000000.bin", tmp_path / GEN0 / "index.bin"
    if cut == "segment":  # died while writing the record: its index entry was never written
        with open(idx, "r+b") as f:
            entries = f.read()
        entry = len(entries) // 4
        os.truncate(idx, len(entries) - entry)
        os.truncate(seg, seg.stat().st_size - 50)
    else:  # died while writing the index entry
        os.truncate(idx, idx.stat().st_size - 5)
    r = ReplayLog(tmp_path, mode="r")  # a reader sees the three complete records
    assert r.uids() == ["u0", "u1", "u2"]
    log = ReplayLog(tmp_path, L, K, E)
    assert log.uids() == ["u0", "u1", "u2"]
    assert all(np.array_equal(log.get(f"u{i}"), rec(i, 25)) for i in range(3))
    log.append("u3", rec(3, 25))  # the torn bytes were truncated away
    log.append("u4", rec(4, 25))
    log.close()
    log = ReplayLog(tmp_path, mode="r")
    assert all(np.array_equal(log.get(f"u{i}"), rec(i, 25)) for i in range(5))
    assert r.refresh() == 2 and np.array_equal(r.get("u4"), rec(4, 25))


WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from moe_rl.replay.log import ReplayLog
    L, K, E = 48, 8, 128
    log = ReplayLog(sys.argv[1], L, K, E, segment_bytes=8 << 20)
    i = len(log)
    while True:
        rng = np.random.default_rng(i)
        ids = np.argsort(rng.random((16, L, E), dtype=np.float32), axis=-1)[..., :K]
        ids = np.tile(ids, (int(rng.integers(1, 160)), 1, 1))
        log.append(f"r{i}", ids, versions=[i])
        print(i, flush=True)
        i += 1
""")


def expected(i):
    rng = np.random.default_rng(i)
    ids = np.argsort(rng.random((16, 48, 128), dtype=np.float32), axis=-1)[..., :8]
    return np.tile(ids, (int(rng.integers(1, 160)), 1, 1))


def test_kill_9_writer_mid_append(tmp_path):
    """A writer process appending in a loop is SIGKILLed six times; after each reopen every
    record it reported done is intact, and at most the one in flight is missing."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    path = tmp_path / "log"
    done, checked = -1, 0
    for round_ in range(6):
        p = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        target = done + 3 + round_
        deadline = time.monotonic() + 30
        while done < target and time.monotonic() < deadline:
            done = int(p.stdout.readline())
        time.sleep(0.007 * (round_ + 1))  # land somewhere inside a later append
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p.stdout.close()
        assert done >= target
        log = ReplayLog(path, mode="r")
        n = len(log)
        assert n >= done + 1, "a record reported appended was lost"
        assert log.uids() == [f"r{i}" for i in range(n)]
        for i in range(max(0, checked - 1), n):  # the new ones; all of them in the end
            assert np.array_equal(log.get(f"r{i}"), expected(i)), i
            assert log.versions(f"r{i}") == (i,)
        checked = n
        log.close()
        ReplayLog(path).close()  # writer reopen: truncates the torn tail
        done = n - 1
    log = ReplayLog(path, mode="r")
    assert all(np.array_equal(log.get(f"r{i}"), expected(i)) for i in range(len(log)))


def test_threads_read_while_writer_appends(tmp_path):
    """Reads release the GIL; concurrent readers in threads and a writer stay consistent."""
    from concurrent.futures import ThreadPoolExecutor

    w = ReplayLog(tmp_path, L, K, E)
    r = ReplayLog(tmp_path, mode="r")
    w.append("u0", rec(0, 50))

    def read_loop(_):
        for i in range(40):
            uid = f"u{i % 20}"
            if uid in r:
                assert np.array_equal(r.get(uid), rec(i % 20, 50))
        return True

    with ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(read_loop, j) for j in range(2)]
        for i in range(1, 20):
            w.append(f"u{i}", rec(i, 50))
        assert all(f.result() for f in futs)
    assert r.refresh() >= 0 and len(r) == 20

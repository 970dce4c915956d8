"""The routing log's generations and retention (moe_rl/replay/log.py): a record stays while its
sample is live or in the latest checkpoint's buffer, and goes after; the disk and the indexes in
memory stay bounded however many steps; readers follow; a crash while deleting leaves a whole log;
a format-1 log is read as the oldest generation."""
import json
import os

import numpy as np
import pytest

from moe_rl import _C
from moe_rl.replay import ReplayLog

L, K, E = 4, 3, 16


def rec(seed, tokens=12):
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, L, E)), axis=-1)[..., :K].astype(np.int32)


def test_records_go_when_unused_and_pinned_ones_move_to_the_pin_generation(tmp_path):
    w, r = ReplayLog(tmp_path, L, K, E), ReplayLog(tmp_path, mode="r")
    for i in range(4):
        w.append(f"a{i}", rec(i), versions=[0])
    w.roll()
    for i in range(4):
        w.append(f"b{i}", rec(10 + i), versions=[1])
    w.roll()
    w.append("c0", rec(20))
    assert w.generations() == ["gen-000000", "gen-000001", "gen-000002"]
    w.set_pinned(5, {"a1", "a2"})  # the latest checkpoint's buffer holds a1 and a2
    assert w.drop_unused(live={"b3"}) == 2  # gen 0: no live uid, a1/a2 copied, a0/a3 gone; gen 1 kept (b3)
    assert w.generations() == ["pin-00000005", "gen-000001", "gen-000002"]
    assert not (tmp_path / "gen-000000").exists()
    assert r.refresh() >= 0 and r.generations() == w.generations()  # the reader follows
    for log in (w, r):
        assert np.array_equal(log.get("a1"), rec(1)) and log.versions("a2") == (0,)
        assert np.array_equal(log.get("b0"), rec(10)) and "a0" not in log
        with pytest.raises(KeyError):
            log.get("a3")
    assert r.info("a1")["generation"] == "pin-00000005"
    # b3 trained on: gen 1 goes; the newest generation and the pin generation stay
    assert w.drop_unused(live=set()) == 4
    assert w.generations() == ["pin-00000005", "gen-000002"] and sorted(w.uids()) == ["a1", "a2", "c0"]
    # a newer checkpoint: the old pin generation goes when nothing in it is live or pinned anew
    w.set_pinned(9, set())
    w.roll()
    assert w.drop_unused(live=set()) == 3 and w.generations() == ["gen-000003"] and len(w) == 0
    r.refresh()
    assert len(r) == 0 and r.generations() == ["gen-000003"]
    with pytest.raises(ValueError, match="already in the log"):  # a uid never repeats, across generations
        w.append("z", rec(1))
        w.append("z", rec(2))


def test_disk_and_index_stay_bounded_over_many_steps(tmp_path):
    """A run's pattern: B samples a step, each live for `eta + 1` steps, a checkpoint every 7 steps
    pinning its buffer. With retention the log holds a few steps' worth at any step; without, it
    grows with the steps (the control, so this test can fail)."""
    B, eta, steps = 8, 2, 120

    def run(retain: bool):
        w, r = ReplayLog(tmp_path / str(retain), L, K, E), ReplayLog(tmp_path / str(retain), mode="r")
        sizes = []
        for step in range(steps):
            for j in range(B):
                w.append(f"s{step}-{j}", rec(j))
            live = {f"s{s}-{j}" for s in range(max(0, step - eta), step + 1) for j in range(B)}
            if step % 7 == 0:
                w.set_pinned(step, live)
            if retain:
                w.roll()
                w.drop_unused(live)
            r.refresh()
            assert all(u in r for u in live)  # every live record is there for the trainer
            sizes.append((len(w), len(r), w.stats()["disk_bytes"], w.stats()["index_bytes"]))
        return np.array(sizes)

    kept, grown = run(True), run(False)
    per_step = grown[-1, 2] / steps
    # at most: eta + 1 live steps, the pin of the last checkpoint (eta + 1 steps), the current one
    bound = (2 * (eta + 1) + 1) * B
    assert kept[:, 0].max() <= bound and kept[:, 1].max() <= bound, kept[:, :2].max(0)
    assert kept[steps // 2 :, 2].max() <= kept[: steps // 2, 2].max() * 1.2  # no growth after warm-up
    assert kept[:, 2].max() < 12 * per_step  # a few steps' worth of disk, files included
    assert grown[-1, 0] == steps * B and grown[-1, 2] > 10 * kept[-1, 2]  # the control grows


def test_reopened_writer_appends_to_the_newest_generation_and_clears_a_half_deletion(tmp_path):
    w = ReplayLog(tmp_path, L, K, E)
    w.append("a", rec(1))
    w.roll()
    w.append("b", rec(2))
    w.close()
    os.replace(tmp_path / "gen-000000", tmp_path / "trash-gen-000000")  # a crash between rename and removal
    r = ReplayLog(tmp_path, mode="r")
    assert r.uids() == ["b"]  # a generation being deleted is never half visible
    w = ReplayLog(tmp_path)
    assert not (tmp_path / "trash-gen-000000").exists() and w.generations() == ["gen-000001"]
    w.append("c", rec(3))
    assert r.refresh() == 1 and r.uids() == ["b", "c"] and r.info("c")["generation"] == "gen-000001"


def test_a_format_1_log_is_read_and_dropped_as_the_oldest_generation(tmp_path):
    store = _C.Store(str(tmp_path), L, K, E, True, 1 << 20)  # a log written before generations
    store.append("old", rec(5), [3], True)
    store.close()
    (tmp_path / "meta.json").write_text(json.dumps({"format": 1, "num_layers": L, "top_k": K, "num_experts": E,
                                                    "bits": 4}))
    assert ReplayLog(tmp_path, mode="r").versions("old") == (3,)
    w = ReplayLog(tmp_path)
    assert w.generations() == [".", "gen-000000"] and json.loads((tmp_path / "meta.json").read_text())["format"] == 2
    w.append("new", rec(6))
    assert np.array_equal(w.get("old"), rec(5)) and w.drop_unused(live={"new"}) == 1
    assert w.uids() == ["new"] and not (tmp_path / "index.bin").exists() and not list(tmp_path.glob("segment-*"))

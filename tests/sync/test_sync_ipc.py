"""sync.backend=ipc: the receiver maps each bucket of the sender's memory (shared memory on CPU,
CUDA IPC on a GPU) instead of receiving a broadcast; same staging, same atomic commit."""
import threading
import time

import pytest
import torch

from moe_rl.model import MoEForCausalLM
from moe_rl.sync import WeightSender, WeightSyncError

from . import helpers as H


@pytest.fixture(scope="module")
def receiver():
    with H.spawn_receiver(0) as r:
        yield r


def expected_hashes(seed: int) -> dict[str, str]:
    return H.model_hashes(MoEForCausalLM(H.arch()).init_weights(seed))


def _sync(model, ctl, version):
    sender = WeightSender(model, engines=[ctl], bucket_mb=H.BUCKET_MB, timeout_s=30, backend="ipc")
    try:
        assert len(sender.plan.buckets) > 2
        stats = sender.sync(version)
        # the kept pool (two buffers per dtype) is shared once per buffer, not once per bucket
        assert sender.keep_buffers and 1 <= sender.group.pg.shares <= 2 < len(sender.plan.buckets)
        return stats
    finally:
        sender.close()


def test_ipc_sync_is_bit_identical_and_a_bad_update_leaves_the_old_weights(receiver):
    _, ctl, _ = receiver
    for seed in (1, 2):  # twice: the second update reuses the group's store keys and shared buckets
        _sync(MoEForCausalLM(H.arch()).init_weights(seed), ctl, f"ipc{seed}")
        assert ctl.call("hashes")["result"] == expected_hashes(seed)
        assert ctl.call("state")["result"]["version"] == f"ipc{seed}"
    # wider experts than the engine's: rejected after the first bucket is mapped and copied
    with pytest.raises(WeightSyncError, match="shape mismatch"):
        _sync(MoEForCausalLM(H.arch(moe_intermediate_size=24)).init_weights(5), ctl, "bad")
    assert ctl.call("hashes")["result"] == expected_hashes(2)
    state = ctl.call("state")["result"]
    assert state["version"] == "ipc2" and "parameters unchanged (still version ipc2)" in state["last_error"]


@pytest.mark.gpu
def test_ipc_round_trip_of_a_cuda_bucket_to_another_process():
    """The CUDA path of moe_rl.sync.ipc: a CUDA buffer mapped and copied by a second process."""
    import torch.multiprocessing as mp

    from moe_rl.sync.group import SyncGroup, free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_cuda_receiver, args=(port, q), daemon=True)
    p.start()
    g = SyncGroup("127.0.0.1", port, 0, 2, "ipc-test", "ipc", 60)
    try:
        src = torch.arange(1 << 20, dtype=torch.float32, device="cuda") * 0.5
        g.wait_work(g.broadcast(src, src=0))
        assert q.get(timeout=60) == float(src.sum())
    finally:
        p.join(30)
        g.close()


def _cuda_receiver(port, q):
    from moe_rl.sync.group import SyncGroup

    g = SyncGroup("127.0.0.1", port, 1, 2, "ipc-test", "ipc", 60)
    buf = torch.full((1 << 20,), float("nan"), device="cuda")
    g.wait_work(g.broadcast(buf, src=0))
    q.put(float(buf.sum()))
    g.close()


def _ipc_pair(name: str):
    """Ranks 0 and 1 of one ipc weight-sync group, both in this process (each made in a thread:
    the store's rendezvous waits for both)."""
    from moe_rl.sync.group import SyncGroup, free_port

    port = free_port()
    groups = {}
    threads = [threading.Thread(target=lambda r=r: groups.__setitem__(
        r, SyncGroup("127.0.0.1", port, r, 2, name, "ipc", 30))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return groups[0], groups[1]


def test_a_kept_buffer_is_shared_once_and_a_fresh_one_each_time():
    """Rank 0 broadcasts views of one kept buffer (a bound or pooled bucket) three times with new
    contents, and a fresh buffer twice: the kept one is shared and mapped once (its later
    broadcasts name the mapping, and the receiver reads the new contents through it), each fresh
    one anew. Sharing a kept buffer every time would grow torch's IPC records without bound."""
    sender, receiver = _ipc_pair("ipc-once")
    kept = torch.zeros(1000)
    try:
        for i, (lo, n) in enumerate([(0, 600), (600, 400), (100, 300)]):
            kept.copy_(torch.arange(1000, dtype=torch.float32) * (i + 1))
            for buf, persistent in ((kept[lo:lo + n], True), (torch.full((50,), float(i)), False)):
                got = torch.empty_like(buf)
                recv = receiver.broadcast(got, src=0)
                done = threading.Thread(target=receiver.wait_work, args=(recv,))
                done.start()
                sender.wait_work(sender.broadcast(buf, src=0, persistent=persistent))
                done.join(30)
                assert torch.equal(got, buf), (i, persistent)
        assert (sender.pg.shares, receiver.pg.opens) == (1 + 3, 1 + 3)
        assert len(sender.pg.shared) == len(receiver.pg.mapped) == 1
    finally:
        spg, rpg = sender.pg, receiver.pg
        receiver.close()
        sender.close()
    assert not spg.shared and not rpg.mapped  # closing the group lets the mapped buffer go


def test_a_rank_that_leaves_fails_the_broadcast_at_once():
    """An engine that leaves the ipc group (as it does when it refuses a bucket it cannot read)
    fails rank 0's broadcast within a fraction of a second, not at the group's timeout (30 s
    here), as gloo's broadcast fails when its peer closes the connection."""
    sender, receiver = _ipc_pair("ipc-left")
    try:
        receiver.close()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] left it during bucket 1"):
            sender.wait_work(sender.broadcast(torch.ones(10), src=0))
        assert time.monotonic() - t0 < 5
    finally:
        sender.close()

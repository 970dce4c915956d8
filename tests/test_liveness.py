"""Heartbeats through a real TCPStore (moe_rl/liveness.py): a SIGSTOPped rank is named and
killed by the rank watching it within its timeout; the end of the run releases the engine hosts
through a store counter, and one frozen at the end is named and killed."""
import multiprocessing
import os
import signal
import time

import torch.distributed as dist

from moe_rl.dist import Layout
from moe_rl.liveness import EXIT_FROZEN_PEER, Liveness

# two trainer ranks (an EP group) and one engine host
LAYOUT = Layout(3, [0, 1], [2], 2)

def _rank_main(conn, rank, timeout, role, trainers, log_path):
    """A rank of a 3-rank world, in a forked process (torch is imported already: it starts at once)."""
    import logging

    logging.basicConfig(filename=log_path, level=logging.INFO, force=True)
    layout = Layout(3, trainers, [r for r in range(3) if r not in trainers], len(trainers))
    store = dist.TCPStore("127.0.0.1", conn.recv(), is_master=False)
    live = Liveness(store, rank, layout, timeout).start()
    live.set_note("step 7")
    conn.send("beating")
    if role == "engine":
        live.wait_for_trainers(poll_s=0.05)
        live.close()
        conn.send("released")
    else:
        time.sleep(120)
    os._exit(0)


def _ranks(tmp_path, specs):
    """Forks one process per (rank, timeout, role, trainers) before the store exists (no thread
    of the store's server is forked), then makes the store; returns (store, [(process, conn, log)])."""
    ctx = multiprocessing.get_context("fork")
    procs = []
    for rank, timeout, role, trainers in specs:
        here, there = ctx.Pipe()
        log_path = tmp_path / f"rank{rank}.log"
        p = ctx.Process(target=_rank_main, args=(there, rank, timeout, role, trainers, str(log_path)), daemon=True)
        p.start()
        procs.append((p, here, log_path))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for _, conn, _ in procs:
        conn.send(store.port)
    for p, conn, _ in procs:
        assert conn.poll(30) and conn.recv() == "beating"
    return store, procs


def test_the_watch_graph_is_a_ring_over_the_trainers_and_engines_watch_rank_0():
    assert [Liveness(None, r, LAYOUT, 10).watched for r in range(3)] == [1, 0, 0]
    assert Liveness(None, 0, Layout(2, [0], [1], 1), 10).watched is None  # no other trainer to watch
    ring = Layout(5, [0, 1, 2, 3], [4], 2)
    assert [Liveness(None, r, ring, 10).watched for r in range(5)] == [1, 2, 3, 0, 0]


def test_a_stopped_trainer_rank_is_named_and_killed_within_its_timeout(tmp_path):
    store, ((watcher, _, log), (frozen, _, _)) = _ranks(tmp_path, [(0, 2.0, "trainer", [0, 1]),
                                                                   (1, 2.0, "trainer", [0, 1])])
    try:
        time.sleep(0.5)
        os.kill(frozen.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        watcher.join(timeout=30)
        took = time.monotonic() - t0
        frozen.join(timeout=10)  # killed by its watcher (same host): a stopped process takes no SIGTERM
    finally:
        for p in (watcher, frozen):
            if p.is_alive():
                p.kill()
    err = log.read_text()
    assert watcher.exitcode == EXIT_FROZEN_PEER, err
    assert frozen.exitcode == -signal.SIGKILL
    assert (f"trainer rank 1 (pid {frozen.pid} on host" in err and "EP group of ranks [0, 1]" in err
            and "its last one said: step 7" in err and "rank 0 ends the run" in err), err
    assert 2.0 - 0.4 <= took < 2.0 + 5, took  # its timeout (counted from the last beat seen: up to one beat earlier)


def test_the_end_of_the_run_releases_engines_and_names_a_frozen_one(tmp_path):
    store, ((live, conn, _), (frozen, _, _)) = _ranks(tmp_path, [(1, 5.0, "engine", [0]), (2, 5.0, "engine", [0])])
    trainer = Liveness(dist.TCPStore("127.0.0.1", store.port, is_master=False), 0, Layout(3, [0], [1, 2], 1), 5.0)
    trainer.start()
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        time.sleep(0.3)
        assert live.is_alive()  # engines wait for the trainers, however long: no deadline
        t0 = time.monotonic()
        trainer.trainer_done()
        assert conn.poll(10) and conn.recv() == "released"
        assert trainer.release_engines(completed=True) == [2]
        assert time.monotonic() - t0 < 5.0  # frozen found on its missed beats, not at the bound
        frozen.join(timeout=10)
        live.join(timeout=10)
    finally:
        trainer.close()
        for p in (live, frozen):
            if p.is_alive():
                p.kill()
    assert frozen.exitcode == -signal.SIGKILL and live.exitcode == 0


def test_the_first_failure_is_recorded_whole(tmp_path, monkeypatch):
    """torchrun's agent parses a failed rank's error file. The rank's watch thread records why it
    ends the run and then exits the process, while the main thread may fail on the peer it just
    killed: the first failure is the one recorded, and the file appears whole (written aside,
    renamed), so an exit in the middle of a later write cannot leave it empty."""
    import json
    import threading

    from moe_rl import liveness

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setattr(liveness, "_recorded", threading.Lock())
    liveness.record_failure("FrozenPeerError: engine host rank 1 has sent no heartbeat")
    liveness.record_failure("EngineError: connection refused")  # the main thread, after the kill
    assert json.loads(path.read_text())["message"]["message"].startswith("FrozenPeerError")
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]

"""moe_rl.rundir: one run per output_dir (flock), the writers lock, and fresh/resume/overwrite."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from moe_rl.config import load_config
from moe_rl.rundir import (RUN_FILES, RunDirError, RunLock, claim_output_dir, hold_as_writer, lock_holder_pids,
                           prepare_output_dir, wait_for_writers)


def cfg(out, *overrides):
    return load_config("configs/tiny.yaml", [f"output_dir={out}", *overrides])


def _holder(code: str, tmp_path) -> subprocess.Popen:
    """A process that runs ``code`` (with ``d`` the directory), prints 'ready' and sleeps."""
    p = subprocess.Popen([sys.executable, "-c", f"import sys, time\nfrom moe_rl.rundir import *\nd = {str(tmp_path)!r}\n"
                          f"{code}\nprint('ready', flush=True)\ntime.sleep(600)"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_second_run_is_refused_naming_the_holder_and_touching_nothing(tmp_path):
    holder = _holder("lock = RunLock(d)", tmp_path)
    try:
        before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.iterdir()}
        t0 = time.monotonic()
        with pytest.raises(RunDirError) as e:
            RunLock(tmp_path)
        assert time.monotonic() - t0 < 1.0  # at once, not after a wait
        msg = str(e.value)
        assert str(tmp_path) in msg and f"pid {holder.pid}" in msg and f"host {socket.gethostname()}" in msg
        assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.iterdir()} == before
        assert lock_holder_pids(tmp_path / "run.lock") == [holder.pid]
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(tmp_path)  # the OS dropped the dead holder's lock
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    with pytest.raises(RunDirError):  # another descriptor, even in the same process
        RunLock(tmp_path)
    lock.release()
    RunLock(tmp_path).release()


def test_a_fresh_start_into_a_run_needs_resume_or_overwrite(tmp_path):
    out = tmp_path / "run"
    claim_output_dir(cfg(out))[0].release()  # an empty (new) directory: fine
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "routing").mkdir()
    (out / "train.log").write_text("not the run's")  # e.g. moe-rl sweep's log: never deleted
    with pytest.raises(RunDirError) as e:
        claim_output_dir(cfg(out))
    assert "already holds a run (metrics.jsonl, routing, no checkpoint)" in str(e.value)
    assert "resume=true" in str(e.value) and "overwrite_output_dir=true" in str(e.value)
    assert (out / "metrics.jsonl").exists()
    with pytest.raises(RunDirError, match="resume=true, but output_dir .* holds a run without a checkpoint"):
        claim_output_dir(cfg(out, "resume=true"))
    (out / "checkpoints" / "step_5").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step_5")
    with pytest.raises(RunDirError, match="latest checkpoint step_5"):
        claim_output_dir(cfg(out))
    claim_output_dir(cfg(out, "resume=true"))[0].release()  # continues: nothing deleted
    assert (out / "metrics.jsonl").exists() and (out / "checkpoints" / "latest").exists()
    claim_output_dir(cfg(out, "overwrite_output_dir=true"))[0].release()
    assert not any((out / name).exists() for name in RUN_FILES)
    assert (out / "train.log").read_text() == "not the run's"
    with pytest.raises(RunDirError, match="holds no run"):
        claim_output_dir(cfg(out, "resume=true"))


def test_a_replay_dir_elsewhere_is_locked_and_counts_as_the_run(tmp_path):
    out, routing = tmp_path / "run", tmp_path / "routing_elsewhere"
    routing.mkdir()
    (routing / "meta.json").write_text("{}")
    with pytest.raises(RunDirError, match="meta.json"):
        claim_output_dir(cfg(out, f"replay.dir={routing}"))
    locks = claim_output_dir(cfg(out, f"replay.dir={routing}", "overwrite_output_dir=true"))
    assert [p.name for p in routing.iterdir()] == ["run.lock"]  # the log deleted, its lock kept
    with pytest.raises(RunDirError, match="routing_elsewhere is in use by another run"):
        claim_output_dir(cfg(tmp_path / "other", f"replay.dir={routing}"))
    from moe_rl.replay import ReplayLog

    ReplayLog(routing, 2, 2, 8).close()  # the log lives beside the lock file
    for lock in locks:
        lock.release()


def test_the_next_run_waits_for_the_last_writer_of_the_previous_one(tmp_path):
    writer = _holder("hold_as_writer(d)", tmp_path)
    try:
        with pytest.raises(RunDirError) as e:
            wait_for_writers(tmp_path, timeout_s=0.5)
        assert f"pids {writer.pid}" in str(e.value) and "still alive" in str(e.value)
        t0 = time.monotonic()
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        wait_for_writers(tmp_path, timeout_s=5)
        assert time.monotonic() - t0 < 5
    finally:
        writer.kill()
        writer.wait()
    os.close(hold_as_writer(tmp_path))  # the check took and dropped its lock: this run's processes may take theirs
    prepare_output_dir(cfg(tmp_path))  # a directory with only the lock files holds no run


def test_resume_and_overwrite_together_is_a_config_error():
    from moe_rl.config import ConfigError

    with pytest.raises(ConfigError, match="set one of them"):
        load_config("configs/tiny.yaml", ["resume=true", "overwrite_output_dir=true"])

"""moe_rl.faults: a point fires on its at-th hit, only where armed; the routing log's point sits
between a record and its index entry, and the log survives a kill there."""
import errno
import signal
import subprocess
import sys

import numpy as np
import pytest

from moe_rl import faults
from moe_rl.config import FaultConfig


@pytest.fixture(autouse=True)
def _disarm():
    yield
    faults.arm(FaultConfig(), 0)


def test_a_point_fires_on_its_at_th_hit_only():
    faults.arm(FaultConfig(point="checkpoint.write", at=3, action="enospc"), rank=0)
    assert faults.armed("checkpoint.write") and not faults.armed("sync.bucket")
    faults.point("sync.bucket")  # another point: nothing, and not counted
    faults.point("checkpoint.write")
    faults.point("checkpoint.write")
    with pytest.raises(OSError) as e:
        faults.point("checkpoint.write")
    assert e.value.errno == errno.ENOSPC and "injected at checkpoint.write" in str(e.value)
    faults.point("checkpoint.write")  # once only


def test_unarmed_and_other_ranks_do_nothing():
    faults.arm(FaultConfig(), rank=0)
    faults.arm(FaultConfig(point="checkpoint.write", at=1, action="enospc", rank=1), rank=0)
    assert not faults.armed("checkpoint.write")
    faults.point("checkpoint.write")


def test_kill_tree_needs_a_launcher():
    with pytest.raises(ValueError, match="moe-rl train"):
        faults.arm(FaultConfig(point="sync.bucket", action="kill_tree"), rank=0)


def test_enospc_is_for_checkpoint_writes_only():
    from moe_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="fault.point=checkpoint.write"):
        load_config("configs/tiny.yaml", ["fault.point=sync.bucket", "fault.action=enospc"])


KILLED_APPEND = """
import numpy as np
from moe_rl import faults
from moe_rl.config import FaultConfig
from moe_rl.replay import ReplayLog
faults.arm(FaultConfig(point="routing.append", at=3, action="kill"), rank=0)
log = ReplayLog({path!r}, 2, 2, 8)
for i in range(5):
    log.append(f"u{{i}}", np.tile([[0, 1], [2, 3]], (7 + i, 1, 1)), versions=(i,))
    print("appended", i, flush=True)
"""


def test_a_kill_between_record_and_index_loses_only_that_record(tmp_path):
    from moe_rl.replay import ReplayLog

    path = tmp_path / "routing"
    r = subprocess.run([sys.executable, "-c", KILLED_APPEND.format(path=str(path))], capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert r.stdout.split("\n")[:-1] == ["appended 0", "appended 1"]
    seg = path / "gen-000000" / "segment-000000.bin"
    torn = seg.stat().st_size  # the third record is on disk, its index entry is not
    reader = ReplayLog(path, mode="r")
    assert reader.uids() == ["u0", "u1"]
    assert reader.get("u1").shape == (8, 2, 2) and reader.versions("u1") == (1,)
    writer = ReplayLog(path)  # reopening drops the unindexed record ...
    assert seg.stat().st_size < torn
    writer.append("u2", np.tile([[4, 5], [6, 7]], (3, 1, 1)))  # ... and the same uid can be logged again
    assert reader.refresh() == 1 and reader.get("u2")[0].tolist() == [[4, 5], [6, 7]]

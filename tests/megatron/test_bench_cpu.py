"""The train bench (moe_rl.train.megatron.bench) on CPU at its tiny preset: each backend's row and
op table, and a backend that fails to build recorded in its row while the others are still
measured (on the H200 the megatron build crash took the native figures of the run down with it)."""
import json

import pytest

pytest.importorskip("megatron.core")

from moe_rl.train import megatron
from moe_rl.train.megatron import bench

from tests.distributed import free_port


def test_rows_op_tables_and_a_failing_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    real = megatron.MegatronBackend

    def recompute_breaks(cfg, *a, **k):
        if cfg.train.megatron_recompute:
            raise AttributeError("'functools.partial' object has no attribute 'module'")
        return real(cfg, *a, **k)

    monkeypatch.setattr(megatron, "MegatronBackend", recompute_breaks)
    out = tmp_path / "bench.json"
    rc = bench.main(["--device", "cpu", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--peak-tflops", "1",
                     "--backends", "megatron,megatron_recompute,native", "--profile-dir", str(tmp_path / "p"),
                     "--out", str(out)])
    r = json.loads(out.read_text())
    assert rc == 1
    # rows run in the order asked (gpu_round.sh puts megatron's before the compiled native row)
    assert [k for k in r if k in bench.BACKENDS] == ["megatron", "megatron_recompute", "native"]
    for b in ("native", "megatron"):
        assert r[b]["tokens_per_s"] > 0 and r[b]["mfu"] > 0 and r[b]["profile_top_ops"]
        assert "Self CPU" in (tmp_path / "p" / f"{b}_ops.txt").read_text()
    assert r["speedup"] == pytest.approx(r["megatron"]["tokens_per_s"] / r["native"]["tokens_per_s"])
    assert r["megatron_recompute"] == {"error": "AttributeError: 'functools.partial' object has no attribute 'module'"}
    assert "recompute_step_ratio" not in r and not (tmp_path / "p" / "megatron_recompute_ops.txt").exists()


def test_a_row_is_saved_as_it_fills(tmp_path, monkeypatch):
    """A time cap that stops the bench mid-row (here: in the profiled step) leaves that row's
    build time, first step and timed figures in --out, saying where it stopped; a cap during the
    build leaves a row saying so."""
    out = tmp_path / "bench.json"
    seen = []

    def killed(*a, **k):
        seen.append(json.loads(out.read_text())["native"])
        raise SystemExit(124)

    monkeypatch.setattr(bench, "_profile_top", killed)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--preset", "tiny", "--steps", "2", "--warmup", "1", "--peak-tflops", "1",
                    "--backends", "native", "--profile-dir", str(tmp_path / "p"), "--out", str(out)])
    row = json.loads(out.read_text())["native"]
    assert row == seen[0] and row["stopped"] == "during the profiled step"
    assert row["build_s"] > 0 and row["first_step_s"] > 0 and row["step_s"] > 0 and row["tokens_per_s"] > 0

    from moe_rl.train import backend as train_backend

    def build_killed(cfg):
        seen.append(json.loads(out.read_text())["native"])
        raise SystemExit(124)

    monkeypatch.setattr(train_backend, "NativeBackend", build_killed)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--preset", "tiny", "--backends", "native", "--out", str(out)])
    assert json.loads(out.read_text())["native"] == seen[1] == {"stopped": "while building the model"}


def test_host_syncs_counts_the_synchronizing_calls_of_a_step_by_source_line(monkeypatch):
    """The sync debug mode's warnings (as CUDA raises them) are counted per line of the step."""
    import warnings

    import torch

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("something else")

    got = bench._host_syncs(step, lambda: None)
    assert got["count"] == 3 and list(got["where"].values()) == [3]
    assert next(iter(got["where"])).endswith("test_bench_cpu.py:" + str(step.__code__.co_firstlineno + 2))
    assert modes == ["warn", "default"]

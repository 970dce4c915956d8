"""W&B and MLflow beside metrics.jsonl (moe_rl/train/trackers.py): what each holds, read back
with its own files and client; a resumed run continuing the same tracker run; a tracker that
cannot be reached or fails; a missing package refused naming its extra."""
import json
import math
import socket
import sys
import time
from pathlib import Path

import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.train.tracking import Tracker, read_metrics
from moe_rl.train.trackers import MAX_FAILURES, TrackerThread, check_trackers, mlflow_name, read_ids

from tests.train.wandb_records import offline_run, read_run

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _cfg(tmp_path, *more):
    return load_config(TINY, [f"output_dir={tmp_path / 'run'}", "logging.progress=false", "logging.tensorboard=false",
                              *more])


def _row(step: int) -> dict:
    return {"reward_mean": 0.1 * step, "samples": 32, "eval/pass@4": 0.5 if step % 2 == 0 else float("nan"),
            "groups": [step, step + 1], "note": "text"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wandb_offline_and_mlflow_sqlite_hold_the_run_and_a_resume_continues_it(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # MLflow's artifacts of a sqlite store go to ./mlruns
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = _cfg(tmp_path, "logging.wandb=true", "logging.mlflow=true", "logging.project=proj",
               "logging.run_name=first", "logging.tags=[async,tiny]")
    t = Tracker.from_config(cfg, start_step=0)
    for step in (1, 2, 3):
        t.log(step, _row(step))
    assert t.close() is not None  # the reward curve was drawn
    ids = read_ids(cfg.output_dir)
    assert set(ids) == {"wandb", "mlflow"}

    # resume from a checkpoint at step 2: metrics.jsonl drops step 3; the trackers go on in the same runs
    resumed = cfg.model_copy(update={"resume": True})
    t = Tracker.from_config(resumed, start_step=2)
    for step in (3, 4):
        t.log(step, _row(step))
    t.close()
    assert read_ids(cfg.output_dir) == ids
    rows = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]

    def expected(step):  # the finite numbers of each row: what a tracker gets
        return {k: v for k, v in _row(step).items() if isinstance(v, (int, float)) and math.isfinite(v)}

    # W&B: its own run files (two offline runs of one id: the start and the resume)
    files = offline_run(Path(cfg.output_dir), ids["wandb"])
    assert len(files) == 2
    first, second = read_run(files[0]), read_run(files[1])
    assert first["run"].project == "proj" and first["run"].display_name == "first"
    assert list(first["run"].tags) == ["async", "tiny"]
    assert first["config"]["rollout"]["max_staleness"] == 2 and first["config"]["resume"] is False
    assert second["config"]["resume"] is True  # the resumed run's config is recorded
    logged = [h for h in first["history"] + second["history"] if "reward_mean" in h]
    assert [h["step"] for h in logged] == [1, 2, 3, 3, 4]
    for h in logged:
        assert {k: h[k] for k in expected(h["step"])} == pytest.approx(expected(h["step"]))
        assert "groups" not in h and "note" not in h and ("eval/pass@4" in h) == (h["step"] % 2 == 0)
    images = [h for h in second["history"] if h.get("reward_curve/_type") == "image-file"]
    assert len(images) == 1 and (files[1].parent / "files" / images[0]["reward_curve/path"]).stat().st_size > 0

    # MLflow: the same run, read back with MLflow's client from the sqlite store
    client = MlflowClient(uri)
    run = client.get_run(ids["mlflow"])
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == "proj" and len(client.search_runs([exp.experiment_id])) == 1
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert {"async", "tiny"} <= set(run.data.tags)
    assert run.data.params["rollout.max_staleness"] == "2" and run.data.params["data.task"] == "echo"
    hist = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean"))
    assert [step for step, _ in hist] == [1, 2, 3, 3, 4]  # pytest 9.2's approx takes no nested tuples
    assert [value for _, value in hist] == pytest.approx([0.1 * s for s in (1, 2, 3, 3, 4)])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, mlflow_name("eval/pass@4"))] == \
        [(2, 0.5), (4, 0.5)]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "reward_curve.png"} <= artifacts
    config = json.loads(Path(client.download_artifacts(run.info.run_id, "config.json", str(tmp_path))).read_text())
    assert config["resume"] is True and config["logging"]["mlflow"] is True


def test_a_tracker_that_cannot_be_reached_warns_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    pytest.importorskip("mlflow")
    port = _free_port()  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    cfg = _cfg(tmp_path, "logging.mlflow=true")
    t = Tracker.from_config(cfg, start_step=0)
    t0 = time.perf_counter()
    for step in range(1, 6):
        t.log(step, _row(step))
    assert time.perf_counter() - t0 < 1.0  # the loop only queues tracker calls
    t.close()
    assert [r["step"] for r in read_metrics(Path(cfg.output_dir) / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    warned = [r.getMessage() for r in caplog.records if r.name == "moe_rl.train.trackers"]
    assert any("logging.mlflow: start failed" in m and "left out for the rest of the run" in m for m in warned), warned
    assert "mlflow" not in read_ids(cfg.output_dir)


class _Flaky:
    """A tracker that starts, then fails every call from ``fail_from`` on."""

    def __init__(self, name, fail_from=None):
        self.name, self.fail_from, self.logged, self.finished = name, fail_from, [], False

    def start(self):
        return f"{self.name}-id"

    def log(self, step, values):
        if self.fail_from is not None and step >= self.fail_from:
            raise ConnectionError("server gone")
        self.logged.append(step)

    def log_image(self, key, path):
        pass

    def finish(self):
        self.finished = True


def test_a_tracker_failing_mid_run_is_left_out_and_the_others_go_on(tmp_path, caplog):
    good, bad = _Flaky("good"), _Flaky("bad", fail_from=3)
    th = TrackerThread([good, bad], tmp_path)
    for step in range(1, 10):
        th.log(step, {"x": float(step)})
    th.close()
    assert good.logged == list(range(1, 10)) and good.finished
    assert bad.logged == [1, 2] and not bad.finished and th.dead == {"bad"}
    warned = [r.getMessage() for r in caplog.records if "logging.bad" in r.getMessage()]
    assert len(warned) == MAX_FAILURES and "left out" in warned[-1]
    assert read_ids(tmp_path) == {"good": "good-id", "bad": "bad-id"}


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_tracker_package_is_refused_naming_its_extra(tmp_path, monkeypatch, capsys, name):
    from moe_rl.cli import main

    monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    cfg = _cfg(tmp_path, f"logging.{name}=true")
    with pytest.raises(ConfigError, match=rf"logging.{name}=true but the {name} package is not installed: "
                                          rf"pip install 'moe-rl\[{name}\]'"):
        check_trackers(cfg.logging)
    assert main(["validate", TINY, f"logging.{name}=true"]) == 2  # refused before any process starts
    assert f"pip install 'moe-rl[{name}]'" in capsys.readouterr().err


def test_mlflow_metric_names():
    assert mlflow_name("eval/pass@4") == "eval/pass_at_4"
    assert mlflow_name("reward/hit first") == "reward/hit first" and mlflow_name("a,b") == "a_b"

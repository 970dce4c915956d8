"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow.

``logging.wandb: true`` / ``logging.mlflow: true`` (with ``logging.project``, ``logging.run_name``,
``logging.tags``). Each gets the scalars of every metrics.jsonl row (x axis: the trainer step),
the resolved config, and ``reward_curve.png`` at the end. Only the process that owns the
:class:`~moe_rl.train.tracking.Tracker` logs: trainer rank 0.

* Their own environment variables are read as they read them: W&B's ``WANDB_MODE`` (``offline``
  writes the run under its directory, ``wandb sync`` uploads it later), ``WANDB_DIR`` (default
  here: ``<output_dir>/wandb``), ``WANDB_API_KEY``, ``WANDB_BASE_URL``, ``WANDB_INIT_TIMEOUT``;
  MLflow's ``MLFLOW_TRACKING_URI`` (MLflow's own default store when unset) and its HTTP retry
  settings. ``logging.project`` defaults to ``WANDB_PROJECT`` / ``MLFLOW_EXPERIMENT_NAME``, then
  the config's ``name``.
* Resume: each tracker's run id is kept in ``<output_dir>/trackers.json``; a run started with
  ``resume=true`` continues the same W&B run (``resume="allow"``) and the same MLflow run. W&B
  plots against the ``step`` metric (``define_metric``), so the steps re-run after a resume
  are plotted again rather than dropped; MLflow keeps both values of such a step.
* Never in the training loop's way: every call to a tracker runs on one background thread
  (:class:`TrackerThread`). A tracker that cannot be reached, or fails later, logs a warning
  naming it and is left out for the rest of the run (a failure after the start: after
  ``MAX_FAILURES`` calls in a row); training goes on and metrics.jsonl, written before any
  tracker is called, has every step.
* Optional dependencies: ``pip install 'moe-rl[wandb]'`` / ``'moe-rl[mlflow]'``; a run asking
  for one that is not installed is refused before launch (:func:`check_trackers`).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import queue
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from moe_rl.config import ConfigError

log = logging.getLogger(__name__)

IDS_FILE = "trackers.json"
MAX_FAILURES = 3  # calls failing in a row before a tracker is left out
QUEUE_SIZE = 100_000  # calls waiting for the tracker thread; past it a call is dropped (and counted)
CLOSE_TIMEOUT_S = 120.0  # the end of a run waits this long for the trackers to finish sending

# config key -> (module, pip extra)
EXTRAS = {"wandb": ("wandb", "moe-rl[wandb]"), "mlflow": ("mlflow", "moe-rl[mlflow]")}


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def check_trackers(logging_cfg) -> list[str]:
    """The trackers the config turns on; ConfigError naming the pip extra for one not installed."""
    on = [name for name in EXTRAS if getattr(logging_cfg, name)]
    for name in on:
        module, extra = EXTRAS[name]
        if not _installed(module):
            raise ConfigError(f"logging.{name}=true but the {module} package is not installed: "
                              f"pip install '{extra}' (or set logging.{name}=false)")
    return on


def scalars(metrics: dict) -> dict[str, float]:
    """The finite numbers of a metrics row (lists, strings and NaN stay in metrics.jsonl only)."""
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def read_ids(run_dir: Path) -> dict[str, str]:
    p = Path(run_dir) / IDS_FILE
    try:
        return json.loads(p.read_text()) if p.exists() else {}
    except (OSError, ValueError):
        log.warning("%s is not readable: the trackers start new runs", p)
        return {}


_ids_lock = threading.Lock()


def _write_id(run_dir: Path, name: str, run_id: str) -> None:
    with _ids_lock:
        ids = read_ids(run_dir)
        ids[name] = run_id
        tmp = Path(run_dir) / (IDS_FILE + ".tmp")
        tmp.write_text(json.dumps(ids, indent=1) + "\n")
        os.replace(tmp, Path(run_dir) / IDS_FILE)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class WandbTracker:
    """A W&B run (``wandb.init`` on the tracker thread)."""

    name = "wandb"

    def __init__(self, run_dir: Path, project: str, run_name: str, tags: list[str], config: dict,
                 resume_id: str | None):
        self.run_dir, self.project, self.run_name, self.tags = run_dir, project, run_name, tags
        self.config, self.resume_id = config, resume_id
        self.run = None

    def start(self) -> str:
        import wandb

        kw: dict[str, Any] = {}
        if not os.environ.get("WANDB_DIR"):
            kw["dir"] = str(self.run_dir)  # W&B writes <dir>/wandb/...
        if self.resume_id:
            kw.update(id=self.resume_id, resume="allow")
        self.run = wandb.init(project=self.project, name=self.run_name, tags=self.tags or None, config=self.config,
                              settings=wandb.Settings(console="off"), **kw)
        if self.resume_id:
            self.run.config.update(self.config, allow_val_change=True)  # resume=true and anything else changed
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        return self.run.id

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, "step": step})

    def log_image(self, key: str, path: Path) -> None:
        import wandb

        self.run.log({key: wandb.Image(str(path))})

    def finish(self) -> None:
        self.run.finish()


_MLFLOW_NAME = re.compile(r"[^\w./\- :]")


def mlflow_name(key: str) -> str:
    """A metric name MLflow accepts (letters, digits, ``_ - . / : space``): ``eval/pass@4`` is
    ``eval/pass_at_4``."""
    return _MLFLOW_NAME.sub("_", key.replace("@", "_at_"))


class MlflowTracker:
    """An MLflow run, through ``MlflowClient`` (explicit run ids: no fluent, thread-local state)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, project: str, run_name: str, tags: list[str], config: dict,
                 resume_id: str | None):
        self.project, self.run_name, self.tags = project, run_name, tags
        self.config, self.resume_id = config, resume_id
        self.client = None
        self.run_id: str | None = None

    def start(self) -> str:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = c = MlflowClient()
        if self.resume_id:
            c.get_run(self.resume_id)  # raises if the store does not have it
            c.update_run(self.resume_id, status="RUNNING")
            self.run_id = self.resume_id
        else:
            exp = c.get_experiment_by_name(self.project)
            exp_id = exp.experiment_id if exp else c.create_experiment(self.project)
            run = c.create_run(exp_id, run_name=self.run_name, tags={t: "" for t in self.tags})
            self.run_id = run.info.run_id
            params = [Param(k, json.dumps(v) if not isinstance(v, str) else v)
                      for k, v in _flatten(self.config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                c.log_batch(self.run_id, params=params[i : i + 100])
        c.log_dict(self.run_id, self.config, "config.json")
        return self.run_id

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(k), float(v), ts, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def log_image(self, key: str, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


class TrackerThread:
    """Runs the trackers' calls in order on one daemon thread (module docstring): the caller
    only queues them."""

    def __init__(self, trackers: list, run_dir: Path):
        self.trackers, self.run_dir = trackers, run_dir
        self.dead: set[str] = set()
        self._fails = {t.name: 0 for t in trackers}
        self.dropped = 0
        self._q: queue.Queue = queue.Queue(QUEUE_SIZE)
        self._thread = threading.Thread(target=self._main, name="trackers", daemon=True)
        self._thread.start()
        for t in trackers:
            self._put(t, "start")

    def _put(self, tracker, method: str, *args) -> None:
        try:
            self._q.put_nowait((tracker, method, args))
        except queue.Full:
            self.dropped += 1

    def log(self, step: int, values: dict[str, float]) -> None:
        for t in self.trackers:
            self._put(t, "log", step, values)

    def log_image(self, key: str, path: Path) -> None:
        for t in self.trackers:
            self._put(t, "log_image", key, path)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        for t in self.trackers:
            self._put(t, "finish")
        self._q.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("trackers (%s) still sending after %g s: left behind; metrics.jsonl has every step",
                        ", ".join(t.name for t in self.trackers if t.name not in self.dead), timeout_s)
        if self.dropped:
            log.warning("trackers: %d calls dropped (queue full): metrics.jsonl has every step", self.dropped)

    def _main(self) -> None:
        while (item := self._q.get()) is not None:
            tracker, method, args = item
            if tracker.name in self.dead:
                continue
            try:
                out = getattr(tracker, method)(*args)
            except Exception as e:  # noqa: BLE001  (any failure of a tracker must leave the run going)
                self._failed(tracker, method, e)
                continue
            self._fails[tracker.name] = 0
            if method == "start":
                _write_id(self.run_dir, tracker.name, out)
                log.info("logging.%s: run %s", tracker.name, out)

    def _failed(self, tracker, method: str, e: Exception) -> None:
        self._fails[tracker.name] += 1
        if method == "start" or self._fails[tracker.name] >= MAX_FAILURES:
            self.dead.add(tracker.name)
            log.warning("logging.%s: %s failed (%s: %s); %s is left out for the rest of the run, which goes on: "
                        "metrics.jsonl has every step", tracker.name, method, type(e).__name__, str(e)[:300],
                        tracker.name)
        else:
            log.warning("logging.%s: %s failed (%s: %s); trying again with the next call", tracker.name, method,
                        type(e).__name__, str(e)[:300])


def start_trackers(cfg, start_step: int) -> TrackerThread | None:
    """The trackers ``cfg.logging`` turns on, started on their thread (None when none is).
    A fresh run (``start_step`` 0) starts new tracker runs; a resumed one continues those in
    ``trackers.json``."""
    lc = cfg.logging
    on = check_trackers(lc)
    if not on:
        return None
    run_dir = Path(cfg.output_dir)
    ids = read_ids(run_dir) if start_step > 0 else {}
    if start_step == 0:
        (run_dir / IDS_FILE).unlink(missing_ok=True)
    config = cfg.model_dump(mode="json")
    run_name = lc.run_name or run_dir.resolve().name
    env = {"wandb": "WANDB_PROJECT", "mlflow": "MLFLOW_EXPERIMENT_NAME"}
    trackers = []
    for name in on:
        project = lc.project or os.environ.get(env[name]) or cfg.name
        trackers.append(TRACKERS[name](run_dir, project, run_name, list(lc.tags), config, ids.get(name)))
    return TrackerThread(trackers, run_dir)

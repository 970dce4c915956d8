"""SGLang's ``/start_profile`` and ``/stop_profile`` for the embedded engine: torch.profiler over
the engine loop's steps.

torch.profiler records the ops of the thread that starts it, so the engine thread starts and
stops it between steps, when asked (``request_start`` / ``request_stop``, called with the
engine's lock held; ``turn`` on the engine thread). What it writes, as SGLang does, into the
request's ``output_dir`` (default ``$SGLANG_TORCH_PROFILER_DIR``, else /tmp):
``{profile_id}-TP-0.trace.json.gz`` (a Chrome trace) and, for reading without a trace viewer,
``{profile_id}-TP-0.ops.txt`` (torch's op tables: by self device time on a GPU, by self CPU time).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from moe_rl.profiling import top_ops, write_ops_table

ACTIVITIES = ("CPU", "GPU")  # SGLang's names; its MEM, CUDA_PROFILER and RPD are not offered here


class StepProfiler:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._asked: dict | None = None  # a start not yet taken by the engine thread
        self._prof = None
        self._run: dict | None = None  # the running profile: output_dir, profile_id, steps, num_steps
        self._stop_asked = False
        self.files: list[str] | None = None  # what the last profile wrote (None while one runs)
        self.top: dict | None = None  # its steps and top ops (moe_rl.profiling.top_ops)
        self.error: str | None = None

    # --- asked by the server (the engine's lock held) ----------------------------------------
    def request_start(self, output_dir: str | None, num_steps: int | None, activities) -> None:
        if self.running:
            raise ValueError("a profile is already running: /stop_profile first")
        unknown = [a for a in activities if a not in ACTIVITIES]
        if unknown:
            raise ValueError(f"activities {unknown}: the embedded engine records {list(ACTIVITIES)}")
        if num_steps is not None and num_steps < 1:
            raise ValueError(f"num_steps must be at least 1, got {num_steps}")
        out = output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")
        self._asked = {"output_dir": out, "num_steps": num_steps, "activities": list(activities),
                       "profile_id": str(time.time())}
        self.files, self.error, self.top = None, None, None

    def request_stop(self) -> None:
        if not self.running:
            raise ValueError("no profile is running: /start_profile first")
        self._stop_asked = True

    @property
    def starting(self) -> bool:
        """A start asked and not yet made by the engine thread."""
        return self._asked is not None

    @property
    def running(self) -> bool:
        return self._asked is not None or self._prof is not None

    def due(self) -> bool:
        """Whether the engine thread has a start or a stop to make."""
        return self._asked is not None or (self._prof is not None and self._stop_asked)

    # --- on the engine thread ------------------------------------------------------------------
    def turn(self) -> None:
        """Starts an asked profile, or stops one that is done; a start and a stop asked while the
        engine was idle make an empty profile."""
        # a start request is cleared only once its profiler runs, a profile only once its files
        # are written, so the server's checks (``running``) never fall between the two
        if self._asked is not None:
            run = self._asked
            acts = [ProfilerActivity.CPU] if "CPU" in run["activities"] else []
            if "GPU" in run["activities"] and self.cuda:
                acts.append(ProfilerActivity.CUDA)
            try:
                prof = profile(activities=acts or [ProfilerActivity.CPU])
                prof.__enter__()
            except Exception as e:  # the engine keeps serving; /stop_profile reports it
                self.error, self.files, self._asked, self._stop_asked = f"{type(e).__name__}: {e}", [], None, False
                return
            self._run = {**run, "steps": 0}
            self._prof = prof
            self._asked = None
        if self._prof is not None and self._stop_asked:
            self._finish()

    def count_step(self) -> None:
        if self._prof is not None:
            self._run["steps"] += 1
            if self._run["num_steps"] and self._run["steps"] >= self._run["num_steps"]:
                self._stop_asked = True

    def close(self) -> None:
        """The engine stops: a running profile is written."""
        if self._prof is not None:
            self._finish()

    def _finish(self) -> None:
        prof, run = self._prof, self._run
        try:
            if self.cuda:
                torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            out = Path(run["output_dir"])
            out.mkdir(parents=True, exist_ok=True)
            stem = out / f"{run['profile_id']}-TP-0"
            trace = f"{stem}.trace.json.gz"
            prof.export_chrome_trace(trace)  # torch gzips a path ending in .gz
            ops = Path(f"{stem}.ops.txt")
            write_ops_table(prof, self.cuda, ops)
            self.top = {"steps": run["steps"], "cpu": top_ops(prof, False, 10),
                        **({"device": top_ops(prof, True, 10)} if self.cuda else {})}
            self.files = [trace, str(ops)]
        except Exception as e:  # the engine keeps serving; /stop_profile reports it
            self.error = f"{type(e).__name__}: {e}"
            self.files = []
        finally:
            self._prof, self._run, self._stop_asked = None, None, False

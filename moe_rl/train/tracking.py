"""What a user watches: metrics.jsonl, TensorBoard, a progress bar, and the reward curve."""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from .trackers import scalars

log = logging.getLogger(__name__)


class Tracker:
    """One JSON object per step in ``<run>/metrics.jsonl`` (appended, flushed each step), the
    same scalars in TensorBoard and in the trackers ``logging`` turns on (W&B, MLflow:
    moe_rl/train/trackers.py, given as ``trackers``), and ``reward_curve.png`` at the end."""

    @classmethod
    def from_config(cls, cfg, start_step: int = 0) -> "Tracker":
        from .trackers import start_trackers

        lc = cfg.logging
        return cls(cfg.output_dir, tensorboard=lc.tensorboard, progress=lc.progress, total_steps=cfg.train.steps,
                   start_step=start_step, trackers=start_trackers(cfg, start_step))

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, progress: bool = True,
                 total_steps: int = 0, start_step: int = 0, trackers=None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if start_step == 0 and self.path.exists():
            self.path.unlink()  # a fresh run; a resumed one appends
        elif start_step > 0 and self.path.exists():
            self._truncate_after(start_step)
        self._file = open(self.path, "a")
        self._trackers = trackers  # a TrackerThread, or None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def _truncate_after(self, start_step: int) -> None:
        """On resume, drop lines of steps that the checkpoint does not contain (steps are
        1-based: a checkpoint taken after step N resumes with N steps done), and a last line
        cut short by a crash. Written atomically: a crash here leaves the file as it was."""
        lines = self.path.read_text().splitlines()
        keep = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    log.warning("%s: dropping its last line, cut short by a crash", self.path)
                    break
                raise ValueError(f"{self.path}:{i + 1}: not a JSON object: {line[:80]!r}") from None
            if row["step"] <= start_step:
                keep.append(line)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(l + "\n" for l in keep))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict, histograms: dict | None = None) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in scalars(metrics).items():
                self._tb.add_scalar(k, v, step)
            for k, values in (histograms or {}).items():
                if len(values):
                    self._tb.add_histogram(k, values, step)
            self._tb.flush()
        if self._trackers is not None:
            self._trackers.log(step, scalars(metrics))
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(
                reward=f"{metrics.get('reward_mean', float('nan')):.3f}",
                len=f"{metrics.get('response_len_mean', float('nan')):.1f}",
                refresh=False,
            )

    def close(self) -> Path | None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._file.close()
        # the curve is a convenience: a plotting failure (matplotlib missing or broken) must not
        # turn a finished, checkpointed run into a failed one, nor hide the error that ended it
        try:
            curve = plot_reward_curve(self.path, self.run_dir / "reward_curve.png")
        except Exception:
            log.exception("could not plot %s (the run's metrics are in %s)", self.run_dir / "reward_curve.png",
                          self.path)
            curve = None
        if self._trackers is not None:
            if curve is not None:
                self._trackers.log_image("reward_curve", curve)
            self._trackers.close()
        return curve


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]


def plot_reward_curve(metrics_path: str | Path, out: str | Path) -> Path | None:
    rows = [r for r in read_metrics(metrics_path) if r.get("reward_mean") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    rewards = [r["reward_mean"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, rewards, marker=".", label="reward mean (batch)")
    k = max(1, len(rewards) // 10)
    if len(rewards) > k > 1:
        smooth = [sum(rewards[max(0, i - k + 1) : i + 1]) / len(rewards[max(0, i - k + 1) : i + 1]) for i in range(len(rewards))]
        ax.plot(steps, smooth, label=f"trailing mean ({k} steps)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)

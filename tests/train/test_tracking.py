"""The end of a run's tracking: a failure to plot the reward curve is logged, never the run's end."""
import logging
import sys

import pytest

from moe_rl.train.tracking import Tracker, read_metrics


def _tracker(tmp_path):
    t = Tracker(tmp_path, tensorboard=False, progress=False)
    for step in (1, 2, 3):
        t.log(step, {"reward_mean": 0.1 * step})
    return t


def test_close_plots_the_reward_curve(tmp_path):
    pytest.importorskip("matplotlib")
    assert _tracker(tmp_path).close() == tmp_path / "reward_curve.png"
    assert (tmp_path / "reward_curve.png").stat().st_size > 0


def test_a_plot_failure_is_logged_and_keeps_a_finished_run_finished(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    t = _tracker(tmp_path)
    with caplog.at_level(logging.ERROR, logger="moe_rl.train.tracking"):
        assert t.close() is None
    assert "could not plot" in caplog.text and "import of matplotlib halted" in caplog.text
    assert not (tmp_path / "reward_curve.png").exists()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_a_plot_failure_does_not_replace_the_error_that_ended_the_run(tmp_path, monkeypatch):
    # the train loop closes its tracker in a `finally`: the run's own error must be what propagates
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    t = _tracker(tmp_path)
    with pytest.raises(RuntimeError, match="the step failed"):
        try:
            raise RuntimeError("the step failed")
        finally:
            t.close()

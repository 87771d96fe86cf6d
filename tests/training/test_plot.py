"""``ember plot``: metrics.jsonl -> PNG, several runs overlaid."""

import re

import numpy as np
import pytest

from ember.cli import main
from ember.training.metrics import MetricsWriter, read_metrics
from ember.training.plot import metric_series


def fake_run(directory, seed):
    writer = MetricsWriter(directory, tensorboard=False)
    rng = np.random.default_rng(seed)
    for step in range(1, 21):
        writer.write(step, {"loss": float(3 / step + rng.normal() * 0.01), "finite": True, "note": "x"})
        if step % 5 == 0:
            writer.write(step, {"val_loss": float(3 / step)})
    writer.write(21, {"loss": float("nan")})
    writer.event(21, "skipped non-finite step")
    writer.close()


def test_series_keep_finite_numbers_only(tmp_path):
    fake_run(tmp_path, 0)
    series = metric_series(tmp_path)
    assert set(series) == {"loss", "val_loss"}
    assert series["val_loss"] == ([5, 10, 15, 20], [0.6, 0.3, 0.2, 0.15])
    assert len(series["loss"][0]) == 20  # the NaN at step 21 is not drawn
    assert read_metrics(tmp_path)[-2]["loss"] == "nan"


def test_plot_command_writes_a_png(tmp_path, capsys):
    fake_run(tmp_path / "a", 0)
    fake_run(tmp_path / "b", 1)
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "curves.png")]) == 0
    data = (tmp_path / "curves.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "loss, val_loss" in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "a"), "--metrics", "reward"]) == 2
    assert "no values for metric(s) reward; available: loss, val_loss" in capsys.readouterr().err  # errors: stderr
    with pytest.raises(FileNotFoundError, match=re.escape("no metrics.jsonl")):
        metric_series(tmp_path / "missing")


def test_metrics_truncate_after_a_resume_point(tmp_path):
    fake_run(tmp_path, 0)
    MetricsWriter(tmp_path, tensorboard=False).truncate_after(10)
    assert max(record["step"] for record in read_metrics(tmp_path)) == 10

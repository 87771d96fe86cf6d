"""``ember plot``: metrics.jsonl -> PNG, several runs overlaid; the metrics a resumed run keeps."""

import re
import struct
from pathlib import Path

import numpy as np
import pytest
from tensorboardX.proto.event_pb2 import Event, SessionLog

from ember.cli import main
from ember.core.errors import DataError
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
    # An --out suffix matplotlib cannot write was a ValueError traceback (after drawing).
    assert main(["plot", str(tmp_path / "a"), "--out", str(tmp_path / "curves.txt")]) == 2
    assert "--out" in (err := capsys.readouterr().err) and "'.txt'" in err and ".png" in err
    assert not (tmp_path / "curves.txt").exists()


def test_a_metric_logged_once_is_drawn(tmp_path, monkeypatch):
    # A value logged at one step (val_loss of a run evaluated once, a short run's final metrics)
    # was a line of one point: nothing visible, an empty panel.
    import matplotlib.figure

    from ember.training.plot import plot_runs

    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write(3, {"loss": 2.5, "val_loss": 2.4})
    writer.write(6, {"loss": 2.0})
    writer.close()
    drawn = {}

    def savefig(figure, *args, **kwargs):
        drawn.update({axis.get_title(): axis.get_lines() for axis in figure.axes if axis.get_visible()})

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    plot_runs([tmp_path], tmp_path / "metrics.png")
    (line,) = drawn["val_loss"]
    assert len(line.get_xdata()) == 1 and line.get_marker() not in (None, "", "None", " "), line.get_marker()


def test_the_path_printed_is_the_file_written(tmp_path, capsys):
    # matplotlib appends ".png" to a name without a suffix: before, '--out curves' wrote
    # curves.png and printed "wrote .../curves".
    fake_run(tmp_path / "a", 0)
    assert main(["plot", str(tmp_path / "a"), "--out", str(tmp_path / "curves"), "--metrics", "loss"]) == 0
    written = capsys.readouterr().out.split()[1]
    assert Path(written).is_file() and Path(written).read_bytes()[:4] == b"\x89PNG", written


def test_metrics_truncate_after_a_resume_point(tmp_path):
    fake_run(tmp_path, 0)
    MetricsWriter(tmp_path, tensorboard=False).truncate_after(10)
    assert max(record["step"] for record in read_metrics(tmp_path)) == 10


@pytest.mark.parametrize("line", ['{"loss": 1.5}', "[1, 2]", '{"step": "3", "loss": 1.0}'])
def test_a_line_that_is_not_a_metrics_record_is_named(tmp_path, capsys, line):
    # Before, 'ember plot' (and a resume's truncation) died with KeyError: 'step' or a TypeError.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n' + line + "\n")
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl line 2 is not a metrics record" in capsys.readouterr().err


def test_a_record_torn_by_a_killed_run_is_left_out_when_plotting_and_resuming(tmp_path):
    # Before, a last line cut short by a kill made read_metrics ('ember plot') and the resumed
    # run's truncate_after fail with a JSONDecodeError traceback.
    lines = [f'{{"step": {step}, "loss": {3.0 - step / 10}}}\n' for step in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + '{"step": 4, "lo')
    assert [record["step"] for record in read_metrics(tmp_path)] == [1, 2, 3]
    assert main(["plot", str(tmp_path)]) == 0
    MetricsWriter(tmp_path, tensorboard=False, resume_step=2)
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:2])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"st\n{"step": 3}\n')  # not a killed write
    with pytest.raises(DataError, match=re.escape("metrics.jsonl line 2 is not a JSON record")):
        read_metrics(tmp_path)


def tensorboard_scalars(run_dir, tag):
    """``{step: value}`` of ``tag`` as TensorBoard shows it: events read in order from every
    event file (tensorboard itself is not installed), and a session start at step ``s``
    (a ``purge_step``) hiding the events before it at steps ``>= s``."""
    values = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):  # records: length (8 bytes), its crc (4), event, its crc (4)
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 16 + length
            if event.session_log.status == SessionLog.START:
                values = {step: value for step, value in values.items() if step < event.step}
            values.update((event.step, v.simple_value) for v in event.summary.value if v.tag == tag)
    return values


def test_a_resumed_run_shows_each_step_once_in_tensorboard_too(tmp_path):
    """Killed after logging step 5, resumed from its checkpoint at step 4: steps 5 and 6 are
    logged again, and neither log keeps the abandoned step 5."""
    first = MetricsWriter(tmp_path, resume_step=0)  # as the trainer opens it for a fresh start
    for step in range(1, 6):
        first.write(step, {"loss": float(step)})
    first.close()
    resumed = MetricsWriter(tmp_path, resume_step=4)
    for step in (5, 6):
        resumed.write(step, {"loss": 10.0 * step})
    resumed.close()
    expected = {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 50.0, 6: 60.0}
    assert tensorboard_scalars(tmp_path, "loss") == expected
    assert {record["step"]: record["loss"] for record in read_metrics(tmp_path)} == expected

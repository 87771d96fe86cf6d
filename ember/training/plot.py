"""``ember plot RUN_DIR [RUN_DIR ...] [--out FILE.png] [--metrics loss,val_loss]``.

Draws every numeric metric of the runs' ``metrics.jsonl`` against the step, one panel per
metric, several runs overlaid (so seeds or variants compare at a glance), into a PNG.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ember.core.errors import ConfigError
from ember.training.metrics import read_metrics

SKIPPED = frozenset({"step", "time", "event"})


def metric_series(run_dir: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """``{metric: (steps, values)}`` of a run's finite numeric metrics."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for record in read_metrics(run_dir):
        for key, value in record.items():
            if (
                key in SKIPPED
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(record["step"])
            values.append(float(value))
    return series


def plot_runs(run_dirs: list[Path], out: Path, metrics: list[str] | None = None) -> list[str]:
    """Writes the figure to ``out``; returns the metric names drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {str(run_dir): metric_series(run_dir) for run_dir in run_dirs}
    names = metrics or sorted({name for series in runs.values() for name in series})
    missing = [name for name in names if not any(name in series for series in runs.values())]
    if missing or not names:
        available = sorted({name for series in runs.values() for name in series})
        raise ConfigError(
            f"no values for metric(s) {', '.join(missing) or '(any)'}; available: {', '.join(available)}",
            key="--metrics",
        )
    columns = min(3, len(names))
    rows = math.ceil(len(names) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    for axis, name in zip(axes.flat, names):
        for label, series in runs.items():
            if name in series:
                axis.plot(*series[name], label=Path(label).name, linewidth=1.2)
        axis.set_title(name)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if len(runs) > 1:
            axis.legend(fontsize=8)
    for axis in list(axes.flat)[len(names) :]:
        axis.set_visible(False)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories holding metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: RUN_DIR/metrics.png)")
    parser.add_argument("--metrics", default=None, help="comma-separated metric names (default: all)")


def run(args: argparse.Namespace) -> int:
    out = args.out or args.run_dirs[0] / "metrics.png"
    metrics = [m.strip() for m in args.metrics.split(",")] if args.metrics else None
    names = plot_runs(args.run_dirs, out, metrics)
    print(f"wrote {out} ({', '.join(names)})")
    return 0

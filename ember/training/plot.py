"""``ember plot RUN_DIR [RUN_DIR ...] [--out FILE.png] [--metrics loss,val_loss]``.

Draws every numeric metric of the runs' ``metrics.jsonl`` against the step, one panel per
metric, several runs overlaid (so seeds or variants compare at a glance), into a PNG. The
entries ``name/0``, ``name/1``, ... of a vector metric (an MoE's ``expert_load``, one per
expert) share the panel ``name``, one line each.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from ember.core.errors import ConfigError
from ember.training.metrics import read_metrics

SKIPPED = frozenset({"step", "time", "event"})
_VECTOR_ENTRY = re.compile(r"^(.+)/(\d+)$")


def panel_of(metric: str) -> str:
    """The panel a metric is drawn in: ``name`` for a vector entry ``name/<i>``, else itself."""
    match = _VECTOR_ENTRY.match(metric)
    return match.group(1) if match else metric


def _entries(series: dict[str, tuple[list[int], list[float]]], panel: str) -> list[tuple[str, tuple]]:
    """``(label suffix, (steps, values))`` of the metrics drawn in ``panel``, vector entries in index order."""
    if panel in series:
        return [("", series[panel])]
    entries = [(m, series[m]) for m in series if _VECTOR_ENTRY.match(m) and panel_of(m) == panel]
    return [(f" {m.rsplit('/', 1)[1]}", data) for m, data in sorted(entries, key=lambda e: int(e[0].rsplit("/", 1)[1]))]


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
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix and out.suffix[1:].lower() not in formats:
        raise ConfigError(
            f"--out {out}: matplotlib cannot write {out.suffix!r} files; use one of "
            f"{', '.join('.' + name for name in sorted(formats))}",
            key="--out",
        )
    runs = {str(run_dir): metric_series(run_dir) for run_dir in run_dirs}
    names = metrics or sorted({panel_of(name) for series in runs.values() for name in series})
    missing = [name for name in names if not any(_entries(series, name) for series in runs.values())]
    if missing or not names:
        available = sorted({panel_of(name) for series in runs.values() for name in series})
        raise ConfigError(
            f"no values for metric(s) {', '.join(missing) or '(any)'}; available: {', '.join(available)}",
            key="--metrics",
        )
    columns = min(3, len(names))
    rows = math.ceil(len(names) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    for axis, name in zip(axes.flat, names):
        lines = 0
        for label, series in runs.items():
            for suffix, data in _entries(series, name):
                # A value logged once is a line of one point, which draws nothing: mark it.
                marker = "o" if len(data[0]) == 1 else None
                axis.plot(*data, label=Path(label).name + suffix, linewidth=1.2, marker=marker)
                lines += 1
        axis.set_title(name)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if lines > 1:
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
    if not out.suffix:  # matplotlib would add it: say the name of the file written
        out = out.with_suffix(".png")
    metrics = [m.strip() for m in args.metrics.split(",")] if args.metrics else None
    names = plot_runs(args.run_dirs, out, metrics)
    print(f"wrote {out} ({', '.join(names)})")
    return 0

"""What every benchmark script shares: timing, device naming, the results file.

    from benchmarks.harness import time_fn, device_label, write_results

    seconds = time_fn(jax.jit(f), x)              # median wall time, compile excluded
    write_results("attention", {"rows": rows})    # benchmarks/results/attention-<device>.json

Run a benchmark as a module from the repository root: ``python -m benchmarks.attention``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ember.core.system_info import system_info

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def block(tree: Any) -> Any:
    """Waits for every array in ``tree`` to be computed."""
    return jax.block_until_ready(tree)


def time_fn(fn: Callable, *args, warmup: int = 2, repeats: int = 10, min_seconds: float = 0.0, **kwargs) -> float:
    """Median seconds per call of ``fn(*args, **kwargs)`` after ``warmup`` calls (which
    absorb compilation). Repeats until ``repeats`` calls and ``min_seconds`` have passed."""
    for _ in range(warmup):
        block(fn(*args, **kwargs))
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - started < min_seconds:
        start = time.perf_counter()
        block(fn(*args, **kwargs))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_compile(fn: Callable, *args, **kwargs) -> float:
    """Seconds to lower and compile a jitted ``fn`` for these arguments."""
    start = time.perf_counter()
    fn.lower(*args, **kwargs).compile()
    return time.perf_counter() - start


def device_label() -> str:
    """A short file-name-safe name of the first device: ``cpu``, ``h100``, ``h200``, ``tpu-v5e``."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind.lower()
    for name in ("h100", "h200", "a100", "b200", "l4"):
        if name in kind:
            return name
    return "-".join(kind.replace("nvidia", "").split()) or device.platform


def on_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


def on_tpu() -> bool:
    return jax.devices()[0].platform == "tpu"


def on_accelerator() -> bool:
    """A GPU or a TPU: the ops' ``impl="pallas"`` runs their compiled kernels here."""
    return on_gpu() or on_tpu()


def measured_bandwidth_gbs(num_bytes: int) -> float:
    """Device memory bandwidth in GB/s from a large elementwise pass (bytes read + written)."""
    x = jax.random.normal(jax.random.key(0), (num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda x: x * 2.0)
    return 2 * num_bytes / time_fn(copy, x, warmup=2, repeats=10) / 1e9


def measured_matmul_tflops(size: int, dtype=jnp.bfloat16) -> float:
    """Dense matmul rate in TFLOP/s of one ``size``-cubed product on random data."""
    a, b = (jax.random.normal(key, (size, size), dtype) for key in jax.random.split(jax.random.key(1)))
    matmul = jax.jit(lambda a, b: a @ b)
    return 2 * size**3 / time_fn(matmul, a, b, warmup=2, repeats=10) / 1e12


def write_results(name: str, payload: dict[str, Any], results_dir: Path | None = None) -> Path:
    """Writes ``payload`` with device and date to ``<results_dir>/<name>-<device>.json``
    (default ``benchmarks/results/``)."""
    results_dir = RESULTS_DIR if results_dir is None else Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}-{device_label()}.json"
    record = {
        "benchmark": name,
        "device": device_label(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "system": system_info(),
        **payload,
    }
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


def run_sections(name: str, sections: dict[str, Callable[[], Any]], description: str, argv=None) -> Path:
    """``python -m benchmarks.<name> [--section S ...]``: runs the chosen sections (default all)
    and writes ``results/<name>-<device>.json``, keeping the figures of sections not run
    (read just before writing: another run of other sections may have written meanwhile)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--section", action="append", choices=sorted(sections), help="run only these sections")
    args = parser.parse_args(argv)
    measured = {}
    for section in args.section or list(sections):
        print(f"== {section}")
        measured[section] = sections[section]()
    path = RESULTS_DIR / f"{name}-{device_label()}.json"
    results = json.loads(path.read_text()).get("results", {}) if path.is_file() else {}
    written = write_results(name, {"results": {**results, **measured}})
    print(f"wrote {written}")
    return written


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Prints ``rows`` as an aligned text table of ``columns`` (floats to 3 significant digits)."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}"
        return "" if value is None else str(value)

    table = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in table)) if table else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in table:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))

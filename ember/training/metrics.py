"""Run metrics that can be plotted: ``metrics.jsonl`` plus TensorBoard event files.

Every trainer (LM, RL) logs through ``MetricsWriter``; ``ember plot`` reads the JSONL back.
Each line of ``metrics.jsonl`` is one JSON object with at least ``step`` and either metric
values or an ``event`` message. Only the main process writes (``enabled``).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from ember.core.errors import DataError, PathNotFoundError
from ember.core.files import write_text_atomic
from ember.core.integers import is_integer

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsWriter:
    """Appends metrics of a run directory. A trainer starting from step ``resume_step`` (its
    checkpoint's, 0 for a fresh start) opens it with that step: the records past it are dropped from
    ``metrics.jsonl`` and hidden in TensorBoard (``purge_step``), since the run logs those
    steps again, so every step appears once in both."""

    def __init__(
        self, run_dir: str | Path, *, tensorboard: bool = True, enabled: bool = True, resume_step: int | None = None
    ):
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled
        self._tensorboard = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                self.truncate_after(resume_step)
            if tensorboard:
                from tensorboardX import SummaryWriter

                # A resume within the second of the last start would reuse its file name (time and
                # host) and overwrite it: the start step tells them apart and keeps them in order.
                has_start = resume_step is not None
                self._tensorboard = SummaryWriter(
                    logdir=str(Path(run_dir) / TENSORBOARD_DIR),
                    purge_step=resume_step + 1 if has_start else None,
                    filename_suffix=f".from{resume_step:09d}" if has_start else "",
                )

    def write(self, step: int, values: dict[str, Any]) -> None:
        """Logs scalar ``values`` at ``step`` (non-finite floats are written as strings)."""
        if not self.enabled:
            return
        record = {"step": int(step), "time": round(time.time(), 3), **{k: _jsonable(v) for k, v in values.items()}}
        self._append(record)
        if self._tensorboard is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(key, value, int(step))

    def event(self, step: int, message: str) -> None:
        """Logs a notable event (a skipped step, a resume) as ``{"step", "event"}``."""
        if self.enabled:
            self._append({"step": int(step), "time": round(time.time(), 3), "event": message})

    def truncate_after(self, step: int) -> None:
        """Drops records past ``step``: a run resuming from checkpoint ``step`` re-logs them,
        so every step appears exactly once."""
        if not self.enabled or not self.path.exists():
            return
        kept = [line for line, record in _parsed_lines(self.path) if record["step"] <= step]
        write_text_atomic(self.path, "".join(line + "\n" for line in kept))  # a crash keeps the old file

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def _append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``, in order."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise PathNotFoundError(f"{run_dir} has no {METRICS_FILE}; is it an Ember run directory?")
    return [record for _, record in _parsed_lines(path)]


def _parsed_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(line, record)`` of a ``metrics.jsonl``'s records; a last line without its newline that
    does not parse is one a killed run was writing, and is left out (``DataError`` for any other
    bad line)."""
    text = path.read_text()
    lines = text.splitlines()
    parsed = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise DataError(f"{path} line {number} is not a JSON record: {error}") from None
        if not isinstance(record, dict) or not is_integer(record.get("step")):
            raise DataError(f"{path} line {number} is not a metrics record (a JSON object with an integer 'step')")
        parsed.append((line, record))
    return parsed


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value

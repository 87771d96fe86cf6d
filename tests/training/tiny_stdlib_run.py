"""The demo's model (configs/lm/tiny.yaml) trained on the stdlib corpus for 200 of its 1500
steps, and linearised with the shipped configs/linearize/tiny.yaml: both are the linearize
notebook's runs (tests/notebooks.py runs it once per session). The trainer's learning test reads
the teacher's summary; the linearising tests take the teacher and the linearised run."""

from pathlib import Path

from tests.notebooks import executed_notebook


def tiny_stdlib_run(tmp_path_factory) -> Path:
    """The notebook's ``work`` directory: ``teacher/`` (the trained run), ``linearized/`` (the
    linearised run) and ``cache/`` (an ``EMBER_CACHE`` with the stdlib corpus prepared)."""
    work = executed_notebook(tmp_path_factory, "linearize.ipynb").work
    assert work is not None and all((work / name).is_dir() for name in ("teacher", "linearized", "cache")), work
    return work

"""The notebooks under examples/, executed top to bottom as a researcher would run them, once
per test session.

tests/test_examples.py runs every notebook through :func:`executed_notebook`. A test module
whose subject a notebook already trains reads the notebook's runs from the same execution
instead of training the same models again: test_grpo.py reads rl_lm's pretraining and GRPO
runs, test_quantize.py quantization's float, QAT and quantized runs, test_linearize.py and the
trainer's learning test linearize's teacher and linearised runs (tests/training/tiny_stdlib_run.py).
"""

import os
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.once_per_session import build_once
from tests.xla_settings import without_loop_emitters

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
XLA_OPTIMIZED = {"rl_lm.ipynb", "linearize.ipynb"}
"""Notebooks whose training runs outlast compiling: their kernels compile with XLA's optimizations
and fusion emitters (the suite's fast compile turns both off, see tests/xla_settings.py).
Measured with optimizations: rl_lm 77 -> 55 s; the others ran as fast or faster without them, but
for envs_and_rl (24 -> 17 s), whose seed sweep's asserted returns were measured with them off (a
seed's return changes with the compiled arithmetic)."""

# Appended to the executed copy: prints the notebook's own ``work`` directory, if it has one.
_PRINT_WORK = 'print(globals().get("work", ""))'


@dataclass(frozen=True)
class ExecutedNotebook:
    """A notebook after a clean run: ``cells`` with their outputs, ``work`` the directory its
    runs were written to (its ``work`` variable), or None for a notebook without one."""

    cells: list
    work: Path | None


def executed_notebook(tmp_path_factory, name: str) -> ExecutedNotebook:
    """Runs ``examples/<name>`` once per test session (whichever worker asks first) and returns
    it; a cell that raises fails the run with that cell's traceback (nbclient's
    ``CellExecutionError``), and every later caller runs it again and fails the same way."""

    def execute(directory: Path) -> None:
        notebook = nbformat.read(EXAMPLES / name, as_version=4)
        notebook.cells.append(nbformat.v4.new_code_cell(_PRINT_WORK))
        with pytest.MonkeyPatch.context() as patch:
            # The kernel gets the one CPU device a researcher's machine has, not the suite's 8 (a
            # notebook that shows sharding adds host devices to XLA_FLAGS itself): 8 devices'
            # collectives starved of CPU by the other test worker were seen to exceed XLA's 40 s
            # rendezvous timeout and kill the kernel.
            flags = os.environ.get("XLA_FLAGS", "").split()
            flags = " ".join(f for f in flags if "xla_force_host_platform_device_count" not in f)
            if name in XLA_OPTIMIZED:
                patch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
                flags = without_loop_emitters(flags)
            patch.setenv("XLA_FLAGS", flags)
            # A notebook prepares its corpora in its own ``work`` (``os.environ.setdefault``).
            patch.delenv("EMBER_CACHE", raising=False)
            # The notebook's temporary directories (its ``work``) land inside this session's.
            (directory / "tmp").mkdir()
            patch.setenv("TMPDIR", str(directory / "tmp"))
            client = NotebookClient(
                notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(directory)}}
            )
            client.execute()
        nbformat.write(notebook, directory / name)

    directory = build_once(tmp_path_factory, f"notebook-{name}", execute)
    notebook = nbformat.read(directory / name, as_version=4)
    printed = "".join(output.get("text", "") for output in notebook.cells[-1].get("outputs", [])).strip()
    return ExecutedNotebook(cells=notebook.cells[:-1], work=Path(printed) if printed else None)

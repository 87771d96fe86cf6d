"""``make test`` lints and format-checks the tree with ruff before it runs pytest, and a lint
error fails it. Checked by running the real ``make test`` recipe on a copy of the tree (with
pytest replaced by ``true``, so it does not recurse into this suite)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)  # the venv running this suite (make test's own)


def tracked_copy(destination: Path) -> Path:
    """The files git tracks (as they are in the working tree), copied under ``destination``."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def make_test(tree: Path) -> subprocess.CompletedProcess:
    # -o: treat the venv stamp as up to date (no reinstall); PY=true: the pytest step does nothing.
    stamp = VENV / ".ember-installed"
    command = ["make", "-C", str(tree), "-o", str(stamp), "test", f"VENV={VENV}", "PY=true", f"STAMP={stamp}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    if shutil.which("make") is None or not (VENV / "bin" / "ruff").is_file():
        pytest.skip("needs make and the project's venv with ruff (make test installs both)")
    return tracked_copy(tmp_path_factory.mktemp("lint") / "ember")


def test_make_test_runs_ruff_before_pytest(tree):
    result = make_test(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    check = next(i for i, line in enumerate(lines) if line.endswith("ruff check ."))
    format_check = next(i for i, line in enumerate(lines) if line.endswith("ruff format --check ."))
    pytest_line = next(i for i, line in enumerate(lines) if line.startswith("true -m pytest"))
    assert check < format_check < pytest_line


@pytest.mark.parametrize(
    ("planted", "finding"),
    [
        ("import os\n", "F401"),  # unused import
        ("def f(x):\n  return x\n", "1 file would be reformatted"),  # not ruff-formatted
    ],
)
def test_make_test_fails_on_a_lint_error(tree, planted, finding):
    target = tree / "ember" / "core" / "planted.py"
    target.write_text(planted)
    try:
        result = make_test(tree)
    finally:
        target.unlink()
    assert result.returncode != 0
    assert finding in result.stdout + result.stderr
    assert "-m pytest" not in result.stdout  # the suite does not run after a lint failure

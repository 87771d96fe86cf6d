"""Every notebook under examples/ runs top to bottom, as a researcher would run it (once per
session, tests/notebooks.py: test modules read the runs of some of them)."""

import pytest

from tests.notebooks import NOTEBOOKS, executed_notebook


def test_examples_exist():
    assert NOTEBOOKS, "examples/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path_factory):
    notebook = executed_notebook(tmp_path_factory, path.name)
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors

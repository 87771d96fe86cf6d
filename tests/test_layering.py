"""DESIGN.md section 1: imports run one way only. Checked on the source, statically."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ember"

# package -> the ember packages it may import (besides itself)
ALLOWED = {
    "core": set(),
    "kernels_pallas": {"core"},
    "envs": {"core"},
    "models": {"core", "kernels_pallas"},
    "training": {"core", "kernels_pallas", "models", "envs", "serving"},
    "serving": {"core", "kernels_pallas", "models"},
}


def ember_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] in ("tests", "benchmarks"):
                found.add(parts[0])
            elif parts[0] == "ember" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_run_one_way(package):
    violations = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for imported in ember_imports(path) - ALLOWED[package] - {package}:
            if imported in ALLOWED or imported in ("tests", "benchmarks"):
                violations.append(f"{path.relative_to(PACKAGE.parent)} imports {imported}")
    assert not violations, "imports against DESIGN.md's direction:\n" + "\n".join(violations)


def test_every_package_exists():
    for package in ALLOWED:
        assert (PACKAGE / package / "__init__.py").is_file()

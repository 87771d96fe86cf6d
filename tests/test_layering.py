"""DESIGN.md section 1: imports run one way only. Checked on the source, statically, by
:mod:`tests.import_rules`; the checker itself is tested by planting each way around it."""

import shutil
from pathlib import Path

import pytest

from tests.import_rules import PACKAGE_RULES, TOP_LEVEL_RULES, violations

PACKAGE = Path(__file__).resolve().parents[1] / "ember"


def test_ember_follows_the_import_rules():
    found = violations(PACKAGE)
    assert not found, "imports against DESIGN.md's rules:\n" + "\n".join(found)


def test_every_rule_names_what_exists():
    for package, allowed in PACKAGE_RULES.items():
        assert (PACKAGE / package / "__init__.py").is_file()
        assert allowed <= set(PACKAGE_RULES)
    for name, rule in TOP_LEVEL_RULES.items():
        assert (PACKAGE / f"{name}.py").is_file()
        assert rule.eager | rule.lazy <= set(PACKAGE_RULES) | set(TOP_LEVEL_RULES)


def test_serving_never_imports_training():
    assert "serving" in PACKAGE_RULES["training"] and "training" not in PACKAGE_RULES["serving"]


# (file to plant in, the code planted, a fragment the violation must contain)
BYPASSES = {
    "from_ember_import": ("serving/engine.py", "from ember import training\n", "imports ember.training;"),
    "relative_module": ("serving/engine.py", "from ..training import launcher\n", "imports ember.training.launcher;"),
    "relative_package": ("envs/spaces.py", "from .. import models\n", "imports ember.models;"),
    "import_dotted": ("envs/spaces.py", "import ember.models.decoder\n", "imports ember.models.decoder;"),
    "import_module_string": (
        "serving/engine.py",
        "def _sneak():\n    import importlib\n    return importlib.import_module('ember.training.lm')\n",
        "imports ember.training.lm;",
    ),
    "relative_import_module": (
        "serving/engine.py",
        "import importlib\n_lm = importlib.import_module('..training', 'ember.serving')\n",
        "imports ember.training;",
    ),
    "entry_point_string": (
        "core/registry.py",
        "_DEFAULT = 'ember.models.decoder:DecoderLM'\n",
        "imports ember.models.decoder;",
    ),
    "top_level_init": ("__init__.py", "from ember import models\n", "imports ember.models at import time"),
    "top_level_cli_eager": ("cli.py", "import ember.serving.engine\n", "imports ember.serving.engine at import time"),
    "top_level_cli_lazy": (
        "cli.py",
        "def _model():\n    from ember.models import decoder\n",
        "imports ember.models.decoder lazily",
    ),
    "top_level_new_file": ("extra.py", "import ember.core\n", "top-level file 'extra' has no import rule"),
    "new_package": ("plugins/__init__.py", "import ember.core\n", "package 'plugins' has no import rule"),
    "tests": ("core/tree.py", "from tests.tolerances import tolerance\n", "nothing in ember imports tests"),
    "benchmarks": (
        "models/flops.py",
        "def _f():\n    import benchmarks.attention\n",
        "nothing in ember imports benchmarks",
    ),
    "shadowed_op_module": (
        "models/decoder.py",
        "import ember.kernels_pallas.flash_attention as fa\n",
        "use 'from ... import'",
    ),
}


@pytest.fixture(scope="module")
def pristine_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "ember"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    assert not violations(root)
    return root


@pytest.mark.parametrize("bypass", sorted(BYPASSES))
def test_checker_catches(bypass, pristine_copy, tmp_path):
    relative, code, fragment = BYPASSES[bypass]
    root = tmp_path / "ember"
    shutil.copytree(pristine_copy, root)
    planted = root / relative
    planted.parent.mkdir(parents=True, exist_ok=True)
    with planted.open("a") as f:
        f.write("\n" + code)
    found = violations(root)
    assert len(found) == 1 and found[0].startswith(f"ember/{relative}"), found
    assert fragment in found[0], found

"""Every YAML file shipped under configs/ parses against its schema (DESIGN.md section 1)."""

import importlib
from pathlib import Path

import pytest

from ember.core.config import load_config, read_key
from ember.training.launcher import KINDS

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


# configs/<section>/ -> "module:Schema" of the files in it.
SCHEMAS = {
    "lm": "ember.training.lm.config:LMConfig",
    "rl": "ember.training.rl.config:RLConfig",
    "models": "ember.models.config:ModelConfig",
    "finetune": "ember.training.finetune.config:FinetuneConfig",
}
# What a section's configs leave to the command line (their ??? keys).
REQUIRED = {"finetune": ["base_model.path=path/to/model", "data.train=train.jsonl"]}


def schema_for(section: str):
    """The schema of configs/<section>/*.yaml. Each package that ships configs adds its own."""
    if section not in SCHEMAS:
        pytest.fail(f"no schema known for configs/{section}/; add it to tests/test_configs.py:SCHEMAS")
    module, name = SCHEMAS[section].split(":")
    return getattr(importlib.import_module(module), name)


SHIPPED = sorted(CONFIG_DIR.rglob("*.yaml")) + sorted(CONFIG_DIR.rglob("*.yml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_shipped_config_parses(path):
    section = path.relative_to(CONFIG_DIR).parts[0]
    kind = read_key(path, "kind")
    # A runnable config parses as its kind's schema (configs/rl_lm/ holds an lm and a grpo run).
    schema = importlib.import_module(KINDS[kind]).CONFIG_SCHEMA if kind in KINDS else schema_for(section)
    load_config(schema, path, REQUIRED.get(section, []))


def test_every_config_path_named_in_the_code_and_docs_exists():
    """A shipped config named by a docstring, a comment, the README or a notebook exists (the
    fine-tuning package's docstring named configs/finetune/lora_tiny.yaml long after it was gone)."""
    import re

    root = CONFIG_DIR.parent
    sources = [*root.glob("ember/**/*.py"), *CONFIG_DIR.rglob("*.yaml"), *root.glob("examples/*.ipynb")]
    sources += [root / "README.md", root / "benchmarks" / "README.md", root / "Makefile"]
    named = {
        (match, str(path.relative_to(root)))
        for path in sources
        for match in re.findall(r"configs/[a-z_]+/[\w.-]+\.ya?ml", path.read_text(encoding="utf-8"))
    }
    assert named
    missing = sorted((name, where) for name, where in named if not (root / name).is_file())
    assert not missing, missing

"""Every YAML file shipped under configs/ parses against its schema (DESIGN.md section 1)."""

from pathlib import Path

import pytest

from ember.core.config import load_config

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def schema_for(section: str):
    """The schema of configs/<section>/*.yaml. Each package that ships configs adds its own."""
    schemas = {
        "lm": lambda: __import__("ember.training.lm.config", fromlist=["LMConfig"]).LMConfig,
        "rl": lambda: __import__("ember.training.rl.config", fromlist=["RLConfig"]).RLConfig,
        "models": lambda: __import__("ember.models.config", fromlist=["ModelConfig"]).ModelConfig,
    }
    if section not in schemas:
        pytest.fail(f"no schema known for configs/{section}/; add it to tests/test_configs.py:schema_for")
    return schemas[section]()


SHIPPED = sorted(CONFIG_DIR.rglob("*.yaml")) + sorted(CONFIG_DIR.rglob("*.yml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_shipped_config_parses(path):
    section = path.relative_to(CONFIG_DIR).parts[0]
    load_config(schema_for(section), path)

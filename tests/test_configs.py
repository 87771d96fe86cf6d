"""Every YAML file shipped under configs/ parses against its schema (DESIGN.md section 1)."""

import importlib
from pathlib import Path

import pytest

from ember.core.config import load_config, read_key
from ember.training.data.arithmetic import arithmetic_problems
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


def test_path_values_are_taken_from_the_current_directory_and_stored_absolute(tmp_path, monkeypatch):
    """Relative paths in a YAML file or an override are relative to the current directory (not
    the YAML file's, which only ``base:`` is) and become absolute on load, so a run's saved
    config names them from anywhere; built-in dataset names and prompt sources stay names.
    Before, they stayed relative (``data``, ``p.jsonl``) and broke from another directory."""
    from ember.training.finetune.config import FinetuneConfig
    from ember.training.linearize.config import LinearizeRunConfig
    from ember.training.lm.config import LMConfig
    from ember.training.rl_lm.config import GRPOConfig

    cwd, elsewhere = tmp_path / "cwd", tmp_path / "configs"
    cwd.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(cwd)
    (elsewhere / "lm.yaml").write_text("kind: lm\ndata: {dataset: data}\n")
    assert load_config(LMConfig, elsewhere / "lm.yaml").data.dataset == str(cwd / "data")
    assert load_config(LMConfig, None, ["data.dataset=../d/./x"]).data.dataset == str(tmp_path / "d" / "x")
    for name in ("stdlib", "arithmetic"):
        assert load_config(LMConfig, None, [f"data.dataset={name}"]).data.dataset == name
    finetune = load_config(FinetuneConfig, None, ["base_model.path=base", "data.train=t.jsonl", "data.eval=e.jsonl"])
    assert (finetune.base_model.path, finetune.data.train, finetune.data.eval) == tuple(
        str(cwd / name) for name in ("base", "t.jsonl", "e.jsonl")
    )
    linearize = load_config(LinearizeRunConfig, None, ["base_model.path=runs/tiny", "data.dataset=data"])
    assert (linearize.base_model.path, linearize.data.dataset) == (str(cwd / "runs/tiny"), str(cwd / "data"))
    grpo = load_config(GRPOConfig, None, ["base_model.path=run", "prompts.source=p.jsonl", "prompts.eval=e.jsonl"])
    assert (grpo.base_model.path, grpo.prompts.source, grpo.prompts.eval) == tuple(
        str(cwd / name) for name in ("run", "p.jsonl", "e.jsonl")
    )
    assert load_config(GRPOConfig, None, ["base_model.path=run"]).prompts.source == "arithmetic"


def test_shipped_arithmetic_sample_prompts_are_problems_of_the_corpus():
    # Before, configs/rl_lm/arithmetic_pretrain.yaml sampled "12+34=", "7+58=" and "40+40=" from a
    # model that had only seen operands below its max_operand, 30: every prompt outside its corpus.
    from ember.training.lm.config import LMConfig

    checked = 0
    for path in SHIPPED:
        config = load_config(LMConfig, path) if read_key(path, "kind") == "lm" else None
        if config is None or config.data.dataset != "arithmetic":
            continue
        corpus = config.data.arithmetic
        problems = {p.prompt for p in arithmetic_problems(corpus.max_operand, corpus.operators)}
        outside = [prompt for prompt in config.sample.prompts if prompt not in problems]
        assert not outside, f"{path.name}: sample prompts {outside} are not problems below {corpus.max_operand}"
        checked += 1
    assert checked >= 1

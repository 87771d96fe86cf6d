"""ember.core.config: schemas from YAML + overrides, precise errors, base files, round trip."""

import dataclasses
import re

import pytest

from ember.core.config import from_yaml, load_config, parse_overrides, read_key, to_dict, to_yaml
from ember.core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-4
    betas: tuple[float, ...] = (0.9, 0.95)

    def __post_init__(self):
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be positive, got {self.lr}", key="optim.lr")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 8
    remat: bool = False


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    run_dir: str = "runs/default"
    seed: int = 0
    notes: str | None = None
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    tags: dict[str, str] = dataclasses.field(default_factory=dict)


def write(path, text):
    path.write_text(text)
    return path


def test_defaults_file_and_overrides_merge_in_order(tmp_path):
    config_file = write(tmp_path / "exp.yaml", "run_dir: runs/a\ntrain:\n  steps: 20\noptim:\n  lr: 0.001\n")
    config = load_config(ExperimentConfig, config_file, ["train.steps=7", "optim.betas=[0.8,0.9]", "tags.team=rl"])
    assert config == ExperimentConfig(
        run_dir="runs/a",
        train=TrainConfig(steps=7, batch_size=8),
        optim=OptimConfig(lr=0.001, betas=(0.8, 0.9)),
        tags={"team": "rl"},
    )
    assert dataclasses.is_dataclass(config.train)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 3


def test_values_are_typed_by_the_schema():
    config = load_config(ExperimentConfig, None, ["train.steps=12", "optim.lr=1e-3", "train.remat=true", "notes=null"])
    assert config.train.steps == 12 and isinstance(config.train.steps, int)
    assert config.optim.lr == pytest.approx(1e-3) and isinstance(config.optim.lr, float)
    assert config.train.remat is True and config.notes is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("true", True),
        ("False", False),
        ("yes", True),
        ("no", False),
        ("on", True),
        ("off", False),
        ("1", True),
        ("0", False),
    ],
)
def test_a_bool_field_takes_the_spellings_of_true_and_false(value, expected):
    assert load_config(ExperimentConfig, None, [f"train.remat={value}"]).train.remat is expected


@pytest.mark.parametrize(
    ("override", "got"),
    [("2", "2 (int)"), ("-1", "-1 (int)"), ("'2'", "'2' (str)"), ("0.5", "0.5 (float)"), ("maybe", "'maybe' (str)")],
)
def test_a_bool_field_refuses_other_values_and_says_what_it_takes(override, got, tmp_path):
    # Before, OmegaConf read any nonzero integer as true: train.remat=2, -1 or '2' gave remat=True.
    with pytest.raises(ConfigError) as info:
        load_config(ExperimentConfig, None, [f"train.remat={override}"])
    assert info.value.key == "train.remat"
    assert str(info.value) == (
        f"config key 'train.remat' (from command-line overrides) expects bool, got {got}; write true or false"
    )
    config_file = write(tmp_path / "flag.yaml", f"train:\n  remat: {override}\n")
    with pytest.raises(ConfigError, match=r"config key 'train.remat' \(from .*flag.yaml\) expects bool, got"):
        load_config(ExperimentConfig, config_file)


def test_unknown_key_lists_valid_keys_and_closest_match(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(ExperimentConfig, None, ["train.stpes=3"])
    message = str(info.value)
    assert info.value.key == "train.stpes"
    assert "unknown config key 'train.stpes'" in message
    assert "Did you mean 'train.steps'?" in message
    assert "Valid keys under 'train': batch_size, remat, steps" in message

    config_file = write(tmp_path / "bad.yaml", "optimizer:\n  lr: 1.0\n")
    with pytest.raises(ConfigError) as info:
        load_config(ExperimentConfig, config_file)
    assert info.value.key == "optimizer"
    assert str(config_file) in str(info.value)
    assert "Did you mean 'optim'?" in str(info.value)
    assert "Valid keys: notes, optim, run_dir, seed, tags, train" in str(info.value)


def test_unknown_key_without_close_match_still_lists_valid_keys():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'zzz' \(from command-line overrides\)\. Valid keys: notes"
    ):
        load_config(ExperimentConfig, None, ["zzz=1"])


def test_wrong_type_names_the_key_and_expected_type(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(ExperimentConfig, None, ["train.steps=many"])
    assert info.value.key == "train.steps"
    assert str(info.value) == "config key 'train.steps' (from command-line overrides) expects int, got 'many' (str)"

    config_file = write(tmp_path / "typed.yaml", "optim:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=r"config key 'optim.lr' \(from .*typed.yaml\) expects float, got 'fast'"):
        load_config(ExperimentConfig, config_file)

    # An element of a tuple field: OmegaConf's own error names no key (before, the message was
    # "config key '' (from command-line overrides): None").
    with pytest.raises(ConfigError) as info:
        load_config(ExperimentConfig, None, ["train.steps=3", "optim.betas=[0.9,fast]"])
    assert info.value.key == "optim.betas"
    assert str(info.value) == (
        "config key 'optim.betas' (from command-line overrides) expects tuple[float], got [0.9, 'fast'] (list)"
    )
    # A list for a dict field, a mapping for a tuple field: OmegaConf raised a bare TypeError
    # ("Cannot merge incompatible container types"), a traceback from the CLI.
    for override, key, expected, got in [
        ("tags=[a,b]", "tags", "dict[str, str]", "['a', 'b'] (list)"),
        ("optim.betas={a: 1}", "optim.betas", "tuple[float]", "{'a': 1} (dict)"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(ExperimentConfig, None, [override])
        assert info.value.key == key
        assert str(info.value) == f"config key '{key}' (from command-line overrides) expects {expected}, got {got}"


@pytest.mark.parametrize("override", ["train.steps", "=3", "train..steps=3", "train steps=3", "1train=3"])
def test_malformed_override_shows_the_expected_form(override):
    with pytest.raises(ConfigError) as info:
        parse_overrides([override])
    assert f"malformed override {override!r}: expected key.sub=value" in str(info.value)


@pytest.mark.parametrize(
    ("override", "key"),
    [("sharding.rules={vocab:[]}", "sharding.rules"), ("train.freeze=[a,b", "train.freeze"), ('run_dir="x', "run_dir")],
)
def test_an_override_whose_value_is_not_yaml_is_named(override, key):
    # Before, YAML's own ScannerError / ParserError escaped: a traceback from 'ember train'.
    with pytest.raises(ConfigError) as info:
        parse_overrides(["train.steps=3", override])
    assert info.value.key == key
    assert str(info.value).startswith(
        f"override {override!r}: the value {override.split('=', 1)[1]!r} is not valid YAML"
    )


def test_schema_validation_errors_pass_through_with_their_key():
    with pytest.raises(ConfigError) as info:
        load_config(ExperimentConfig, None, ["optim.lr=-1"])
    assert info.value.key == "optim.lr"
    assert "optim.lr must be positive, got -1.0" in str(info.value)


@dataclasses.dataclass(frozen=True)
class PlainValidatedSection:
    width: int = 1

    def __post_init__(self):
        if self.width < 1:
            raise ValueError(f"section.width must be positive, got {self.width}")


@dataclasses.dataclass(frozen=True)
class PlainValidatedConfig:
    """Validates with a plain ValueError, top level and nested, as most Ember schemas do."""

    mode: str = "a"
    section: PlainValidatedSection = dataclasses.field(default_factory=PlainValidatedSection)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def __post_init__(self):
        if self.mode not in ("a", "b"):
            raise ValueError(f"mode must be 'a' or 'b', got {self.mode!r}")
        if self.train.steps < 0:
            raise ValueError(f"train.steps must be >= 0, got {self.train.steps}")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("mode=c", "mode must be 'a' or 'b', got 'c'"),
        ("train.steps=-2", "train.steps must be >= 0, got -2"),
        ("section.width=0", "section.width must be positive, got 0"),
    ],
)
def test_plain_value_errors_of_a_schema_become_config_errors(override, message):
    with pytest.raises(ConfigError, match=f"invalid config: {message}"):
        load_config(PlainValidatedConfig, None, [override])


@dataclasses.dataclass(frozen=True)
class PolicySection:
    width: int = 4

    def __post_init__(self):
        if self.width < 1:  # keyed relative to the section, as a reusable section should be
            raise ConfigError(f"width must be positive, got {self.width}", key="width")


@dataclasses.dataclass(frozen=True)
class AlgoSection:
    steps: int = 1
    policy: PolicySection = dataclasses.field(default_factory=PolicySection)

    def __post_init__(self):
        if self.steps < 1:
            raise ConfigError(f"steps must be positive, got {self.steps}", key="steps")


@dataclasses.dataclass(frozen=True)
class NestedConfig:
    algo: AlgoSection = dataclasses.field(default_factory=AlgoSection)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)


@pytest.mark.parametrize(
    ("override", "key", "message"),
    [
        ("algo.steps=0", "algo.steps", "algo.steps must be positive, got 0"),
        ("algo.policy.width=-3", "algo.policy.width", "algo.policy.width must be positive, got -3"),
        ("optim.lr=-1", "optim.lr", "optim.lr must be positive, got -1.0"),  # a section that names itself
    ],
)
def test_a_nested_section_error_carries_the_full_key_path(override, key, message):
    with pytest.raises(ConfigError) as info:
        load_config(NestedConfig, None, [override])
    assert info.value.key == key and str(info.value) == message


def test_base_file_inheritance_chain(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "root.yaml", "run_dir: runs/root\nseed: 1\ntrain:\n  steps: 10\n  batch_size: 4\n")
    write(tmp_path / "sub" / "middle.yaml", "base: ../root.yaml\nseed: 2\ntrain:\n  steps: 20\n")
    leaf = write(tmp_path / "sub" / "leaf.yaml", "base: middle.yaml\ntrain:\n  steps: 30\n")
    config = load_config(ExperimentConfig, leaf)
    assert (config.run_dir, config.seed, config.train.steps, config.train.batch_size) == ("runs/root", 2, 30, 4)


def test_a_section_can_extend_its_own_base_file(tmp_path):
    (tmp_path / "optim").mkdir()
    write(tmp_path / "optim" / "base.yaml", "name: lion\nlr: 0.5\nbetas: [0.1, 0.2]\n")
    write(tmp_path / "optim" / "fast.yaml", "base: base.yaml\nlr: 2.0\n")
    experiment = write(tmp_path / "exp.yaml", "seed: 4\noptim:\n  base: optim/fast.yaml\n  betas: [0.3]\n")
    config = load_config(ExperimentConfig, experiment, ["optim.name=sgd"])
    assert config.optim == OptimConfig(name="sgd", lr=2.0, betas=(0.3,))
    assert config.seed == 4
    write(tmp_path / "typo.yaml", "optim:\n  base: optim/base.yaml\n  lrr: 1.0\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lrr'.*Did you mean 'optim.lr'"):
        load_config(ExperimentConfig, tmp_path / "typo.yaml")


def test_base_file_errors(tmp_path):
    a = write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="form a cycle"):
        load_config(ExperimentConfig, a)
    missing = write(tmp_path / "c.yaml", "base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"config file not found: .*nowhere.yaml"):
        load_config(ExperimentConfig, missing)
    broken = write(tmp_path / "d.yaml", "train: [unclosed\n")
    with pytest.raises(ConfigError, match="could not parse YAML file"):
        load_config(ExperimentConfig, broken)


def test_yaml_round_trip_is_exact():
    config = load_config(
        ExperimentConfig,
        None,
        [
            "run_dir=runs/x y",
            "seed=123",
            "notes='a: colon'",
            "train.remat=true",
            "optim.lr=1.5e-4",
            "optim.betas=[0.5,0.25]",
            "tags.k=v",
        ],
    )
    text = to_yaml(config)
    assert from_yaml(ExperimentConfig, text) == config
    assert to_yaml(from_yaml(ExperimentConfig, text)) == text
    assert to_dict(config)["optim"] == {"name": "adamw", "lr": 1.5e-4, "betas": (0.5, 0.25)}
    # Strings holding "${" are values, not interpolations: before, from_yaml failed with
    # "Interpolation key 'HOME' not found" (a run's config.yaml could not be read back).
    literal = dataclasses.replace(config, notes="echo ${HOME} \\${x}", tags={"js": "`${a}`"})
    assert from_yaml(ExperimentConfig, to_yaml(literal)) == literal
    assert to_dict(literal)["tags"] == {"js": "`${a}`"}


def test_mapping_source_is_validated_like_a_file():
    assert load_config(ExperimentConfig, {"train": {"steps": 5}}).train.steps == 5
    with pytest.raises(ConfigError, match=re.escape("unknown config key 'train.step'")):
        load_config(ExperimentConfig, {"train": {"step": 5}})


def test_read_key_sees_bases_and_overrides_without_a_schema(tmp_path):
    write(tmp_path / "base.yaml", "kind: ppo\nextra: 1\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\nother: 2\n")
    assert read_key(child, "kind") == "ppo"
    assert read_key(child, "kind", ["kind=dqn"]) == "dqn"
    assert read_key(child, "missing", default="lm") == "lm"

"""The LM experiment config: everything ``ember train`` needs for a language-model run.

    kind: lm
    run_dir: runs/tiny
    model: {base: ../models/tiny.yaml}
    train: {steps: 300, batch_size: 16, seq_len: 128}
    optim: {lr: 3e-3}
    mesh: {data: -1}

Every section is a frozen dataclass, so unknown keys and wrong types fail at load time with
the key path, before anything compiles. :meth:`LMConfig.identity` is what a run directory
is bound to; the rest (``RUNTIME_KEYS``, the model's ``RUNTIME_FIELDS``) may change on resume.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ember.core.config import absolute_path
from ember.core.distributed import DistributedConfig
from ember.core.errors import ConfigError
from ember.core.sharding import MeshConfig, logical_rules
from ember.models.config import ModelConfig
from ember.serving.requests import MAX_SEED, SamplingParams
from ember.training.config import CheckpointConfig, LoggingConfig, LoopConfig
from ember.training.data import stdlib_corpus_dir
from ember.training.data.arithmetic import arithmetic_corpus_dir
from ember.training.optimizers import OptimConfig
from ember.training.quantization.qat import QatConfig

RUNTIME_KEYS: tuple[str, ...] = (
    "run_dir",
    "mesh",
    "sharding",
    "distributed",
    "logging",
    "checkpoint",
    "sample",
    "train.steps",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.grad_accum",
    "train.on_nan",
)
"""Keys (and sections) that say how this process runs the experiment, not what it is: a run
resumes with any of them changed; so may the model's ``ember.models.config.RUNTIME_FIELDS``.
``train.on_nan`` is one: its policies train the same while the loss is finite, and a run stopped by
a non-finite loss is told to resume from its last good checkpoint with ``train.on_nan=skip``."""


@dataclasses.dataclass(frozen=True)
class ArithmeticCorpusConfig:
    """The generated corpus ``data.dataset: arithmetic`` trains on (see
    ``ember.training.data.arithmetic.arithmetic_corpus_dir``): every ``a<op>b`` below
    ``max_operand``, less the ``held_out_fraction`` kept for evaluation, ``repeats`` passes,
    a ``wrong_fraction`` of the answers off by one."""

    max_operand: int = 100
    operators: str = "+"
    held_out_fraction: float = 0.1
    wrong_fraction: float = 0.0
    repeats: int = 4

    def directory(self, seed: int) -> Path:
        try:
            return arithmetic_corpus_dir(
                self.max_operand,
                self.operators,
                self.held_out_fraction,
                wrong_fraction=self.wrong_fraction,
                repeats=self.repeats,
                seed=seed,
            )
        except ConfigError as error:
            raise ConfigError(f"data.arithmetic.{error}", key=f"data.arithmetic.{error.key}") from None


BUILTIN_DATASETS = {
    "stdlib": lambda _: stdlib_corpus_dir(),
    "arithmetic": lambda data: data.arithmetic.directory(data.seed),
}
"""``data.dataset`` names of corpora prepared on first use (anything else is a directory)."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """``dataset``: ``stdlib`` (the Python standard library's sources, prepared on first use),
    ``arithmetic`` (generated ``"a+b=c"`` problems, ``ember.training.data.arithmetic``, less
    the held-out ones GRPO evaluates on) or the directory of a dataset made by
    ``ember data prepare``. A relative directory, on the command line or in a YAML file, is
    taken from the current directory and stored absolute (``ember.core.config.absolute_path``),
    so the run's saved config finds it from anywhere (``ember quantize RUN``)."""

    dataset: str = "stdlib"
    seed: int = 0
    arithmetic: ArithmeticCorpusConfig = dataclasses.field(default_factory=ArithmeticCorpusConfig)

    def __post_init__(self):
        check_data_seed(self.seed)
        if self.dataset not in BUILTIN_DATASETS:
            object.__setattr__(self, "dataset", absolute_path(self.dataset))


def check_data_seed(seed: int) -> None:
    """``data.seed`` seeds NumPy's shuffles (``default_rng([seed, epoch])``), which take no
    negative seed: a ``ConfigError`` keyed ``data.seed`` now, not a ``ValueError`` at the first batch."""
    if seed < 0:
        raise ConfigError(f"data.seed must be a non-negative integer, got {seed}", key="data.seed")


@dataclasses.dataclass(frozen=True)
class TrainLoopConfig(LoopConfig):
    """The loop (see ``LoopConfig``) and the batch: ``batch_size`` is global (all processes)
    and split into ``grad_accum`` micro-batches; up to ``eval_batches`` validation batches per eval
    (one pass over the validation set at most)."""

    batch_size: int = 16
    seq_len: int = 256
    eval_batches: int = 4

    def __post_init__(self):
        super().__post_init__()
        for name in ("batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"train.{name} must be a positive integer, got {getattr(self, name)}", key=f"train.{name}"
                )
        if self.eval_batches < 0:
            raise ConfigError(f"train.eval_batches must be >= 0, got {self.eval_batches}", key="train.eval_batches")
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"train.batch_size ({self.batch_size}) must be divisible by train.grad_accum ({self.grad_accum})",
                key="train.grad_accum",
            )


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """Text sampled from the model at the end of training (empty ``prompts`` skips it), through
    the serving engine's decode path and sampler: ``temperature`` 0 is greedy, ``top_k`` 0
    and ``top_p`` 1 are off; prompt ``i`` draws with seed ``seed + i``. Values are checked
    on load by the engine's ``SamplingParams`` rules; prompts longer than the model's context
    when the run opens its tokenizer (``LMTask``), both before anything trains."""

    prompts: tuple[str, ...] = ("def ", "import ", "class ")
    max_tokens: int = 64
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for name in ("max_tokens", "temperature", "top_k", "top_p", "seed"):
            try:  # the serving engine's own rules, which the samples go through
                SamplingParams(**{name: getattr(self, name)})
            except ValueError as error:
                raise ConfigError(f"sample.{error}", key=f"sample.{name}") from None
        if not all(self.prompts):
            raise ConfigError("sample.prompts must not contain empty strings", key="sample.prompts")
        if self.prompts and self.seed + len(self.prompts) - 1 > MAX_SEED:  # prompt i draws with seed + i
            raise ConfigError(
                f"sample.seed + i seeds prompt i: with {len(self.prompts)} prompts sample.seed must be at most "
                f"{MAX_SEED - len(self.prompts) + 1}, got {self.seed}",
                key="sample.seed",
            )


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Overrides of the logical -> mesh axis rules, e.g. ``{vocab: []}`` to replicate vocab."""

    rules: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        logical_rules(self.rules)  # an unknown logical or mesh axis fails with the config, not after loading data


@dataclasses.dataclass(frozen=True)
class LMConfig:
    kind: str = "lm"
    run_dir: str = "runs/lm"
    seed: int = 0
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainLoopConfig = dataclasses.field(default_factory=TrainLoopConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    qat: QatConfig = dataclasses.field(default_factory=QatConfig)

    def __post_init__(self):
        if self.kind != "lm":
            raise ConfigError(f"kind must be 'lm' for a language-model config, got {self.kind!r}", key="kind")
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"train.seq_len ({self.train.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})",
                key="train.seq_len",
            )
        experts = self.model.moe.num_experts
        if "moe" in self.model.mlp_pattern and self.mesh.expert > 1 and experts % self.mesh.expert:
            raise ConfigError(
                f"mesh.expert={self.mesh.expert} does not divide model.moe.num_experts={experts}: each expert-parallel "
                "rank holds an equal share of the experts; choose a mesh.expert that divides it (or 1)",
                key="mesh.expert",
            )
        start = self.qat.start_step(self.train.steps)
        if self.qat.format and start >= self.train.steps:  # steps run 0 .. train.steps - 1
            raise ConfigError(
                f"qat.fraction {self.qat.fraction} of train.steps {self.train.steps} leaves no step trained with QAT "
                f"(its phase would start at step {start}); raise qat.fraction or train.steps",
                key="qat.fraction",
            )

    def identity(self) -> dict[str, Any]:
        """The flattened ``key: value`` pairs that define the run (what must not change on
        resume): everything but ``RUNTIME_KEYS``, with the model reduced to its architecture."""
        sections = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        sections["model"] = self.model.architecture()
        return run_identity(sections, RUNTIME_KEYS)


def run_identity(sections: dict[str, Any], runtime_keys: tuple[str, ...]) -> dict[str, Any]:
    """A run config's flattened ``key: value`` pairs (``sections``: its fields, dataclasses
    or values) without ``runtime_keys`` and the keys under them: what a resume must keep."""
    flat = flatten_keys({k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in sections.items()})
    return {k: v for k, v in flat.items() if not any(k == r or k.startswith(r + ".") for r in runtime_keys)}


def flatten_keys(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": {}}`` -> ``{"a.b": 1}`` (an empty dict adds no key)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_keys(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat

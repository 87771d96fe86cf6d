"""The LM experiment config: everything ``ember train`` needs for a language-model run.

    kind: lm
    run_dir: runs/tiny
    model: {base: ../models/tiny.yaml}
    train: {steps: 300, batch_size: 16, seq_len: 128}
    optim: {lr: 3e-3}
    mesh: {data: -1}

Every section is a frozen dataclass, so unknown keys and wrong types fail at load time with
the key path, before anything compiles.
"""

from __future__ import annotations

import dataclasses

from ember.core.distributed import DistributedConfig
from ember.core.errors import ConfigError
from ember.core.sharding import MeshConfig
from ember.models.config import ModelConfig
from ember.training.optimizers import OptimConfig

NAN_POLICIES = ("stop", "skip")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """``dataset``: ``stdlib`` (the Python standard library's sources, prepared on first use)
    or the directory of a dataset made by ``ember data prepare``."""

    dataset: str = "stdlib"
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class TrainLoopConfig:
    """``batch_size`` is global (all processes) and split into ``grad_accum`` micro-batches."""

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    on_nan: str = "stop"

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be a positive integer, got {getattr(self, name)}", key=f"train.{name}")
        if self.eval_batches < 0:
            raise ConfigError(f"train.eval_batches must be >= 0, got {self.eval_batches}", key="train.eval_batches")
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"train.batch_size ({self.batch_size}) must be divisible by train.grad_accum ({self.grad_accum})",
                key="train.grad_accum",
            )
        if self.on_nan not in NAN_POLICIES:
            raise ConfigError(f"train.on_nan must be one of {', '.join(NAN_POLICIES)}, got {self.on_nan!r}",
                              key="train.on_nan")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """``every``: save period in steps (a final save always happens); ``keep``: newest N kept."""

    every: int = 200
    keep: int = 3
    async_save: bool = True

    def __post_init__(self):
        if self.every < 1 or self.keep < 1:
            raise ConfigError("checkpoint.every and checkpoint.keep must be positive", key="checkpoint.every")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    progress: bool = True
    tensorboard: bool = True


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """Text sampled from the model at the end of training (empty ``prompts`` skips it), through
    the serving engine's decode path and sampler: ``temperature`` 0 is greedy, ``top_k`` 0
    and ``top_p`` 1 are off; prompt ``i`` draws with seed ``seed + i``."""

    prompts: tuple[str, ...] = ("def ", "import ", "class ")
    max_tokens: int = 64
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Overrides of the logical -> mesh axis rules, e.g. ``{vocab: []}`` to replicate vocab."""

    rules: dict[str, list[str]] = dataclasses.field(default_factory=dict)


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

    def __post_init__(self):
        if self.kind != "lm":
            raise ConfigError(f"kind must be 'lm' for a language-model config, got {self.kind!r}", key="kind")
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"train.seq_len ({self.train.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})",
                key="train.seq_len",
            )

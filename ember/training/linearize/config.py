"""The linearising experiment config (``kind: linearize``, for ``ember linearize`` and ``ember
train``): a pretrained softmax model made linear-time in two stages (LoLCATs).

    kind: linearize
    run_dir: runs/tiny-linearized
    base_model: {path: runs/tiny}             # an Ember LM run or a Hugging Face directory
    data: {dataset: stdlib}                   # LM text, as kind: lm
    linear: {window: 16, feature_dim: 4}      # the window_linear layers
    transfer:                                 # stage 1: attention transfer (feature maps only)
      train: {steps: 100, batch_size: 16, seq_len: 128}
      optim: {lr: 1e-2}
    adapter: {rank: 1, alpha: 2, targets: [q, k, v]}   # stage 2: LoRA, next-token loss
    train: {steps: 100, batch_size: 16, seq_len: 128}
    optim: {lr: 1e-3}
    distill: {weight: 0.0}                    # > 0 adds KL to the teacher's next-token distribution

``run_dir`` is the stage-2 run (the linearised model: ``ember generate``, ``export`` and ``plot``
take it) and holds ``attention_transfer/``, the stage-1 run, and ``summary.json`` with both
stages' figures. The sections shared with ``kind: lm`` / ``finetune`` mean the same; so do
their paths (``base_model.path``, a ``data.dataset`` directory): relative to the current
directory, stored absolute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ember.core.distributed import DistributedConfig
from ember.core.errors import ConfigError
from ember.core.sharding import MeshConfig
from ember.models.adapters.lora import LoraConfig
from ember.models.linearize import LinearizeConfig
from ember.training.config import CheckpointConfig, LoggingConfig
from ember.training.finetune.config import BASE_MODEL_RUNTIME_KEYS, BaseModelConfig
from ember.training.lm.config import RUNTIME_KEYS, DataConfig, ShardingConfig, TrainLoopConfig, run_identity
from ember.training.optimizers import OptimConfig

TRANSFER_DIR = "attention_transfer"
"""The stage-1 run's directory inside ``run_dir``."""


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    """Stage 1, attention transfer: the base frozen, only the feature maps and the window mix
    train, on the sum over layers of each layer's mean squared error against the softmax
    attention it replaces. Its own loop and optimizer (the ``train``/``optim`` sections)."""

    train: TrainLoopConfig = dataclasses.field(default_factory=lambda: TrainLoopConfig(steps=200, eval_every=100))
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-2, weight_decay=0.0))


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Stage 2's optional distillation: ``weight`` times the KL divergence from the teacher's
    next-token distribution (at ``temperature``) to the student's, added to the next-token
    loss (0: none, and no teacher forward)."""

    weight: float = 0.0
    temperature: float = 1.0

    def __post_init__(self):
        if self.weight < 0:
            raise ConfigError(f"distill.weight must be >= 0 (0 = off), got {self.weight}", key="distill.weight")
        if self.temperature <= 0:
            raise ConfigError(
                f"distill.temperature must be positive, got {self.temperature}", key="distill.temperature"
            )


@dataclasses.dataclass(frozen=True)
class LinearizeRunConfig:
    kind: str = "linearize"
    run_dir: str = "runs/linearized"
    seed: int = 0
    base_model: BaseModelConfig = dataclasses.field(default_factory=BaseModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    linear: LinearizeConfig = dataclasses.field(default_factory=LinearizeConfig)
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    adapter: LoraConfig = dataclasses.field(default_factory=lambda: LoraConfig(rank=8, alpha=16.0))
    train: TrainLoopConfig = dataclasses.field(default_factory=TrainLoopConfig)
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-3, weight_decay=0.0))
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def __post_init__(self):
        if self.kind != "linearize":
            raise ConfigError(f"kind must be 'linearize' for a linearising config, got {self.kind!r}", key="kind")
        if self.data.dataset == "arithmetic":
            raise ConfigError("data.dataset: linearise on text (stdlib or a prepared directory)", key="data.dataset")
        if self.base_model.quantize:  # nothing here reads it: the base was linearised in float
            raise ConfigError(
                "base_model.quantize: linearising trains a float model; quantize the result with 'ember quantize'",
                key="base_model.quantize",
            )
        if self.adapter.init not in ("lora", "gaussian"):
            raise ConfigError(
                f"adapter.init must be lora or gaussian for linearising (the adapters start at zero), "
                f"got {self.adapter.init!r}",
                key="adapter.init",
            )

    def stage(self, name: str) -> LinearizeRunConfig:
        """This config as the stage-1 run (``name`` ``transfer``: ``run_dir/attention_transfer``
        with the transfer loop and optimizer) or as itself (``low_rank``)."""
        if name == "low_rank":
            return self
        return dataclasses.replace(
            self, run_dir=f"{self.run_dir}/{TRANSFER_DIR}", train=self.transfer.train, optim=self.transfer.optim
        )

    def identity(self) -> dict[str, Any]:
        """The flattened keys that define the run (what must not change on resume)."""
        # base_model.scan_layers stays part of the identity: a checkpoint is resumed in its own layout.
        base_runtime = tuple(key for key in BASE_MODEL_RUNTIME_KEYS if key != "base_model.scan_layers")
        runtime = (*RUNTIME_KEYS, *base_runtime, *(f"transfer.{key}" for key in RUNTIME_KEYS))
        return run_identity({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, runtime)


__all__ = ["TRANSFER_DIR", "DistillConfig", "LinearizeRunConfig", "TransferConfig"]

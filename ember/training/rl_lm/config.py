"""The GRPO experiment config (``kind: grpo`` for ``ember train``): reinforcement learning of a
pretrained language model against a reward, with the serving engine doing the rollouts.

    kind: grpo
    run_dir: runs/grpo-arithmetic
    base_model: {path: runs/arithmetic}       # an Ember run or a Hugging Face directory
    method: lora                              # lora | full
    adapter: {rank: 8, alpha: 16}
    prompts: {source: arithmetic}             # or {source: prompts.jsonl, eval: held_out.jsonl}
    reward: arithmetic                        # a shipped reward or package.module:function
    grpo: {algorithm: grpo, group_size: 8, prompts_per_step: 16, max_tokens: 8, kl_coef: 0.04}
    train: {steps: 200, eval_every: 50}
    optim: {lr: 1e-4}

The sections shared with ``kind: finetune`` (base_model, adapter, train, optim, mesh,
sharding, checkpoint, logging, distributed) mean the same. Every section is a frozen
dataclass, so a bad key or value fails at load time with its key path. Paths
(``base_model.path``, a JSONL ``prompts.source``, ``prompts.eval``), on the command line or in a
YAML file, are relative to the current directory and stored absolute
(``ember.core.config.absolute_path``), so a run's saved config works from anywhere.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ember.core.config import absolute_path
from ember.core.distributed import DistributedConfig
from ember.core.errors import ConfigError
from ember.core.sharding import MeshConfig
from ember.models.adapters.lora import LoraConfig
from ember.training.config import CheckpointConfig, LoggingConfig, LoopConfig, changed_fields, warn_unused
from ember.training.data.arithmetic import OPERATORS
from ember.training.finetune.config import BASE_MODEL_RUNTIME_KEYS, BaseModelConfig
from ember.training.lm.config import RUNTIME_KEYS, ShardingConfig, run_identity
from ember.training.optimizers import OptimConfig
from ember.training.rl_lm.losses import ALGORITHMS

METHODS: tuple[str, ...] = ("lora", "full")
"""``lora``: the policy is the base plus the ``adapter`` section's LoRA (only the adapters
train; the reference is the base itself). ``full``: every weight trains against a frozen copy."""


@dataclasses.dataclass(frozen=True)
class PromptsConfig:
    """Where prompts come from. ``source: arithmetic`` generates ``"a+b="`` problems
    (``ember.training.data.arithmetic``: ``max_operand``, ``operators``, and the
    ``held_out_fraction`` kept for evaluation, the same split the arithmetic pretraining corpus
    leaves out). Otherwise ``source`` is a JSONL file of ``{"prompt": "..."}`` lines and
    ``eval`` an optional second file of held-out prompts. Setting a key of the other source is
    a ``ConfigError``."""

    source: str = "arithmetic"
    eval: str = ""
    max_operand: int = 100
    operators: str = "+"
    held_out_fraction: float = 0.1
    eval_prompts: int = 256
    """Held-out prompts scored at each evaluation (the first ones, in a fixed order)."""
    eval_samples: int = 4
    """Completions sampled per held-out prompt (besides the greedy one) at each evaluation."""

    def __post_init__(self):
        if not self.source:
            raise ConfigError("prompts.source must be 'arithmetic' or a JSONL file of prompts", key="prompts.source")
        # Keys of the other source would do nothing: refuse them rather than ignore them.
        if self.source == "arithmetic" and self.eval:
            raise ConfigError(
                "prompts.eval (a JSONL file of held-out prompts) needs a JSONL prompts.source; source: arithmetic "
                "holds out held_out_fraction of its own problems",
                key="prompts.eval",
            )
        if self.source != "arithmetic":
            defaults = {field.name: field.default for field in dataclasses.fields(self)}
            for name in ("max_operand", "operators", "held_out_fraction"):
                if getattr(self, name) != defaults[name]:
                    raise ConfigError(
                        f"prompts.{name} only applies to source: arithmetic; prompts.source is the file "
                        f"{self.source!r} (held-out prompts come from prompts.eval)",
                        key=f"prompts.{name}",
                    )
        if self.source == "arithmetic":
            if self.max_operand < 2:
                raise ConfigError(
                    f"prompts.max_operand must be >= 2, got {self.max_operand}", key="prompts.max_operand"
                )
            if not self.operators or set(self.operators) - set(OPERATORS):
                raise ConfigError(
                    f"prompts.operators must be a string of {', '.join(OPERATORS)}, got {self.operators!r}",
                    key="prompts.operators",
                )
            if not 0 < self.held_out_fraction < 1:
                raise ConfigError(
                    f"prompts.held_out_fraction must be in (0, 1), got {self.held_out_fraction}",
                    key="prompts.held_out_fraction",
                )
        for name in ("eval_prompts", "eval_samples"):
            if getattr(self, name) < 0:
                raise ConfigError(f"prompts.{name} must be >= 0, got {getattr(self, name)}", key=f"prompts.{name}")
        if self.source != "arithmetic":
            object.__setattr__(self, "source", absolute_path(self.source))
        object.__setattr__(self, "eval", absolute_path(self.eval))


@dataclasses.dataclass(frozen=True)
class GRPOSection:
    """The algorithm (``grpo`` or ``reinforce``, see ``ember.training.rl_lm.losses``) and its
    rollouts: every rollout samples ``group_size`` completions of each of ``prompts_per_step``
    prompts (at most ``max_tokens`` each, at ``temperature`` / ``top_k`` / ``top_p``) through
    the serving engine (``num_slots`` sequences at once, ``token_budget`` tokens per engine
    step; ``engine_replicas`` engines sampling each rollout together, each on its own block of
    this process's devices, -1: every block: ``ember.training.rl_lm.engine_mesh``), and is
    trained on in ``updates_per_rollout`` optimizer steps of equal shares.
    ``clip_eps`` bounds the policy ratio; ``kl_coef`` weighs the KL to the reference (0:
    no reference pass). The loss's log-probabilities ignore ``top_k`` / ``top_p`` (see
    ``ember.training.rl_lm.losses`` for what that means)."""

    algorithm: str = "grpo"
    group_size: int = 8
    prompts_per_step: int = 16
    max_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    updates_per_rollout: int = 1
    clip_eps: float = 0.2
    kl_coef: float = 0.04
    num_slots: int = 64
    token_budget: int = 256
    engine_replicas: int = 1

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(
                f"grpo.algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}", key="grpo.algorithm"
            )
        for name in ("group_size", "prompts_per_step", "max_tokens", "updates_per_rollout", "num_slots"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"grpo.{name} must be a positive integer, got {getattr(self, name)}", key=f"grpo.{name}"
                )
        if self.group_size < 2:
            raise ConfigError(
                f"grpo.group_size must be >= 2 (advantages compare completions of one prompt), got {self.group_size}",
                key="grpo.group_size",
            )
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ConfigError(
                f"grpo.temperature must be a finite number > 0 (rollouts sample), got {self.temperature}",
                key="grpo.temperature",
            )
        if self.top_k < 0:
            raise ConfigError(f"grpo.top_k must be >= 0 (0 = off), got {self.top_k}", key="grpo.top_k")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"grpo.top_p must be in (0, 1] (1 = off), got {self.top_p}", key="grpo.top_p")
        if self.rows % self.updates_per_rollout:
            raise ConfigError(
                f"grpo.updates_per_rollout ({self.updates_per_rollout}) must divide the rollout's "
                f"prompts_per_step * group_size = {self.rows} completions",
                key="grpo.updates_per_rollout",
            )
        if not 0 < self.clip_eps < 1:
            raise ConfigError(f"grpo.clip_eps must be in (0, 1), got {self.clip_eps}", key="grpo.clip_eps")
        if not (self.kl_coef >= 0 and math.isfinite(self.kl_coef)):
            raise ConfigError(f"grpo.kl_coef must be a finite number >= 0, got {self.kl_coef}", key="grpo.kl_coef")
        if self.engine_replicas < 1 and self.engine_replicas != -1:
            raise ConfigError(
                f"grpo.engine_replicas must be a positive integer or -1 (every block of this process's devices), "
                f"got {self.engine_replicas}",
                key="grpo.engine_replicas",
            )
        if self.token_budget < self.num_slots:
            raise ConfigError(
                f"grpo.token_budget ({self.token_budget}) must be at least grpo.num_slots ({self.num_slots})",
                key="grpo.token_budget",
            )

    @property
    def rows(self) -> int:
        """Completions per rollout."""
        return self.group_size * self.prompts_per_step

    @property
    def rows_per_update(self) -> int:
        return self.rows // self.updates_per_rollout


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    kind: str = "grpo"
    run_dir: str = "runs/grpo"
    seed: int = 0
    base_model: BaseModelConfig = dataclasses.field(default_factory=BaseModelConfig)
    method: str = "lora"
    adapter: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    prompts: PromptsConfig = dataclasses.field(default_factory=PromptsConfig)
    reward: str = "arithmetic"
    grpo: GRPOSection = dataclasses.field(default_factory=GRPOSection)
    train: LoopConfig = dataclasses.field(default_factory=lambda: LoopConfig(steps=200, eval_every=50))
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-4, weight_decay=0.0))
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def __post_init__(self):
        if self.kind != "grpo":
            raise ConfigError(f"kind must be 'grpo' for a GRPO config, got {self.kind!r}", key="kind")
        if self.method not in METHODS:
            raise ConfigError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}", key="method")
        if self.base_model.quantize:
            raise ConfigError(
                "base_model.quantize: GRPO trains a float policy; quantize the result with 'ember quantize'",
                key="base_model.quantize",
            )
        if self.method == "lora" and self.adapter.init not in ("lora", "gaussian"):
            raise ConfigError(
                f"adapter.init must be lora or gaussian for GRPO (the reference policy is the base without "
                f"its adapters, so they must start at zero), got {self.adapter.init!r}",
                key="adapter.init",
            )
        if self.method == "lora" and self.adapter.dropout:
            raise ConfigError(
                f"adapter.dropout must be 0 for GRPO, got {self.adapter.dropout}: the policy ratio compares the "
                "training forward's log-probabilities with those the rollout was scored with, and dropout in one "
                "would make them differ (TRL turns dropout off for RL too)",
                key="adapter.dropout",
            )
        if self.checkpoint.every % self.grpo.updates_per_rollout:
            # A rollout is not checkpointed: one taken inside it resumes at the next rollout.
            raise ConfigError(
                f"checkpoint.every ({self.checkpoint.every}) must be a multiple of grpo.updates_per_rollout "
                f"({self.grpo.updates_per_rollout}), so that every checkpoint falls between rollouts and a resume "
                "continues exactly (a rollout's samples are not saved)",
                key="checkpoint.every",
            )
        if self.grpo.rows_per_update % self.train.grad_accum:
            raise ConfigError(
                f"train.grad_accum ({self.train.grad_accum}) must divide the completions per update "
                f"({self.grpo.rows_per_update})",
                key="train.grad_accum",
            )
        self._warn_unused_keys()

    def _warn_unused_keys(self) -> None:
        """Warns, naming the keys, of settings the run never reads (``warn_unused``, as
        ``kind: finetune`` does): the adapter under method full, LoRA-GA's keys, the ratio clip
        under reinforce."""
        unused = []
        changed = changed_fields(self.adapter, LoraConfig())
        if self.method == "full":
            unused += [f"adapter.{name}" for name in changed]
        else:  # adapter.init lora_ga is refused above
            ga = {"ga_batches", "ga_gamma"} & set(changed)
            unused += [f"adapter.{name} (read by adapter.init lora_ga only)" for name in sorted(ga)]
        if self.grpo.algorithm != "grpo" and self.grpo.clip_eps != GRPOSection().clip_eps:
            unused.append("grpo.clip_eps (read by grpo.algorithm grpo only)")
        warn_unused(f"method {self.method}, grpo.algorithm {self.grpo.algorithm}", unused)

    def identity(self) -> dict[str, Any]:
        """The flattened keys that define the run (what must not change on resume)."""
        runtime = (
            *RUNTIME_KEYS,
            "grpo.num_slots",
            "grpo.token_budget",
            "grpo.engine_replicas",
            "prompts.eval_prompts",
            "prompts.eval_samples",
            *BASE_MODEL_RUNTIME_KEYS,
        )
        return run_identity({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, runtime)


__all__ = ["METHODS", "GRPOConfig", "GRPOSection", "PromptsConfig"]

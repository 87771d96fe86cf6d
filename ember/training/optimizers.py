"""Optimizers and learning-rate schedules from config, built from optax pieces.

    tx = make_optimizer(OptimConfig(name="adamw", lr=3e-4), total_steps=10_000)

Gradients are clipped by global norm first (``clip_norm``; 0 turns it off). Weight decay
applies to weight matrices and embeddings, never to biases or normalisation scales
(decided by the parameter's name, so it is right for layer-stacked ``[layers, ...]``
parameters too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax

from ember.core.errors import ConfigError

OPTIMIZERS: tuple[str, ...] = ("adamw", "lion", "adafactor", "sgd")
SCHEDULES: tuple[str, ...] = ("cosine", "linear", "constant")
NO_DECAY_NAMES: frozenset[str] = frozenset({"bias", "scale", "b"})


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """Linear warmup from 0 over ``warmup_steps``, then ``kind`` decay to ``lr * min_lr_ratio``
    at the last step (``constant`` stays at ``lr``)."""

    kind: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ConfigError(
                f"optim.schedule.kind must be one of {', '.join(SCHEDULES)}, got {self.kind!r}",
                key="optim.schedule.kind",
            )
        if self.warmup_steps < 0:
            raise ConfigError(
                f"optim.schedule.warmup_steps must be >= 0, got {self.warmup_steps}", key="optim.schedule.warmup_steps"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(
                f"optim.schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}",
                key="optim.schedule.min_lr_ratio",
            )


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """``name``: adamw | lion | adafactor | sgd. ``b1``/``b2``/``eps`` are AdamW's and Lion's
    (Lion uses ``b1``, ``b2``); ``momentum``/``nesterov`` are SGD's."""

    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9
    nesterov: bool = False
    clip_norm: float = 1.0
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optim.name must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}", key="optim.name")
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be positive, got {self.lr}", key="optim.lr")
        if self.weight_decay < 0 or self.clip_norm < 0:
            raise ConfigError("optim.weight_decay and optim.clip_norm must be >= 0", key="optim.weight_decay")


def make_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    """The learning rate as a function of the step."""
    schedule = config.schedule
    warmup = min(schedule.warmup_steps, max(total_steps - 1, 0))
    decay_steps = max(total_steps - warmup, 1)
    end = config.lr * schedule.min_lr_ratio
    if schedule.kind == "cosine":
        after = optax.cosine_decay_schedule(config.lr, decay_steps, alpha=schedule.min_lr_ratio)
    elif schedule.kind == "linear":
        after = optax.linear_schedule(config.lr, end, decay_steps)
    else:
        after = optax.constant_schedule(config.lr)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, config.lr, warmup), after], [warmup])


def decay_mask(params: Any) -> Any:
    """True for parameters that get weight decay (all but biases and norm scales)."""

    def decays(path, _leaf) -> bool:
        name = str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1])))
        return name not in NO_DECAY_NAMES and "norm" not in name

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Clipping, then the optimizer with its schedule (and decoupled weight decay)."""
    lr = make_schedule(config, total_steps)
    if config.name == "adamw":
        core = optax.adamw(
            lr, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay, mask=decay_mask
        )
    elif config.name == "lion":
        core = optax.lion(lr, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay, mask=decay_mask)
    elif config.name == "adafactor":
        core = optax.adafactor(lr, weight_decay_rate=config.weight_decay or None, weight_decay_mask=decay_mask)
    else:
        core = optax.chain(
            optax.add_decayed_weights(config.weight_decay, mask=decay_mask),
            optax.sgd(lr, momentum=config.momentum or None, nesterov=config.nesterov),
        )
    if config.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.clip_norm), core)
    return core

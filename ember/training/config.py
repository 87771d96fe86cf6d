"""Config sections every task's trainer shares: the loop, checkpoints and logging.

A task's experiment config embeds them (the LM's ``train:`` section extends
:class:`LoopConfig` with its batch shape). All are frozen dataclasses validated on load.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ember.core.errors import ConfigError

NAN_POLICIES = ("stop", "skip")
LOSS_SCALE_MODES = ("auto", "dynamic", "off")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The training loop.

    ``grad_accum``: micro-batches per step (exact, weighted by each micro-batch's loss count).
    ``on_nan``: ``stop`` raises on a non-finite loss or gradient norm; ``skip`` leaves params, optimizer moments
    and model state unchanged (the learning-rate schedule still follows the step); each log
    step then records ``skipped_steps``, the steps skipped since the previous log, and an event
    when there were any.
    ``loss_scale``: dynamic loss scaling (``ember.training.loss_scaling``) for models that
    compute in float16, whose small gradients would otherwise flush to zero: ``auto`` scales
    when the task's compute dtype is float16, ``dynamic`` always, ``off`` never. A step whose
    scaled gradients overflow is skipped (counted in ``skipped_steps``) and the scale halves;
    each log step records ``loss_scale``.
    ``aux_loss_weights``: ``{name: weight}`` for every auxiliary loss the model returns or sows
    (``0`` logs it without training on it). ``freeze``: regular expressions searched in the
    ``/``-joined parameter paths (``layers/block_0/attn/q/kernel``); matching parameters are
    frozen (no gradient, no optimizer state).
    """

    steps: int = 1000
    grad_accum: int = 1
    log_every: int = 10
    eval_every: int = 100
    on_nan: str = "stop"
    loss_scale: str = "auto"
    aux_loss_weights: dict[str, float] = dataclasses.field(default_factory=dict)
    freeze: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("steps", "grad_accum", "log_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"train.{name} must be a positive integer, got {getattr(self, name)}", key=f"train.{name}"
                )
        if self.on_nan not in NAN_POLICIES:
            raise ConfigError(
                f"train.on_nan must be one of {', '.join(NAN_POLICIES)}, got {self.on_nan!r}", key="train.on_nan"
            )
        if self.loss_scale not in LOSS_SCALE_MODES:
            raise ConfigError(
                f"train.loss_scale must be one of {', '.join(LOSS_SCALE_MODES)}, got {self.loss_scale!r}",
                key="train.loss_scale",
            )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """``every``: save period in steps (a final save always happens); ``keep``: newest N kept."""

    every: int = 200
    keep: int = 3
    async_save: bool = True

    def __post_init__(self):
        for name in ("every", "keep"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"checkpoint.{name} must be a positive integer, got {getattr(self, name)}", key=f"checkpoint.{name}"
                )


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    progress: bool = True
    tensorboard: bool = True


def changed_fields(section: Any, default: Any) -> list[str]:
    """The fields of the dataclass ``section`` that differ from ``default``'s."""
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(default, f.name)]


def warn_unused(run: str, unused: list[str]) -> None:
    """Warns, naming the keys, of settings a run never reads (``run`` says which run, e.g.
    ``method full``; nothing when ``unused`` is empty). A warning, not an error: ``method=full``
    over a LoRA config's file is a reasonable command line."""
    if unused:
        warnings.warn(f"this run ({run}) does not use {', '.join(unused)}: ignored", stacklevel=3)


__all__ = [
    "LOSS_SCALE_MODES",
    "NAN_POLICIES",
    "CheckpointConfig",
    "LoggingConfig",
    "LoopConfig",
    "changed_fields",
    "warn_unused",
]

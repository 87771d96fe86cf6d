"""Quantization-aware training's config and schedule (``qat:`` in an LM config).

Following "Compute-Optimal Quantization-Aware Training", a run trains in full precision
first and switches to QAT for the last ``fraction`` of its steps: from step
``round((1 - fraction) * train.steps)`` on, the loss sees the target weights fake-quantized
(``ember.models.quantization.fake``; straight-through gradients), so the same compiled step
serves both phases. After training, ``ember quantize RUN OUT --format <format>`` stores them (in
the run's ``qat.group_size`` and ``qat.targets`` unless its flags say otherwise).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ember.core.errors import ConfigError
from ember.models.quantization.fake import QAT_FORMATS, fake_quantize_params
from ember.models.quantization.quantize import DEFAULT_TARGETS


@dataclasses.dataclass(frozen=True)
class QatConfig:
    """``format``: empty (no QAT) or int8 | int4 | nf4 | fp8; ``group_size``: rows per scale (0:
    the format's default); ``fraction``: the share of ``train.steps`` trained with QAT, at
    the end; ``targets``: the weights (``q k v o gate up down`` or path regexes; the default:
    every projection the model has, routed experts' included)."""

    format: str = ""
    group_size: int = 0
    fraction: float = 0.2
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self):
        if self.format and self.format not in QAT_FORMATS:
            raise ConfigError(
                f"qat.format must be empty (no QAT) or one of {', '.join(QAT_FORMATS)}, got {self.format!r}",
                key="qat.format",
            )
        if not self.format:  # the other keys would do nothing: refuse them rather than ignore them
            for field in dataclasses.fields(self):
                if field.name != "format" and getattr(self, field.name) != field.default:
                    raise ConfigError(
                        f"qat.{field.name} is set but qat.format is empty, so the run would train without QAT; "
                        f"set qat.format to one of {', '.join(QAT_FORMATS)}",
                        key=f"qat.{field.name}",
                    )
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"qat.fraction must be in (0, 1], got {self.fraction}", key="qat.fraction")
        if self.group_size and (self.group_size < 16 or self.group_size & (self.group_size - 1)):
            raise ConfigError(
                f"qat.group_size must be 0 or a power of two >= 16, got {self.group_size}", key="qat.group_size"
            )
        if self.group_size and self.format in ("int8", "fp8"):
            raise ConfigError(f"qat.group_size must be 0 for {self.format} (per output channel)", key="qat.group_size")
        if not self.targets:
            raise ConfigError("qat.targets must name at least one weight", key="qat.targets")

    def start_step(self, total_steps: int) -> int:
        """The first step trained with fake-quantized weights."""
        return round((1.0 - self.fraction) * total_steps)


def qat_params(params: Any, config: QatConfig, step: jax.Array, total_steps: int) -> Any:
    """The params the loss sees at ``step``: fake-quantized in the QAT phase, else as they are."""
    if not config.format:
        return params

    def quantized(p):
        return fake_quantize_params(p, config.format, config.group_size or None, config.targets)

    return jax.lax.cond(step >= config.start_step(total_steps), quantized, lambda p: p, params)


__all__ = ["QatConfig", "qat_params"]

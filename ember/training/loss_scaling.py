"""Dynamic loss scaling for float16 training (Micikevicius et al., "Mixed Precision Training").

float16 has 5 exponent bits: activation gradients below ~6e-8 flush to zero. The loss is
multiplied by a scale ``S`` before differentiation, so every gradient in the backward pass
is ``S`` times larger, and the float32 gradients are divided by ``S`` before the update. The
scale adapts: a step whose scaled gradients overflow (Inf/NaN) is skipped and ``S`` halves;
after :data:`GROWTH_INTERVAL` finite steps in a row ``S`` doubles. These are the rules and
constants of PyTorch's ``GradScaler``, flax's ``DynamicScale`` and jmp's
``DynamicLossScale`` (initial ``2**15``).

The scale lives in the optimizer state (:class:`LossScaleState` wraps the optimizer's own),
so it is checkpointed and a resumed run continues with the scale it stopped at; runs without
loss scaling keep their optimizer state unchanged. It is written here rather than taken
from flax's ``DynamicScale``, whose scale update is fused with one ``value_and_grad`` call:
gradient accumulation needs one scale for every micro-batch of a step and one update after
the last.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

INITIAL_SCALE = 2.0**15
GROWTH_INTERVAL = 2000
"""Finite steps in a row after which the scale doubles."""
MINIMUM_SCALE = 1.0
"""An overflow at this scale is not an overflow but a non-finite gradient: ``train.on_nan``
decides (halving further would only hide it)."""


class LossScaleState(NamedTuple):
    """The loss scale around an optimizer's state.

    scale: float32 scalar, the factor the next step's loss is multiplied by.
    good_steps: int32 scalar, finite steps since the scale last changed.
    inner: the wrapped optimizer's state.
    """

    scale: jax.Array
    good_steps: jax.Array
    inner: Any


def with_dynamic_loss_scale(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` with a :class:`LossScaleState` around its state. Its ``update`` takes unscaled
    gradients and leaves the scale alone: ``train_step`` reads the scale, unscales, and moves
    it with :func:`next_loss_scale` (it knows whether the step overflowed)."""

    def init(params):
        return LossScaleState(jnp.float32(INITIAL_SCALE), jnp.int32(0), tx.init(params))

    def update(updates, state, params=None):
        updates, inner = tx.update(updates, state.inner, params)
        return updates, state._replace(inner=inner)

    return optax.GradientTransformation(init, update)


def next_loss_scale(state: LossScaleState, grads_finite: jax.Array) -> LossScaleState:
    """The scale after a step: halved (not below :data:`MINIMUM_SCALE`) when its gradients
    overflowed, doubled after :data:`GROWTH_INTERVAL` finite steps in a row."""
    grown = state.good_steps + 1 >= GROWTH_INTERVAL
    scale = jnp.where(
        grads_finite,
        jnp.where(grown, state.scale * 2.0, state.scale),
        jnp.maximum(state.scale * 0.5, MINIMUM_SCALE),
    )
    good_steps = jnp.where(grads_finite & ~grown, state.good_steps + 1, 0)
    return state._replace(scale=scale.astype(jnp.float32), good_steps=good_steps.astype(jnp.int32))


def uses_loss_scaling(mode: str, compute_dtype: Any) -> bool:
    """Whether ``train.loss_scale`` = ``mode`` (``auto``, ``dynamic`` or ``off``) scales a model
    computing in ``compute_dtype``: ``auto`` scales float16 only (bfloat16 has float32's
    exponent range and needs none)."""
    return mode == "dynamic" or (mode == "auto" and jnp.dtype(compute_dtype) == jnp.float16)


def is_loss_scaled(opt_state: Any) -> bool:
    """Whether an optimizer state (or a checkpoint's metadata of one) carries a loss scale."""
    if isinstance(opt_state, LossScaleState):
        return True
    return isinstance(opt_state, dict) and set(opt_state) == set(LossScaleState._fields)


__all__ = [
    "GROWTH_INTERVAL",
    "INITIAL_SCALE",
    "MINIMUM_SCALE",
    "LossScaleState",
    "is_loss_scaled",
    "next_loss_scale",
    "uses_loss_scaling",
    "with_dynamic_loss_scale",
]

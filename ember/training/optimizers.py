"""Optimizers and learning-rate schedules from config, built from optax pieces.

    tx = make_optimizer(OptimConfig(name="adamw", lr=3e-4), total_steps=10_000)

Gradients are clipped by global norm first (``clip_norm``; 0 turns it off). Weight decay is
decoupled and scaled by the learning rate for every optimizer (a decayed weight shrinks by
``lr * weight_decay`` per step). It applies to weight matrices and embeddings, never to
biases, normalisation scales, Mamba-2's ``A_log`` and ``D`` or the window-linear layers'
per-head ``window_factor`` (decided by the parameter's name, so it is right for layer-stacked
``[layers, ...]`` parameters too: :func:`decay_mask`).

``muon`` and ``galore`` are optax's (``optax.contrib``). Both treat the model's linear maps
(attention projections, MLP and expert matrices) as matrices from their input to their
output dimensions, whatever their rank (``[embed, heads, head_dim]``, layer-stacked
``[layers, ...]``, experts ``[experts, ...]``: :func:`matrix_dimensions`); every other
parameter (embeddings, the head, norms, biases, routers, adapters) takes Adam. Muon
orthogonalises each stacked matrix on its own; optax's GaLore has no batch axes, so it
needs unstacked layers (``scan_layers: false``) and says so otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
import optax.contrib

from ember.core.errors import ConfigError
from ember.models.adapters.layout import weight_layout

OPTIMIZERS: tuple[str, ...] = ("adamw", "lion", "adafactor", "sgd", "muon", "galore")
SCHEDULES: tuple[str, ...] = ("cosine", "linear", "constant")
NO_DECAY_NAMES: frozenset[str] = frozenset({"b", "scale", "A_log", "D", "window_factor"})
"""Parameter names that never decay, besides names ending in ``bias`` (``bias``, Mamba-2's
``conv_bias`` and ``dt_bias``) or holding ``norm`` (``norm_scale``): biases, normalisation
scales, Mamba-2's per-head decay rates ``A_log`` and skip gains ``D``, and the window-linear
layers' per-head mix ``window_factor`` (a logit: its ``sigmoid`` weights the window against
the linear part, and decay would pull every head's learned mix back to an even one)."""


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
    """``name``: adamw | lion | adafactor | sgd | muon | galore. ``b1``/``b2``/``eps`` are
    AdamW's and Lion's (Lion uses ``b1``, ``b2``; Muon and GaLore use them for their Adam
    part); ``momentum``/``nesterov`` are SGD's; ``muon_*`` Muon's Newton-Schulz steps and
    momentum; ``galore_*`` GaLore's projection rank, steps between projection updates and
    update scale."""

    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9
    nesterov: bool = False
    clip_norm: float = 1.0
    muon_ns_steps: int = 5
    muon_beta: float = 0.95
    galore_rank: int = 128
    galore_update_gap: int = 200
    galore_scale: float = 0.25
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optim.name must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}", key="optim.name")
        bounds = {
            "lr": (self.lr > 0, "> 0"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
            "clip_norm": (self.clip_norm >= 0, ">= 0 (0 turns clipping off)"),
            "b1": (0 <= self.b1 < 1, "in [0, 1)"),
            "b2": (0 <= self.b2 < 1, "in [0, 1)"),
            "momentum": (0 <= self.momentum < 1, "in [0, 1) (0 turns momentum off)"),
            "eps": (self.eps >= 0, ">= 0"),
            "muon_beta": (0 <= self.muon_beta < 1, "in [0, 1)"),
            "galore_scale": (self.galore_scale > 0, "> 0"),
        }
        for name, (within, allowed) in bounds.items():
            value = getattr(self, name)
            if not (within and math.isfinite(value)):
                raise ConfigError(f"optim.{name} must be a finite number {allowed}, got {value}", key=f"optim.{name}")
        for name in ("muon_ns_steps", "galore_rank", "galore_update_gap"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"optim.{name} must be a positive integer, got {getattr(self, name)}", key=f"optim.{name}"
                )


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
    """True for parameters that get weight decay: weight matrices and embeddings, not biases,
    normalisation scales, Mamba-2's ``A_log`` and ``D`` or ``window_factor`` (:data:`NO_DECAY_NAMES`). Decided by
    the parameter's name, whatever leading axes stack it (``[layers, ...]``, ``[experts, ...]``)."""

    def decays(path, _leaf) -> bool:
        names = [str(key.key) for key in path if isinstance(key, jax.tree_util.DictKey)]
        name = names[-1] if names else ""
        return not (name in NO_DECAY_NAMES or name.endswith("bias") or "norm" in name)

    return jax.tree_util.tree_map_with_path(decays, params)


def matrix_dimensions(params: Any, *, spec: type, batch_axes: bool = True) -> Any:
    """Per parameter, ``spec(reduction_axis, output_axis)`` for the model's linear maps (their
    input and output dimensions, see ``ember.models.adapters.lora.weight_layout``) and None
    for every other parameter.

    Raises:
      ConfigError: ``batch_axes`` is False and a matrix is stacked (``[layers, ...]`` or
        ``[experts, ...]``), which GaLore cannot project.
    """

    def one(path, leaf):
        name = "/".join(str(getattr(key, "key", key)) for key in path if hasattr(key, "key"))
        try:
            layout = weight_layout(name, leaf)
        except ConfigError:
            return None
        if layout.lead and not batch_axes:
            raise ConfigError(
                f"optim.name galore projects single matrices, but {name} {leaf.shape} stacks {layout.lead} "
                "leading axes (layers or experts); set scan_layers false (model.scan_layers, or base.scan_layers "
                "when fine-tuning) or use muon",
                key="optim.name",
            )
        inputs = tuple(range(layout.lead, layout.lead + layout.in_dims))
        return spec(reduction_axis=inputs, output_axis=tuple(range(inputs[-1] + 1, leaf.ndim)))

    return jax.tree_util.tree_map_with_path(one, params)


def _decay_then_rate(
    direction: optax.GradientTransformation, config: OptimConfig, lr: optax.Schedule
) -> optax.GradientTransformation:
    """``direction``, then decoupled weight decay, then the learning rate: how optax builds
    adamw, lion, muon and galore, so a decayed weight shrinks by ``lr * weight_decay`` a step."""
    return optax.chain(
        direction, optax.add_decayed_weights(config.weight_decay, mask=decay_mask), optax.scale_by_learning_rate(lr)
    )


def _decoupled_decay(lr: optax.Schedule, weight_decay: float, mask: Any) -> optax.GradientTransformation:
    """Adds ``-lr(step) * weight_decay * param`` to the updates of the ``mask``ed parameters:
    decoupled decay after an optimizer that has applied its rate without any. Its state is a
    schedule's step count (``optax.ScaleByScheduleState``), like the rate's."""

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params):
        rate = -weight_decay * lr(state.count)
        updates = jax.tree.map(lambda u, p: u + rate * p, updates, params)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.masked(optax.GradientTransformation(init, update), mask)


def _adam_side_decay_mask(params: Any) -> Any:
    """:func:`decay_mask` of the parameters Muon leaves to Adam (all but the linear maps)."""
    matrices = matrix_dimensions(params, spec=optax.contrib.MuonDimensionNumbers)
    return jax.tree.map(lambda decays, dims: decays and dims is None, decay_mask(params), matrices)


def make_optimizer(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Clipping, then the optimizer with its schedule and decoupled weight decay: with zero
    gradients every optimizer multiplies a decayed weight by ``1 - lr(step) * weight_decay``
    (SGD's momentum and Adafactor's update scaling do not touch the decay)."""
    lr = make_schedule(config, total_steps)
    if config.name == "adamw":
        core = optax.adamw(
            lr, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay, mask=decay_mask
        )
    elif config.name == "lion":
        core = optax.lion(lr, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay, mask=decay_mask)
    elif config.name == "adafactor":
        # optax.adafactor's own pieces and defaults, its decay moved before the rate (optax adds it after).
        direction = optax.chain(
            optax.scale_by_factored_rms(), optax.clip_by_block_rms(1.0), optax.scale_by_param_block_rms()
        )
        core = _decay_then_rate(direction, config, lr)
    elif config.name == "muon":
        muon_dimensions = functools.partial(matrix_dimensions, spec=optax.contrib.MuonDimensionNumbers)
        core = optax.contrib.muon(
            lr,
            ns_steps=config.muon_ns_steps,
            beta=config.muon_beta,
            eps=config.eps,
            weight_decay=config.weight_decay,
            weight_decay_mask=decay_mask,
            adam_b1=config.b1,
            adam_b2=config.b2,
            muon_weight_dimension_numbers=muon_dimensions,
        )
        # optax's muon would decay every parameter of its Adam side (it takes no mask there).
        core = optax.chain(core, _decoupled_decay(lr, config.weight_decay, mask=_adam_side_decay_mask))
    elif config.name == "galore":
        core = optax.contrib.galore(
            lr,
            rank=config.galore_rank,
            update_proj_gap=config.galore_update_gap,
            scale=config.galore_scale,
            base_optimizer=optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps),
            weight_decay=config.weight_decay,
            mask=decay_mask,
            weight_dimension_numbers=functools.partial(
                matrix_dimensions, spec=optax.contrib.GaLoreDimensionNumbers, batch_axes=False
            ),
        )
    else:
        momentum = optax.trace(config.momentum, nesterov=config.nesterov) if config.momentum else optax.identity()
        core = _decay_then_rate(momentum, config, lr)
    if config.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.clip_norm), core)
    return core

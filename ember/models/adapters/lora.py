"""LoRA, rsLoRA, DoRA and PiSSA as surgery on a parameter tree.

    config = LoraConfig(rank=8, alpha=16, targets=("q", "v", "up", "down"))
    params = add_lora(params, config, rng)          # base weights + adapter leaves
    mask = adapter_mask(params)                     # train the adapters only

Adapters attach to weights chosen by ``targets``: the names in :data:`TARGETS` (``q k v o``
attention projections, ``gate up down`` dense or shared-expert MLP matrices, ``experts``
every routed expert's matrices) or regular expressions on ``/``-joined parameter paths
(``"block_0/attn/q/kernel$"``); ``rank_pattern`` / ``alpha_pattern`` give matching weights
their own rank or alpha. The added leaves and their meaning are in
``ember.models.adapters.lowrank``. With the default initialisation (``A`` uniform as PEFT's
Kaiming init, ``B`` zero) the adapted model equals the base exactly; with DoRA's magnitude
``||W||`` it does up to the norm's rounding (``m / ||W||`` is 1 within an ulp). PiSSA moves
the weight's top ``rank`` singular directions into the adapter and keeps the residual as the
base (remembering the initial ``A0, B0`` so an export can express the change against the
original weight); LoRA-GA is in ``ember.models.adapters.lora_ga``.

Trees may be boxed (``nn.Partitioned``, as ``init`` returns): then an adapter's leaves
carry the logical axes of its weight (``A``: the weight's leading and input axes, ``B``:
its output axes), so they shard like it. Unboxed trees work too.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.errors import ConfigError
from ember.core.tree import param_paths, tree_from_paths
from ember.models.adapters.layout import TARGETS, WeightLayout, leaf_value, rebox, weight_layout
from ember.models.adapters.leaves import adapter_part
from ember.models.adapters.lowrank import (
    LowRank,
    low_rank_product,
    part_name,
    weight_norm,
)

INITS: tuple[str, ...] = ("lora", "gaussian", "pissa", "lora_ga")
"""``lora``: ``A`` Kaiming-uniform, ``B`` zero. ``gaussian``: ``A ~ N(0, 1/rank)``, ``B`` zero.
``pissa``: principal singular vectors (base keeps the residual). ``lora_ga``: gradient SVD
(``ember.models.adapters.lora_ga``; ``add_lora`` gives the ``lora`` init until then)."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The adapters to add (see the module docstring). ``scale = alpha / rank``, or ``alpha /
    sqrt(rank)`` with ``rslora``; ``dora`` adds the magnitude vector; ``dropout`` drops the
    adapter's input while training."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    rslora: bool = False
    dora: bool = False
    dropout: float = 0.0
    init: str = "lora"
    rank_pattern: dict[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: dict[str, float] = dataclasses.field(default_factory=dict)
    ga_batches: int = 4
    """LoRA-GA: batches whose mean gradient initialises the adapters."""
    ga_gamma: float = 16.0
    """LoRA-GA: the stable scale's ``gamma`` (``A, B`` scaled by ``d_out^(1/4) / sqrt(gamma)``)."""

    def __post_init__(self):
        def fail(field, message):
            raise ConfigError(f"adapter.{field} {message}", key=f"adapter.{field}")

        if self.rank < 1:
            fail("rank", f"must be a positive integer, got {self.rank}")
        if any(r < 1 for r in self.rank_pattern.values()):
            fail("rank_pattern", f"ranks must be positive integers, got {self.rank_pattern}")
        if self.alpha <= 0:
            fail("alpha", f"must be positive, got {self.alpha}")
        if any(a <= 0 for a in self.alpha_pattern.values()):
            fail("alpha_pattern", f"alphas must be positive, got {self.alpha_pattern}")
        if not 0 <= self.dropout < 1:
            fail("dropout", f"must be in [0, 1), got {self.dropout}")
        if self.ga_batches < 1:
            fail("ga_batches", f"must be a positive integer, got {self.ga_batches}")
        if self.ga_gamma <= 0:
            fail("ga_gamma", f"must be positive, got {self.ga_gamma}")
        if self.init not in INITS:
            fail("init", f"must be one of {', '.join(INITS)}, got {self.init!r}")
        if not self.targets:
            fail("targets", f"must name at least one weight: {', '.join(TARGETS)} or a path regex")
        for field in ("targets", "rank_pattern", "alpha_pattern"):
            for target in getattr(self, field):
                if target not in TARGETS:
                    try:
                        re.compile(target)
                    except re.error as error:
                        names = ", ".join(TARGETS)
                        fail(field, f"entry {target!r} is neither a target name ({names}) nor a regex ({error})")

    def pattern(self, target: str) -> re.Pattern:
        return re.compile(TARGETS.get(target, target))

    def rank_and_alpha(self, path: str) -> tuple[int, float]:
        """This weight's rank and alpha (the first matching ``*_pattern`` entry wins)."""
        rank = next((r for p, r in self.rank_pattern.items() if self.pattern(p).search(path)), self.rank)
        alpha = next((a for p, a in self.alpha_pattern.items() if self.pattern(p).search(path)), self.alpha)
        return rank, alpha

    def scale(self, path: str) -> float:
        rank, alpha = self.rank_and_alpha(path)
        return alpha / math.sqrt(rank) if self.rslora else alpha / rank


ADAPTED_BY_LAYERS: tuple[str, ...] = (r"(^|/)attn/[^/]+/kernel$", r"(^|/)(mlp|shared|experts)/(gate|up|down)$")
"""The weights whose layers apply an adapter found beside them: the mixers' projections
(attention, CCA, linear attention, Mamba-2: ``lowrank.adapted_matmul``), the dense / shared
MLP matrices and the routed experts'. The embedding, the LM head, routers and gates are read
as they are: an adapter there would train and change nothing."""


def target_paths(params: Mapping[str, Any], config: LoraConfig) -> list[str]:
    """The ``/``-joined paths of the weights ``config.targets`` selects, in tree order.

    Raises:
      ConfigError: a target, or a ``rank_pattern`` / ``alpha_pattern`` entry, selects nothing
        (listing what paths look like).
    """
    paths = [p for p in param_paths(params) if adapter_part(p) is None]
    chosen = []
    for target in config.targets:
        pattern = config.pattern(target)
        found = [p for p in paths if pattern.search(p)]
        if not found:
            raise ConfigError(
                f"adapter.targets entry {target!r} matches no parameter; names: {', '.join(TARGETS)}; "
                f"paths look like {', '.join(paths[:4])}",
                key="adapter.targets",
            )
        chosen += [p for p in found if p not in chosen]
    for field, patterns in (("rank_pattern", config.rank_pattern), ("alpha_pattern", config.alpha_pattern)):
        for entry in patterns:
            if not any(config.pattern(entry).search(p) for p in chosen):
                raise ConfigError(
                    f"adapter.{field} entry {entry!r} matches none of the adapted weights, so it would change "
                    f"nothing; they are {', '.join(chosen[:4])}{', ...' if len(chosen) > 4 else ''}",
                    key=f"adapter.{field}",
                )
    return [p for p in paths if p in chosen]


def add_lora(params: Mapping[str, Any], config: LoraConfig, rng: jax.Array) -> dict[str, Any]:
    """``params`` with an adapter on every target weight (see the module docstring).

    PiSSA replaces each target weight by its residual. Raises ``ConfigError`` for a target that
    selects nothing or a weight whose layer reads no adapter (:data:`ADAPTED_BY_LAYERS`), a
    weight that already has an adapter, (PiSSA, LoRA-GA) a rank the weight's smaller side
    cannot hold, or dropout on routed experts (merged, it cannot apply).
    """
    flat = param_paths(params)
    updates = {}
    for index, path in enumerate(target_paths(params, config)):
        if part_name(path, "lora_a") in flat:
            raise ConfigError(f"{path} already has an adapter", key="adapter.targets")
        updates.update(_new_adapter(path, flat[path], config, jax.random.fold_in(rng, index)))
    return tree_from_paths({**flat, **updates})


def _new_adapter(path: str, leaf: Any, config: LoraConfig, rng: jax.Array) -> dict[str, Any]:
    """The leaves an adapter on ``leaf`` adds (and, for PiSSA, the weight's residual at ``path``)."""
    layout = weight_layout(path, leaf)
    if not any(re.search(layer, path) for layer in ADAPTED_BY_LAYERS):
        raise ConfigError(
            f"adapter target {path}: its layer applies no adapter (the embedding, LM head, routers and gates are "
            "read as they are), so one there would train and change nothing; adapters go on attention / SSM "
            f"projections and MLP or expert matrices ({', '.join(TARGETS)})",
            key="adapter.targets",
        )
    kernel = jnp.asarray(leaf_value(leaf))
    rank, _ = config.rank_and_alpha(path)
    _check_rank_fits(path, kernel.shape, layout, config.init, rank)
    scale = config.scale(path)
    a, b, residual = _initial_factors(kernel, layout, config.init, rank, scale, rng)
    lead = layout.split(kernel.shape)[0]
    parts = {
        "lora_a": a.astype(kernel.dtype),
        "lora_b": b.astype(kernel.dtype),
        "lora_scale": jnp.full(lead, scale, jnp.float32),
    }
    if residual is not None:
        parts.update(lora_a0=parts["lora_a"], lora_b0=parts["lora_b"])
    if config.dora:
        adapted = (kernel if residual is None else residual).astype(jnp.float32)
        adapted = adapted + low_rank_product(LowRank(a, b, parts["lora_scale"]), layout.lead)
        parts["lora_magnitude"] = weight_norm(adapted, layout.in_dims, layout.lead)
    if config.dropout:
        if re.search(TARGETS["experts"], path):  # the MoE layer merges them: no adapter input to drop
            raise ConfigError(
                f"adapter.dropout {config.dropout} cannot apply to the adapter on {path}: routed experts' adapters "
                "are merged into each expert's weight (no separate adapter path to drop the input of); set "
                "adapter.dropout 0 or leave experts out of adapter.targets",
                key="adapter.dropout",
            )
        parts["lora_dropout"] = jnp.full(lead, config.dropout, jnp.float32)
    result = {part_name(path, part): _boxed(value, _part_axes(part, layout)) for part, value in parts.items()}
    if residual is not None:
        result[path] = rebox(leaf, residual.astype(kernel.dtype))
    return result


def _check_rank_fits(path: str, shape: tuple[int, ...], layout: WeightLayout, init: str, rank: int) -> None:
    """PiSSA takes a weight's top ``rank`` singular directions and LoRA-GA ``2 rank`` of its
    gradient's: raises ``ConfigError`` when the weight has fewer (its smaller side)."""
    needed = {"pissa": rank, "lora_ga": 2 * rank}.get(init)
    _, in_shape, out_shape = layout.split(shape)
    smaller = min(math.prod(in_shape), math.prod(out_shape))
    if needed is not None and needed > smaller:
        raise ConfigError(
            f"adapter.rank {rank} is too large for init {init} on {path} {list(shape)}: it takes "
            f"{'2 * rank' if init == 'lora_ga' else 'rank'} = {needed} singular directions and the weight has "
            f"{smaller}; lower adapter.rank or set one for this weight in adapter.rank_pattern",
            key="adapter.rank",
        )


def _initial_factors(kernel, layout: WeightLayout, init: str, rank: int, scale: float, rng):
    """``(A, B, the weight's residual or None)`` of a fresh adapter, in float32."""
    lead, in_shape, out_shape = layout.split(kernel.shape)
    if init == "pissa":
        return pissa_factors(kernel, layout, rank, scale)
    if init == "gaussian":
        a = jax.random.normal(rng, (*lead, *in_shape, rank), jnp.float32) / rank
    else:  # lora (and lora_ga before its gradient step): PEFT's kaiming_uniform_(a=sqrt(5))
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        a = jax.random.uniform(rng, (*lead, *in_shape, rank), jnp.float32, -bound, bound)
    return a, jnp.zeros((*lead, rank, *out_shape), jnp.float32), None


def _boxed(value, axes):
    return value if axes is None else nn.Partitioned(value, axes)


def _part_axes(part: str, layout: WeightLayout) -> tuple[str | None, ...] | None:
    """The logical axes of an adapter part on a weight of ``layout`` (None: the tree has none)."""
    names = layout.names
    if names is None:
        return None
    lead, ins, outs = names[: layout.lead], names[layout.lead : layout.lead + layout.in_dims], names[-layout.out_dims :]
    return {
        "lora_a": (*lead, *ins, None),
        "lora_a0": (*lead, *ins, None),
        "lora_b": (*lead, None, *outs),
        "lora_b0": (*lead, None, *outs),
        "lora_scale": lead,
        "lora_dropout": lead,
        "lora_magnitude": (*lead, *outs),
    }[part]


def pissa_factors(kernel: jax.Array, layout: WeightLayout, rank: int, scale: float):
    """PiSSA: ``(A, B, residual)`` with ``scale * A B`` the rank-``rank`` truncated SVD of
    each stacked weight (``A = U sqrt(S) / sqrt(scale)``, ``B = sqrt(S) V^T / sqrt(scale)``)
    and ``residual = W - scale * A B``."""
    lead, in_shape, out_shape = layout.split(kernel.shape)
    matrices = kernel.astype(jnp.float32).reshape(-1, math.prod(in_shape), math.prod(out_shape))
    u, s, vt = jnp.linalg.svd(matrices, full_matrices=False)
    root = jnp.sqrt(s[:, :rank] / scale)
    a = (u[:, :, :rank] * root[:, None, :]).reshape(*lead, *in_shape, rank)
    b = (root[:, :, None] * vt[:, :rank, :]).reshape(*lead, rank, *out_shape)
    residual = kernel.astype(jnp.float32) - low_rank_product(LowRank(a, b, jnp.full(lead, scale)), layout.lead)
    return a, b, residual.astype(kernel.dtype)


__all__ = ["ADAPTED_BY_LAYERS", "INITS", "TARGETS", "LoraConfig", "add_lora", "pissa_factors", "target_paths"]

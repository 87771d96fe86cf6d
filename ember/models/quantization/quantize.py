"""Quantizing a model's parameter tree (post-training), and reading it back as floats.

    qparams = quantize_params(params, QuantizeConfig(format="int4"))                  # round to nearest
    qparams = quantize_params(params, QuantizeConfig(format="int4", method="gptq"), grams=grams)
    qparams = quantize_weights(params, paths, config, grams=grams)                    # the given weights only

The linear maps ``targets`` names (default: every attention, MLP and routed-expert projection
the model has; embeddings, the output head, routers and norms stay in float, and so do the
MLPs MixLoRA adapted, whose layers read float weights only) are replaced by their stored
quantized form (``ember.models.quantization.stored``); the model's code reads them as they
are. ``grams`` (GPTQ) are the inputs' ``X^T X`` per weight path, from :func:`calibration_grams`
(one pass of the model as given); a routed expert's are of the token-slots routed to it
(``[experts, K, K]`` per layer). A whole ``DecoderLM`` is quantized a group of layers at a time,
each calibrated on the outputs of the groups quantized before it, by
``ember.models.quantization.sequential.sequential_gptq`` (what ``ember quantize`` runs). A matrix
whose Gram is zero (an expert no calibration token reached) has nothing for GPTQ to weigh its
error by, and would come out all zeros (GPTQ zeroes the rows of inputs never seen): it is rounded
to nearest instead, as GPTQModel's fail-safe does for such experts, and
:func:`uncalibrated_matrices` counts them (a warning names them; ``ember quantize``'s summary
reports their number).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ember.core.errors import ConfigError
from ember.core.tree import param_paths, tree_from_paths
from ember.kernels_pallas.quantized_formats import FORMATS
from ember.models.adapters.layout import TARGETS, WeightLayout, leaf_value, weight_layout
from ember.models.quantization.gptq import gptq_matrix
from ember.models.quantization.numerics import DEFAULT_GROUP_SIZES, quantize_matrix
from ember.models.quantization.stored import dequantized, store_matrix, stored_format, stored_weight_paths

METHODS: tuple[str, ...] = ("rtn", "gptq")
DEFAULT_TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
"""The default targets: every attention and MLP projection the model has, its routed experts'
included (``experts``). As a whole, the names a model lacks (``gate`` of a GELU MLP, the dense
``gate``/``up``/``down`` of a model whose MLPs are all routed, ``experts`` of a dense one) select
nothing without an error; other lists must select a weight with each name (path regexes such as
``attn/`` and ``(mlp|shared)/`` leave routed experts float)."""


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """What to quantize and how: ``format`` int8 | int4 | nf4; ``group_size`` rows per scale
    (default: int8 per channel, int4 128, nf4 64); ``method`` rtn | gptq; ``targets`` weight
    names (``q k v o gate up down``) or path regexes; ``damp`` GPTQ's Hessian dampening."""

    format: str = "int8"
    group_size: int | None = None
    method: str = "rtn"
    targets: tuple[str, ...] = DEFAULT_TARGETS
    damp: float = 0.01

    def __post_init__(self):
        def fail(field, message):
            raise ConfigError(f"quantize.{field} {message}", key=f"quantize.{field}")

        if self.format not in FORMATS:
            fail("format", f"must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.method not in METHODS:
            fail("method", f"must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.group_size is not None:
            if self.format == "int8":
                fail("group_size", "must be unset for int8 (one scale per output channel)")
            if self.group_size < 16 or self.group_size & (self.group_size - 1):
                fail("group_size", f"must be a power of two >= 16, got {self.group_size}")
        if not 0 < self.damp < 1:
            fail("damp", f"must be in (0, 1), got {self.damp}")
        if not self.targets:
            fail("targets", f"must name at least one weight: {', '.join(DEFAULT_TARGETS)} or a path regex")

    @property
    def rows_per_scale(self) -> int | None:
        return self.group_size if self.group_size is not None else DEFAULT_GROUP_SIZES[self.format]


def quantized_paths(params: Mapping[str, Any], config: QuantizeConfig) -> list[str]:
    """The float weights ``config.targets`` selects, in tree order (see :func:`target_weights`)."""
    return target_weights(params, config.targets, key="quantize.targets")


def _expanded(targets: Iterable[str]) -> tuple[tuple[str, ...], bool]:
    """``(names, optional)``: the default set (:data:`DEFAULT_TARGETS`) as every projection,
    routed experts included, each optional; any other list as it is, each required."""
    targets = tuple(targets)
    return ((*targets, "experts"), True) if targets == DEFAULT_TARGETS else (targets, False)


def target_weights(params: Mapping[str, Any], targets: Iterable[str], *, key: str) -> list[str]:
    """The float linear maps ``targets`` (names ``q k v o gate up down`` or path regexes)
    select, in tree order.

    Raises:
      ConfigError: a target selects nothing (the default set: none of them selects anything)
        or a weight that is not such a map (``key`` names the config entry).
    """
    flat = _float_leaves(params)
    chosen = []
    targets, optional = _expanded(targets)
    for target in targets:
        pattern = TARGETS.get(target, target)
        found = [p for p in flat if _matches(pattern, p)]
        if not found and optional:
            continue
        if not found:
            stored = [p for p in stored_weight_paths(param_paths(params)) if _matches(pattern, p)]
            more = f" and {len(stored) - 1} more" if len(stored) > 1 else ""
            already = f" (it selects {stored[0]}{more}, stored quantized already)" if stored else ""
            raise ConfigError(
                f"{key} entry {target!r} matches no float weight{already}; paths look like {', '.join(list(flat)[:4])}",
                key=key,
            )
        for path in found:
            try:
                weight_layout(path, flat[path])
            except ConfigError:  # its message speaks of adapters and names adapter.targets
                raise ConfigError(
                    f"{key} entry {target!r} selects {path} (shape {list(np.shape(leaf_value(flat[path])))}), which "
                    "is not a linear map into or out of the model width (embed); names: "
                    f"{', '.join(DEFAULT_TARGETS)}",
                    key=key,
                ) from None
        chosen += [p for p in found if p not in chosen]
    if not chosen:
        stored = stored_weight_paths(param_paths(params))
        already = f" (its {len(stored)} projections are stored quantized already)" if stored else ""
        raise ConfigError(
            f"{key}: the model has none of the projections {', '.join(targets)}{already}; paths look like "
            f"{', '.join(list(flat)[:4])}",
            key=key,
        )
    return [p for p in flat if p in chosen]


def _float_leaves(params: Mapping[str, Any]) -> dict[str, Any]:
    """``param_paths(params)`` without the parts of stored quantized weights (``.../int8``,
    ``.../scales``, ...): those are not weights to select."""
    flat = param_paths(params)
    stored = set(stored_weight_paths(flat))
    return {path: leaf for path, leaf in flat.items() if path.rsplit("/", 1)[0] not in stored}


def _matches(pattern: str, path: str) -> bool:
    return re.search(pattern, path) is not None


def quantize_params(
    params: Mapping[str, Any], config: QuantizeConfig, *, grams: Mapping[str, jax.Array] | None = None
) -> dict[str, Any]:
    """``params`` with the target weights stored quantized (see the module docstring).

    Raises:
      ConfigError: a target selects nothing or a MixLoRA MLP or DoRA-adapted weight, a weight's
        input size is not a multiple of the group size, or GPTQ lacks the Gram matrix of a weight.

    Warns (GPTQ, not while traced): some matrices' Grams are zero (:func:`uncalibrated_matrices`).
    """
    paths = quantized_paths(params, config)
    quantized = quantize_weights(params, paths, config, grams=grams)
    if config.method == "gptq" and not any(isinstance(g, jax.core.Tracer) for g in grams.values()):
        # Traced (a jitted quantize_params), the counts are not known here.
        matrices = {p: math.prod(np.shape(grams[p])[:-2]) for p in paths}
        warn_uncalibrated(uncalibrated_matrices({p: grams[p] for p in paths}), matrices)
    return quantized


def quantize_weights(
    params: Mapping[str, Any],
    paths: Iterable[str],
    config: QuantizeConfig,
    *,
    grams: Mapping[str, jax.Array] | None = None,
) -> dict[str, Any]:
    """``params`` with the float weights at ``paths`` (selected by :func:`quantized_paths`, of
    this tree or of a larger one this is part of, as ``/``-joined from that tree's root) stored
    quantized, with GPTQ's ``grams`` by path when ``config.method`` is gptq; no warning.

    Raises:
      ConfigError: as :func:`quantize_params`, but for the selection.
    """
    flat = param_paths(params)
    paths = list(paths)
    _check_read_quantized(flat, paths)
    gram_of = dict(grams or {})
    if config.method == "gptq":
        missing = [p for p in paths if p not in gram_of]
        if missing:
            raise ConfigError(f"GPTQ has no calibration statistics for {missing[0]}", key="quantize.method")
    for path in paths:
        flat[path] = _quantize_weight(path, flat[path], config, gram_of.get(path))
    return tree_from_paths(flat)


def uncalibrated_matrices(grams: Mapping[str, jax.Array]) -> dict[str, int]:
    """``{weight path: how many of its matrices have a zero Gram}`` (stacked layers and experts
    count one matrix each; paths with none are left out): the matrices GPTQ rounds to nearest,
    routed experts no calibration token reached. Concrete Grams only (not while tracing)."""
    # Counted where the Grams lie: only the counts come to the host, not [*lead, K, K] Grams.
    counts = jax.device_get(_zero_traces(list(grams.values())))
    return {path: int(count) for path, count in zip(grams, counts) if count}


@jax.jit
def _zero_traces(grams: list[jax.Array]) -> list[jax.Array]:
    # A list, not the dict: one program for the groups of layers whose Grams differ in their paths only.
    return [jnp.sum(_unreached(gram)) for gram in grams]


def _unreached(grams: jax.Array) -> jax.Array:
    """Whether no calibration input reached each matrix of Grams ``[..., k, k]`` (its Gram is zero,
    so is its trace: the Gram is a sum of outer products of inputs with themselves)."""
    return jnp.trace(grams, axis1=-2, axis2=-1) == 0


def warn_uncalibrated(counts: Mapping[str, int], matrices: Mapping[str, int]) -> None:
    """Warns that GPTQ rounded ``counts`` (:func:`uncalibrated_matrices`) matrices to nearest,
    when any, of the ``matrices`` each weight path holds (its layers and experts)."""
    if counts:
        total = sum(matrices[path] for path in counts)
        first = next(iter(counts))
        more = f" and {len(counts) - 1} more weights" if len(counts) > 1 else ""
        warnings.warn(
            f"GPTQ rounds {sum(counts.values())} matrices to nearest, of the {total} in {first}{more}: no "
            "calibration token reached them (routed experts the calibration text never selected); more or more "
            "varied calibration windows would reach them",
            stacklevel=3,
        )


def _check_read_quantized(flat: Mapping[str, Any], paths: list[str]) -> None:
    """The MLPs MixLoRA adapted and weights with a DoRA adapter (whose norm ``||W + scale A B||``
    needs ``W``) read their weights as floats only."""
    from ember.models.adapters.lowrank import MIXLORA_ROUTER, part_name  # they import the stored format

    mixlora_mlps = {p.rsplit("/", 1)[0] for p in flat if MIXLORA_ROUTER.match(p.rsplit("/", 1)[-1])}
    for path in paths:
        if part_name(path, "lora_magnitude") in flat:
            raise ConfigError(
                f"quantize.targets selects {path}, which has a DoRA adapter: DoRA needs a float base weight "
                "(its norm is taken of W + scale A B); merge the adapter first "
                "(ember.models.adapters.merged_weights) or leave the weight out of quantize.targets",
                key="quantize.targets",
            )
        if path.rsplit("/", 1)[0] in mixlora_mlps:
            raise ConfigError(
                f"quantize.targets selects {path}, a MixLoRA MLP's weight: MixLoRA MLPs are not stored quantized "
                "(their layers read float weights); leave them out of quantize.targets",
                key="quantize.targets",
            )


def _quantize_weight(path: str, leaf: Any, config: QuantizeConfig, gram: jax.Array | None) -> Any:
    layout = weight_layout(path, leaf)
    value = leaf_value(leaf)
    _, in_shape, _ = layout.split(np.shape(value))
    group = weight_group(path, math.prod(in_shape), config.format, config.rows_per_scale, key="quantize.group_size")
    grams = gram if config.method == "gptq" else None
    shape_only = dataclasses.replace(layout, names=None)  # one program for every weight of one shape
    parts = _stored_matrices(value, grams, config.format, group, config.damp, shape_only)
    if isinstance(leaf, nn.Partitioned):
        axes = stored_part_axes(path, leaf, parts)
        parts = {key: nn.Partitioned(part, axes[key]) for key, part in parts.items()}
    return parts


def stored_part_axes(path: str, leaf: nn.Partitioned, keys: Iterable[str]) -> dict[str, tuple[str | None, ...]]:
    """``{part key: logical axes}`` of the stored parts ``keys`` (``ember.models.quantization.stored``)
    of the float weight ``leaf`` at ``path``, boxed with its logical axes ``[*lead, *in, *out]``:
    the codes and scales ``[*lead, K-rows, *out]`` take the lead and output axes and, for their
    rows, the first input axis (``K`` flattens the inputs row-major, so splitting its rows splits
    that axis); NF4's ``absmax_scale [*lead, blocks]`` keeps its blocks whole and ``absmax_mean
    [*lead]`` has the lead axes only. The names quantizing a boxed weight gives its parts, and
    those a quantized model is placed by (``ember.serving.model_program.weight_axes``)."""
    layout = weight_layout(path, leaf)
    names = tuple(leaf.names)
    stored = (*names[: layout.lead], names[layout.lead], *names[layout.lead + layout.in_dims :])
    return {key: _part_names(key, stored, layout.lead) for key in keys}


# One compiled program per weight shape and format, its layers and experts quantized one after another
# (op by op, storing each matrix dispatched and compiled some 10 programs of its own). The casts and the
# Grams' broadcast are in it too: eager, each compiled a program per shape.
@functools.partial(jax.jit, static_argnames=("fmt", "group", "damp", "layout"))
def _stored_matrices(
    weight: jax.Array, grams: jax.Array | None, fmt: str, group: int | None, damp: float, layout: WeightLayout
) -> dict[str, jax.Array]:
    """The stored parts of ``weight [*lead, *in, *out]`` (any float dtype; as ``layout`` splits it),
    each of its ``[prod(in), prod(out)]`` matrices rounded to nearest in float32 or, given ``grams``
    (``[*lead, k, k]``, one per layer and expert, or ``[k, k]`` for all), quantized by GPTQ with its
    Gram, but rounded to nearest where its Gram is zero (no input reached it: GPTQ would zero every row)."""
    lead, in_shape, out_shape = layout.split(weight.shape)
    k, n = math.prod(in_shape), math.prod(out_shape)
    weight = weight.astype(jnp.float32)
    if grams is not None:
        grams = jnp.broadcast_to(grams.astype(jnp.float32), (*lead, k, k))

    def stored(matrix_and_gram):
        matrix, gram = matrix_and_gram
        if gram is None:
            return store_matrix(quantize_matrix(matrix, fmt, group), out_shape)
        quantized = jax.lax.cond(
            _unreached(gram),
            lambda m, g: quantize_matrix(m, fmt, group),
            lambda m, g: gptq_matrix(m, g, fmt, group, damp),
            matrix,
            gram,
        )
        return store_matrix(quantized, out_shape)

    parts = jax.lax.map(stored, (weight.reshape(-1, k, n), None if grams is None else grams.reshape(-1, k, k)))
    return {key: part.reshape(*lead, *part.shape[1:]) for key, part in parts.items()}


def weight_group(path: str, k: int, fmt: str, group: int | None, *, key: str) -> int | None:
    """The rows per scale of the weight at ``path`` with ``k`` input rows: ``group``, or all
    ``k`` rows when it has no more than a group (for the 4-bit formats, ``k`` must then be a
    power of two >= 16, what the kernel tiles); None (per output channel) when ``group`` is.

    Raises:
      ConfigError: ``k`` is not a multiple of ``group`` nor such a single group (``key``).
    """
    if group is None:
        return None
    if k <= group and (fmt == "int8" or (k >= 16 and not k & (k - 1))):
        return k
    if k % group or k <= group:
        raise ConfigError(f"{path}: its {k} input rows are not a multiple of {key} {group}", key=key)
    return group


def _part_names(key: str, names: tuple, lead: int) -> tuple:
    if key == "absmax_scale":
        return (*names[:lead], None)
    if key == "absmax_mean":
        return names[:lead]
    return names


def dequantize_params(params: Mapping[str, Any], like: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with every quantized weight replaced by the float weight it stands for, in
    the shape and dtype of the same weight in ``like`` (the float tree's structure, e.g. from
    ``jax.eval_shape`` of the model's init)."""
    shapes = param_paths(like)

    def walk(node: Any, path: str) -> Any:
        if stored_format(node):  # a stored weight is a dict of parts: dequantize it whole
            return _dequantized_weight(path, node, shapes[path])
        if isinstance(node, Mapping):
            return {key: walk(value, f"{path}/{key}" if path else key) for key, value in node.items()}
        return node

    return walk(params, "")


def _dequantized_weight(path: str, stored: Mapping[str, Any], like: Any) -> jax.Array:
    """The float weight (``like``'s shape and dtype) of one stored weight, layer by layer."""
    target = leaf_value(like)
    layout = weight_layout(path, like)
    parts = {key: leaf_value(part) for key, part in stored.items()}
    shape_only = dataclasses.replace(layout, names=None)
    return _dequantized_layers(parts, tuple(target.shape), jnp.dtype(target.dtype), shape_only)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "layout"))
def _dequantized_layers(
    parts: Mapping[str, jax.Array], shape: tuple[int, ...], dtype: Any, layout: WeightLayout
) -> jax.Array:
    """The float weight ``shape`` (as ``layout`` splits it) of stored ``parts`` ``[*lead, ...]``,
    one layer and expert after another, in one program per weight shape."""
    lead, in_shape, _ = layout.split(shape)
    per_layer = {key: part.reshape(-1, *part.shape[len(lead) :]) for key, part in parts.items()}
    return jax.lax.map(lambda layer: dequantized(layer, in_shape, dtype), per_layer).reshape(shape)


def weight_bytes(params: Any) -> int:
    """Bytes of every array in ``params`` (a quantized tree counts its packed storage)."""
    return sum(int(np.prod(np.shape(a))) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(params))


def calibration_grams(apply_fn, variables: Mapping[str, Any], batches: Iterable[Any]) -> dict[str, jax.Array]:
    """``{weight path: X^T X [K, K]}`` summed over ``batches``: ``apply_fn(variables, batch)``
    applies a model (or a part of one) with the ``calibration`` collection mutable and returns
    that collection (the layers sow each target weight's input Gram matrix there; stacked layers
    give ``[layers, K, K]``). One pass of ``variables`` as given: ``apply_fn`` is jitted as it
    is, so passing the same function again compiles nothing new. GPTQ of a whole model
    calibrates a group of layers at a time (``ember.models.quantization.sequential``)."""
    step = jax.jit(apply_fn)
    total = None
    for batch in batches:
        sown = step(variables, batch)
        total = sown if total is None else _summed(total, sown)
    if total is None:
        raise ConfigError("GPTQ calibration got no batches", key="quantize.calibration")
    return {path[: -len("_gram")]: gram for path, gram in param_paths(total).items()}


@jax.jit
def _summed(a: Any, b: Any) -> Any:
    # One program for every group and batch (added op by op, each Gram shape compiled its own).
    return jax.tree.map(jnp.add, a, b)


__all__ = [
    "DEFAULT_TARGETS",
    "METHODS",
    "QuantizeConfig",
    "calibration_grams",
    "dequantize_params",
    "quantize_params",
    "quantize_weights",
    "quantized_paths",
    "stored_part_axes",
    "target_weights",
    "uncalibrated_matrices",
    "warn_uncalibrated",
    "weight_bytes",
    "weight_group",
]

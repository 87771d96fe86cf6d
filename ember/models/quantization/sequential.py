"""GPTQ of a whole ``DecoderLM``, a group of layers at a time, as the GPTQ paper's code does.

    qparams, uncalibrated = sequential_gptq(model_config, variables, token_batches, QuantizeConfig(method="gptq"))

The calibration batches are embedded once; then for each group of layers (a period of the
block pattern, ``ember.models.decoder.BlockGroup``), in order: the group runs on its inputs
with the ``calibration`` collection mutable (its layers sow their target weights' input Grams
``X^T X``), its target weights are quantized with those Grams (``quantize_weights``), and the
*quantized* group runs on the same inputs to give the next group's. Each group is thus
calibrated on the outputs of the groups already quantized, so it compensates their errors, and
only one group's Grams are held at a time (Llama-7B's 32 layers hold ~28 GB of f32 Grams in
all), beside the calibration batches' hidden states ``[batch, seq, embed]``. Layers within a
group are calibrated together, on the group's inputs.

Why not one pass of the float model (``calibration_grams`` of the whole model): it holds every
layer's Grams at once, and calibrates each layer on the float model's inputs, which the
quantized model never gives it.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.errors import ConfigError
from ember.core.sharding import constrain
from ember.models.config import ModelConfig
from ember.models.decoder import BlockGroup, initial_router_logits, scaled_embeddings, token_embedding
from ember.models.layer_layout import group_span, layer_location, num_groups
from ember.models.quantization.quantize import (
    QuantizeConfig,
    calibration_grams,
    quantize_weights,
    quantized_paths,
    uncalibrated_matrices,
    warn_uncalibrated,
)
from ember.models.quantization.stored import CALIBRATION


def sequential_gptq(
    model_config: ModelConfig, variables: Mapping[str, Any], batches: Iterable[Any], config: QuantizeConfig
) -> tuple[dict[str, Any], dict[str, int]]:
    """GPTQ of the ``DecoderLM`` of ``model_config`` with ``variables`` (``params`` and any model
    state), calibrated on ``batches`` group of layers by group (see the module docstring).

    Args:
      batches: token ids ``[batch, seq]``, or mappings of ``DecoderLM``'s inputs (``tokens``,
        optional ``positions`` and packed ``segment_ids`` ``[batch, seq]``).
      config: the weights and format (``config.method`` must be gptq).

    Returns:
      ``(params with the target weights stored quantized, uncalibrated)``: ``uncalibrated`` as
      :func:`uncalibrated_matrices` (how many matrices per weight path GPTQ rounded to nearest,
      no calibration token having reached them); warned about as ``quantize_params`` does.

    Raises:
      ConfigError: as ``quantize_params``, or no batches.
    """
    if config.method != "gptq":
        raise ConfigError(f"sequential GPTQ needs quantize.method gptq, got {config.method!r}", key="quantize.method")
    params = variables["params"]
    state = {name: tree for name, tree in variables.items() if name != "params"}
    paths = quantized_paths(params, config)
    containers = {_location(model_config, g)[0] for g in range(num_groups(model_config))}
    outside = [p for p in paths if p.split("/", 1)[0] not in containers]
    if outside:  # only a decoder layer sows its weights' Grams
        raise ConfigError(f"GPTQ has no calibration statistics for {outside[0]}", key="quantize.method")
    embedded = jax.jit(functools.partial(_embedded, model_config))  # one program per batch shape
    hidden = [embedded(params["embed"], _calibration_inputs(batch)) for batch in batches]
    if not hidden:
        raise ConfigError("GPTQ calibration got no batches", key="quantize.calibration")
    steps: dict[tuple, tuple] = {}
    quantized_groups, counts, matrices = [], Counter(), Counter()
    for g in range(num_groups(model_config)):
        container, index = _location(model_config, g)
        group_params = {container: _part(params[container], index)}
        group_state = {name: _part(tree[container], index) for name, tree in state.items() if container in tree}
        calibrate, forward = _group_steps(model_config, g, steps)
        sown = calibration_grams(calibrate, {"params": group_params[container], **group_state}, hidden)
        group_paths = [p for p in paths if p.startswith(f"{container}/")]
        grams = _by_weight_path(sown, group_paths)
        del sown  # the Grams of weights not quantized too
        quantized = quantize_weights(group_params, group_paths, config, grams=grams)
        counts.update(uncalibrated_matrices(grams))
        matrices.update({path: math.prod(gram.shape[:-2]) for path, gram in grams.items()})
        del grams  # before the next group's: one group's Grams at a time
        quantized_variables = {"params": quantized[container], **group_state}
        for i, inputs in enumerate(hidden):  # in place: one batch's hidden states at a time beside them
            hidden[i] = forward(quantized_variables, inputs)
        quantized_groups.append(quantized)
    warn_uncalibrated(counts, matrices)
    return _assembled(params, quantized_groups, model_config), dict(counts)


def _by_weight_path(sown: Mapping[str, jax.Array], paths: list[str]) -> dict[str, jax.Array]:
    """The Grams a group's layers sowed (by path within the group, with the weight's kept ``[1]``
    layer axis when scanned: see :func:`_group_steps`) by the paths of the weights ``paths`` (from
    the model's root); a target no layer sowed a Gram for is left out, for ``quantize_weights`` to name."""
    inner = {path: path.split("/", 1)[1] for path in paths}
    return {path: sown[name] for path, name in inner.items() if name in sown}


def _location(model_config: ModelConfig, group: int) -> tuple[str, int]:
    """``(container, index)`` of group ``group``'s variables in every collection: index -1 when
    the container holds that group alone, else its index on the container's ``[groups]`` axis."""
    return layer_location(model_config, group * model_config.layer_period)[:2]


def _calibration_inputs(batch: Any) -> dict[str, Any]:
    """``DecoderLM``'s inputs in a calibration batch (token ids ``[batch, seq]`` or a mapping of
    ``tokens`` and optional ``positions`` and ``segment_ids``), each present, None where not given."""
    inputs = dict(batch) if isinstance(batch, Mapping) else {"tokens": batch}
    unknown = set(inputs) - {"tokens", "positions", "segment_ids"}
    if unknown:
        raise ValueError(f"calibration batches hold tokens, positions and segment_ids; got {sorted(unknown)}")
    return {"tokens": inputs["tokens"], "positions": inputs.get("positions"), "segment_ids": inputs.get("segment_ids")}


def _embedded(model_config: ModelConfig, embed_params: Any, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The first group's inputs for one batch (:func:`_calibration_inputs`): the embedded tokens
    ``x [batch, seq, embed]``, the router logits MoE++'s gating residual starts from (or None),
    positions and segment ids."""
    tokens = inputs["tokens"]
    x = token_embedding(model_config).apply({"params": nn.meta.unbox(embed_params)}, tokens)
    x = constrain(scaled_embeddings(model_config, x), ("batch", "seq", "embed"))
    positions = inputs["positions"]
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :], tokens.shape)
    return dict(
        x=x,
        router_logits=initial_router_logits(model_config, x),
        positions=positions,
        segment_ids=inputs["segment_ids"],
    )


def _group_steps(model_config: ModelConfig, group: int, steps: dict[tuple, tuple]) -> tuple:
    """``(calibrate, forward)`` of group ``group``'s ``BlockGroup``, shared by the groups of the
    same layer kinds (``steps`` caches them by kinds), so that each compiles once:
    ``calibrate(variables, inputs)`` the sown ``calibration`` collection, ``forward(variables,
    inputs)`` the inputs of the next group. ``variables`` are the group's parts (:func:`_part`),
    scanned with their kept ``[1]`` axis, which is taken off inside (and put on the Grams)."""
    first, num_blocks = group_span(model_config, group)
    layers = range(first, first + num_blocks)
    kinds = tuple(
        (model_config.layer_kinds[i], model_config.layer_mlps[i], model_config.layer_transfer_kinds[i]) for i in layers
    )
    if kinds not in steps:
        module = BlockGroup(model_config, num_blocks, first)
        scanned = model_config.scan_layers

        def run(variables, inputs, mutable):
            variables = nn.meta.unbox(variables)
            if scanned:
                variables = jax.tree.map(lambda leaf: leaf[0], variables)
            carry = (inputs["x"], inputs["router_logits"], None)
            return module.apply(
                variables, carry, (None, 0), inputs["positions"], inputs["segment_ids"], None, None, mutable=mutable
            )

        def calibrate(variables, inputs):
            sown = run(variables, inputs, [CALIBRATION])[1][CALIBRATION]
            return jax.tree.map(lambda gram: gram[None], sown) if scanned else sown

        @jax.jit
        def forward(variables, inputs):
            (x, router_logits, _), _ = run(variables, inputs, False)
            return {**inputs, "x": x, "router_logits": router_logits}

        steps[kinds] = (calibrate, forward)  # calibration_grams jits calibrate: the same function, one compile
    return steps[kinds]


def _part(tree: Any, index: int) -> Any:
    """A group's part of a container's tree: ``[index:index + 1]`` of the stacked ``[groups]``
    axis (kept, so that paths and layouts stay those of the whole tree), or all of it (-1)."""
    return tree if index < 0 else _sliced(tree, index)


@jax.jit
def _sliced(tree: Any, index: jax.Array) -> Any:
    # One program for every group: sliced op by op with static bounds, each leaf's slice compiled once per group.
    return jax.tree.map(lambda leaf: jax.lax.dynamic_slice_in_dim(leaf, index, 1), tree)


def _assembled(params: Mapping[str, Any], groups: list[dict[str, Any]], model_config: ModelConfig) -> dict[str, Any]:
    """``params`` with the groups' quantized trees in place (scanned: concatenated on ``[groups]``)."""
    if model_config.scan_layers:
        return {**params, "layers": _concatenated([q["layers"] for q in groups])}
    return {**params, **{name: tree for group in groups for name, tree in group.items()}}


@jax.jit
def _concatenated(trees: list[Any]) -> Any:
    return jax.tree.map(lambda *parts: jnp.concatenate(parts), *trees)


__all__ = ["sequential_gptq"]

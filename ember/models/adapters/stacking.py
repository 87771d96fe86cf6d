"""Many adapters in one parameter tree, for serving them at once (S-LoRA).

    params, names = stack_adapters(base_params, {"sql": sql_adapter, "chat": chat_adapter})
    # a serving step passes each sequence's adapter index (-1: none) in its paging

For every weight any adapter adapts, the stacked tree holds ``<w>_lora_a [*lead, n, *in,
rank]`` and ``<w>_lora_b [*lead, n, rank, *out]`` (``lead``: the stacked-layer axis of a
scanned model): adapter ``i`` in slot ``i``, ranks padded with zeros to the largest, the
scale folded into ``B``, zeros where adapter ``i`` leaves the weight alone (a PiSSA or
LoRA-GA adapter, trained on the residual ``W - scale A0 B0``, at rank ``2r`` against ``W``:
``leaves.factors_on_original_base``); with DoRA, ``<w>_lora_magnitude [*lead, n, *out]``
holds each adapter's factor ``m / ||W + scale A B||`` (1 where it has none), computed once
since the base weight is fixed. Layers apply them with
``lowrank.adapted_matmul(..., adapter_ids=...)``: tokens grouped by adapter, two grouped
matmuls, no merged weights. A base weight stored quantized (``ember quantize``, QLoRA's NF4
base) stays quantized: the adapters' deltas are added to its quantized product, as one
QLoRA adapter's are; DoRA, whose factor needs the float weight's norms, is refused there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from ember.core.errors import ConfigError
from ember.core.sharding import unbox
from ember.core.tree import param_paths, tree_from_paths
from ember.kernels_pallas.quantized_formats import PACKED_FORMATS
from ember.models.adapters.layout import stacked_axes, weight_layout
from ember.models.adapters.leaves import adapted_paths, factors_on_original_base, without_adapters
from ember.models.adapters.lowrank import MIXLORA_ROUTER, LowRank, dora_factor, part_name
from ember.models.quantization.stored import QuantizedWeight, stored_format


def stack_adapters(
    base: Mapping[str, Any], adapters: Mapping[str, Mapping[str, Any]]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``(params with every adapter stacked, adapter names in slot order)``.

    ``base``: the base model's params (without adapters of its own); ``adapters``: name ->
    adapter leaves (``adapter_leaves(params)`` or ``ember.models.hf.load_peft_adapter``), for the
    same layout.

    Raises:
      ConfigError: no adapters, a base with adapters of its own, an adapter on a weight the base
        lacks or of the wrong shape, a DoRA adapter on a weight the base stores quantized, or
        an adapter on routed experts (their adapters merge per expert and cannot be stacked).
    """
    if not adapters:
        raise ConfigError("stack_adapters needs at least one adapter", key="adapters")
    if any(MIXLORA_ROUTER.match(p.rsplit("/", 1)[-1]) for p in param_paths(base)):
        raise ConfigError("a MixLoRA model serves its own experts and cannot take stacked adapters", key="adapters")
    own = adapted_paths(base)
    if own:  # dropping them would serve a different model than the checkpoint is
        raise ConfigError(
            f"the base model carries adapters of its own ({len(own)} weights, e.g. {own[0]}: a LoRA fine-tuning "
            "run); stacked adapters go on a base without any: serve the run's merged export (export.merged) with "
            "them, or the run alone",
            key="adapters",
        )
    flat_base = param_paths(without_adapters(unbox(base)))
    flats = {name: param_paths(unbox(tree)) for name, tree in adapters.items()}
    weights = sorted({w for flat in flats.values() for w in adapted_paths(tree_from_paths(flat))})
    stacked = {}
    for weight in weights:
        kernel = flat_base.get(weight)
        if kernel is None:  # a weight stored quantized is its parts (.../kernel/int8, .../kernel/scales)
            parts = {path[len(weight) + 1 :]: v for path, v in flat_base.items() if path.startswith(f"{weight}/")}
            if stored_format(parts) is None:
                raise ConfigError(f"an adapter targets {weight}, which the base model does not have", key="adapters")
            kernel = QuantizedWeight(parts)
        if "/experts/" in f"/{weight}":
            raise ConfigError(
                f"adapters on routed experts ({weight}) merge into each expert and cannot be served several at "
                "once; merge one adapter into the model instead",
                key="adapters",
            )
        stacked.update(_stack_weight(weight, kernel, flats))
    return tree_from_paths({**flat_base, **stacked}), tuple(adapters)


def _stack_weight(weight: str, kernel: Any, flats: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The stacked factors (and DoRA factors) of ``weight``: ``kernel`` float or a ``QuantizedWeight``."""
    quantized = isinstance(kernel, QuantizedWeight)
    leading = stacked_axes(weight) if quantized else weight_layout(weight, kernel).lead
    factors = {
        name: factors_on_original_base(flat, weight, leading)
        for name, flat in flats.items()
        if part_name(weight, "lora_a") in flat
    }
    dora = any(part_name(weight, "lora_magnitude") in flat for flat in flats.values())
    if quantized:
        if dora:
            raise ConfigError(
                f"a DoRA adapter targets {weight}, which this base model stores quantized: DoRA's factor needs the "
                "float weight's norms (serve DoRA adapters on the float model)",
                key="adapters",
            )
        values = kernel.parts[kernel.format]  # [*lead, K (or K / 2 packed), *out_shape]
        lead, out_shape = values.shape[:leading], values.shape[leading + 1 :]
        in_shape = next(iter(factors.values()))[0].shape[leading:-1]  # A [*lead, *in_shape, rank]
        rows = values.shape[leading] * (2 if kernel.format in PACKED_FORMATS else 1)
        if math.prod(in_shape) != rows:
            raise ConfigError(
                f"an adapter on {weight} takes inputs of shape {in_shape}; the quantized weight has {rows} input rows",
                key="adapters",
            )
        dtype = jnp.float32
    else:
        lead, in_shape, out_shape = weight_layout(weight, kernel).split(np.shape(kernel))
        kernel = jnp.asarray(kernel)
        dtype = kernel.dtype
    names = list(flats)
    rank = max(a.shape[-1] for a, _ in factors.values())
    a_slots, b_slots, factor_slots = [], [], []
    for name in names:
        flat = flats[name]
        if part_name(weight, "lora_a") not in flat:
            a_slots.append(jnp.zeros((*lead, *in_shape, rank), jnp.float32))
            b_slots.append(jnp.zeros((*lead, rank, *out_shape), jnp.float32))
            factor_slots.append(jnp.ones((*lead, *out_shape), jnp.float32))
            continue
        a, b = (jnp.asarray(factor, jnp.float32) for factor in factors[name])
        scale = jnp.asarray(flat[part_name(weight, "lora_scale")], jnp.float32)
        if a.shape[:-1] != (*lead, *in_shape) or b.shape[: len(lead)] + b.shape[len(lead) + 1 :] != (*lead, *out_shape):
            raise ConfigError(
                f"adapter {name!r} on {weight} has A {a.shape} and B {b.shape}, which do not fit the weight "
                f"{(*lead, *in_shape, *out_shape)}",
                key="adapters",
            )
        magnitude = flat.get(part_name(weight, "lora_magnitude"))
        adapter = LowRank(a, b, scale, None if magnitude is None else jnp.asarray(magnitude, jnp.float32))
        factor_slots.append(
            dora_factor(kernel, adapter, len(in_shape), len(lead))
            if magnitude is not None
            else jnp.ones((*lead, *out_shape), jnp.float32)
        )
        pad = rank - a.shape[-1]
        scale_b = scale.reshape(*scale.shape, *(1,) * (b.ndim - scale.ndim))
        a_slots.append(jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]))
        b_slots.append(jnp.pad(b * scale_b, [(0, 0)] * len(lead) + [(0, pad)] + [(0, 0)] * len(out_shape)))
    axis = len(lead)  # the adapter axis goes after the stacked-layer axis, so a scan slices layers first
    result = {
        part_name(weight, "lora_a"): jnp.stack(a_slots, axis).astype(dtype),
        part_name(weight, "lora_b"): jnp.stack(b_slots, axis).astype(dtype),
    }
    if dora:
        result[part_name(weight, "lora_magnitude")] = jnp.stack(factor_slots, axis)
    return result


__all__ = ["stack_adapters"]

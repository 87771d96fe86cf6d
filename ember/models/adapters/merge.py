"""Folding adapters into their weights and taking them back out, exactly.

    merged, record = merge(params)       # W <- W + scale A B (DoRA: rescaled); adapters removed
    params = unmerge(merged, record)     # the adapted tree again, bit for bit

``unmerge`` restores the weights that ``merge`` replaced rather than subtracting ``scale A B``
again: subtraction in floating point does not give ``W`` back (it drifts by an ulp or so
per round trip), while serving that swaps adapters needs the base unchanged. The record holds
only the adapted weights and their adapters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ember.core.errors import ConfigError
from ember.core.tree import param_paths, tree_from_paths
from ember.models.adapters.layout import leaf_value, rebox, weight_layout
from ember.models.adapters.leaves import adapted_paths, adapter_part
from ember.models.adapters.lowrank import LowRank, adapted_weight, part_name


def merge(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(merged params, record)``: every adapted weight replaced by its merged form (see
    ``lowrank.adapted_weight``) and the adapter leaves removed; ``record`` (flat, by path)
    holds what :func:`unmerge` needs."""
    flat = param_paths(params)
    if any(adapter_part(p) == "mixlora_router" for p in flat):
        raise ConfigError("MixLoRA's routed LoRA experts are not one weight and cannot be merged into the model")
    record = {}
    merged = {p: v for p, v in flat.items() if adapter_part(p) is None}
    for path in adapted_paths(params):
        if path not in flat:  # its float leaf became a dict of quantized parts
            raise ConfigError(
                f"{path} is stored quantized: an adapter does not merge into a quantized base; merge it into "
                "the float base (ember.models.quantization.dequantize_params) or serve it unmerged"
            )
        record[path] = flat[path]
        record.update({p: v for p, v in flat.items() if p.startswith(path + "_lora_")})
        merged[path] = rebox(flat[path], merged_weight(path, flat))
    return tree_from_paths(merged), record


def unmerge(merged: Mapping[str, Any], record: Mapping[str, Any]) -> dict[str, Any]:
    """The tree :func:`merge` was given: its replaced weights and adapter leaves restored."""
    return tree_from_paths({**param_paths(merged), **record})


def merged_weights(params: Mapping[str, Any]) -> dict[str, Any]:
    """The base-layout tree of ``params`` with every adapter folded in (for a merged export)."""
    return merge(params)[0]


def merged_weight(path: str, flat: Mapping[str, Any]):
    """The merged weight at ``path`` of the flat tree ``flat`` (unboxed)."""
    layout = weight_layout(path, flat[path])

    def get(part):
        leaf = flat.get(part_name(path, part))
        return leaf_value(leaf) if leaf is not None else None

    adapter = LowRank(get("lora_a"), get("lora_b"), get("lora_scale"), get("lora_magnitude"))
    return adapted_weight(leaf_value(flat[path]), adapter, layout.in_dims, layout.lead)


__all__ = ["merge", "merged_weight", "merged_weights", "unmerge"]

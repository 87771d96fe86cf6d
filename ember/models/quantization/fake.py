"""Fake quantization for quantization-aware training: the target weights rounded through a
format and back, with a straight-through gradient, so the model trains against the weights
it will be served with while its float weights keep learning.

    params_seen = fake_quantize_params(params, "int4", group_size=128)   # inside the loss
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax

from ember.core.tree import param_paths, tree_from_paths
from ember.models.adapters.layout import leaf_value, rebox, weight_layout
from ember.models.quantization.numerics import DEFAULT_GROUP_SIZES, fake_quantize
from ember.models.quantization.quantize import DEFAULT_TARGETS, target_weights, weight_group

QAT_FORMATS: tuple[str, ...] = ("int8", "int4", "nf4", "fp8")
"""Formats QAT can train for (fp8: float8_e4m3fn per output channel, for QAT only)."""


def fake_quantize_params(
    params: Mapping[str, Any],
    fmt: str,
    group_size: int | None = None,
    targets: Iterable[str] = DEFAULT_TARGETS,
    *,
    key: str = "qat.targets",
    group_key: str = "qat.group_size",
) -> dict[str, Any]:
    """``params`` with every target weight replaced by ``fake_quantize`` of it (per matrix,
    input dimensions flattened, groups of ``group_size`` input rows; default: the format's).

    Raises:
      ConfigError: a target selects nothing (``key``), or a weight's input rows are neither a
        multiple of the group size nor, for the 4-bit formats, one group of a power of two >= 16
        rows: a layout ``ember quantize`` could not store (``group_key``).
    """
    group = group_size or DEFAULT_GROUP_SIZES[fmt]
    flat = param_paths(params)
    for path in target_weights(params, targets, key=key):
        leaf = flat[path]
        value = leaf_value(leaf)
        _, in_shape, out_shape = weight_layout(path, leaf).split(value.shape)
        k, n = math.prod(in_shape), math.prod(out_shape)
        rows = weight_group(path, k, fmt, group, key=group_key)  # as ember quantize will store it
        matrices = value.reshape(-1, k, n)
        rounded = jax.vmap(functools.partial(fake_quantize, fmt=fmt, group_size=rows))(matrices)
        flat[path] = rebox(leaf, rounded.reshape(value.shape))
    return tree_from_paths(flat)


__all__ = ["QAT_FORMATS", "fake_quantize_params"]

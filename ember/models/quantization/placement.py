"""Where a stored quantized weight's parts go on a mesh.

A stored weight (``ember.models.quantization.stored``) is several arrays: its codes ``[*lead,
rows, *out]``, its scales ``[*lead, rows / group, *out]`` (and NF4's absmax parts), whose logical
axes follow the float weight's (``quantize.stored_part_axes``). A mesh axis that does not divide
a dimension leaves it whole (``ember.core.sharding.tree_shardings``), and the parts differ in
size along their rows: a tensor axis of 4 over an int4 weight of 64 input rows in groups of 32
splits its 32 packed code rows but not its 2 scale rows, and a serving step so split gathered
those codes whole at every call (``ember.serving.model_program``; the training step compiled on
such a placement gathered none, so the trainer places each part on its own).
:func:`split_alike_shapes` gives the placement shapes that make a mesh axis split such a
dimension of every part or of none.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from ember.core.tree import map_paths, param_paths
from ember.models.quantization.stored import stored_weight_paths


def split_alike_shapes(params: Any, axes: Any) -> Any:
    """``params``' shapes (``ShapeDtypeStruct``s) for placing them by ``axes``, where the parts of
    each stored quantized weight give, in every dimension that holds the same logical axis, the
    greatest common divisor of their sizes there: a mesh axis then splits that dimension of all
    the parts or of none (``tree_shardings`` leaves whole a dimension a mesh axis does not
    divide). An int4 ``o`` of 64 input rows in groups of 32 on tensor=4: its two scale rows stay
    whole, and so must its codes' rows, which split beside whole scales were gathered every step."""
    flat_axes, flat = param_paths(axes), param_paths(params)
    weights = set(stored_weight_paths(flat))
    common: dict[tuple[str, str], int] = {}
    for path, leaf in flat.items():
        weight = path.rsplit("/", 1)[0]
        if weight in weights:
            for name, size in zip(flat_axes[path], jnp.shape(leaf)):
                if name is not None:
                    common[weight, name] = math.gcd(common.get((weight, name), 0), size)

    def shape(path: str, leaf: Any) -> jax.ShapeDtypeStruct:
        weight = path.rsplit("/", 1)[0]
        sizes = [
            size if name is None else common.get((weight, name), size)
            for name, size in zip((*flat_axes[path], *[None] * jnp.ndim(leaf)), jnp.shape(leaf))
        ]
        return jax.ShapeDtypeStruct(tuple(sizes), jnp.result_type(leaf))

    return map_paths(shape, params)


__all__ = ["split_alike_shapes"]

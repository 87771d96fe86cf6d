"""The streaming (online) softmax that attention kernels accumulate tile by tile.

Inside a Pallas kernel body: ``carry = online_softmax_init(rows, head_dim)``, then
``carry = online_softmax_step(carry, logits, visible, v)`` per key tile, then
``online_softmax_result(carry)``. Rows that never see a visible key end as zeros, not NaN.
"""

from __future__ import annotations

import jax.numpy as jnp


def online_softmax_step(carry, logits, visible, v):
    """One streaming-softmax update with a tile of ``logits [rows, keys]`` (f32), its mask
    and values ``v [keys, head_dim]``; ``carry = (row_max [rows], row_sum [rows], acc
    [rows, head_dim])``. Rows with nothing visible so far keep max ``-inf`` and sum 0."""
    row_max, row_sum, acc = carry
    masked = jnp.where(visible, logits, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(masked, axis=1))
    shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    weights = jnp.exp(masked - shift[:, None])
    rescale = jnp.exp(row_max - shift)
    row_sum = rescale * row_sum + jnp.sum(weights, axis=1)
    acc = acc * rescale[:, None] + jnp.dot(weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return new_max, row_sum, acc


def online_softmax_init(rows: int, head_dim: int):
    return (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )


def online_softmax_result(carry):
    """``acc / row_sum`` ``[rows, head_dim]`` f32, zero for rows that saw no key."""
    _, row_sum, acc = carry
    return acc / jnp.where(row_sum == 0.0, 1.0, row_sum)[:, None]

"""The streaming (online) softmax that attention kernels accumulate tile by tile.

Inside a Pallas kernel body: ``carry = online_softmax_init(rows, head_dim)``, then
``carry = online_softmax_step(carry, logits, visible, v)`` per key tile, then
``online_softmax_result(carry)`` (and :func:`online_softmax_lse` for a backward). Rows that
never see a visible key end as zeros, not NaN. Carries of the same rows over disjoint sets
of keys (a split-KV kernel's partial results) merge with :func:`online_softmax_merge`.

A TPU kernel whose carry lives across grid steps keeps it in VMEM scratch, the running max
and sum as lane-broadcast columns ``[rows, 128]``: :func:`per_row` reads such a column's
``[rows]`` values and :func:`set_per_row` writes them.
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
    shift = _finite_shift(new_max)
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
    """``acc / row_sum`` ``[rows, head_dim]`` f32 (or ``[..., rows, head_dim]`` for a carry
    with leading axes), zero for rows that saw no key."""
    _, row_sum, acc = carry
    return acc / jnp.where(row_sum == 0.0, 1.0, row_sum)[..., None]


def online_softmax_merge(row_max, row_sum, acc):
    """One carry from the carries of the same rows over disjoint sets of keys, stacked on a
    leading axis: ``row_max``/``row_sum`` ``[parts, ...rows]`` and ``acc [parts, ...rows,
    head_dim]`` give ``(row_max [...rows], row_sum [...rows], acc [...rows, head_dim])``, the
    carry of one pass over all the keys (to rounding). A part that saw no key (max ``-inf``,
    sum 0) adds nothing; rows no part saw keep max ``-inf`` and sum 0."""
    new_max = jnp.max(row_max, axis=0)
    rescale = jnp.exp(row_max - _finite_shift(new_max))
    return new_max, jnp.sum(rescale * row_sum, axis=0), jnp.sum(rescale[..., None] * acc, axis=0)


def _finite_shift(row_max):
    """What exponents are taken relative to: the running max, or 0 for rows with none yet
    (``-inf - -inf`` would be NaN)."""
    return jnp.where(row_max == -jnp.inf, 0.0, row_max)


def online_softmax_lse(row_max, row_sum):
    """The log-sum-exp of each row from a finished carry's ``row_max`` and ``row_sum`` (any
    matching shapes): ``+inf`` for rows with no visible key, so that a backward's
    ``exp(logits - lse)`` is 0 there."""
    empty = row_sum == 0.0
    return jnp.where(empty, jnp.inf, row_max + jnp.log(jnp.where(empty, 1.0, row_sum)))


def per_row(ref):
    """A scratch column's per-row values ``[rows]``, kept broadcast over its 128 lanes."""
    return ref[...][:, 0]


def set_per_row(ref, values) -> None:
    """Stores ``values [rows]`` into a scratch column ``[rows, 128]``, broadcast over its lanes."""
    ref[...] = jnp.broadcast_to(values[:, None], ref.shape)

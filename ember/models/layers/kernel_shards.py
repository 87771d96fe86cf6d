"""Sequence-mixer kernels run on each device's shard of the batch and head groups.

A Pallas kernel is a custom call XLA's partitioner cannot split: under ``jit`` on a mesh its
operands were gathered whole onto every device, and every device computed the whole batch.
:func:`per_head_group_shard` runs the op through ``ember.core.sharding.per_shard`` instead, on
the batch rows and head groups each device holds:

    out = per_head_group_shard(op, (q, k, v, segment_ids), ("bsh.", "bsh.", "bsh.", "bs"),
                               out_layout="bsh.", groups=kv_heads, kernel=True)

A layout names each dimension of an argument: ``b`` batch, ``s`` sequence (kept whole: the
ops mix along it), ``h`` heads, ``.`` anything else. Heads are split into ``groups`` contiguous
groups (GQA's key heads, SSD's B/C groups) whose dimension takes the ``kv_heads`` sharding rule,
so every argument splits its heads the same way, and a mesh axis that does not divide the groups
is dropped for all of them (those devices compute the same groups) rather than giving a query
head the wrong key head.

The quantized matmul (``ember.models.quantization.stored.quantized_dot``) runs per shard
through ``per_shard`` too, on the batch rows and the weight columns (:func:`unshared_with`)
each device holds, and on the contraction's split of a row-parallel weight, summed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import flax.linen as nn
import jax

from ember.core.sharding import per_shard
from ember.kernels_pallas.dispatch import resolve_impl

_LOGICAL = {"b": "batch", "h": "kv_heads"}


def runs_per_shard(impl: str, *, op: str, kernel_backends: Sequence[str]) -> bool:
    """Whether ``op`` with ``impl`` runs a kernel :func:`per_head_group_shard` should map: a
    compiled one or the Pallas interpreter's. Not XLA's path, which XLA partitions itself, nor
    JAX's TPU interpreter, which simulates every device of the mesh at once (a flash attention of
    two rows per device on 8 host devices ran past 10 minutes, on 2 in seconds)."""
    return resolve_impl(impl, op=op, kernel_backends=tuple(kernel_backends)) in ("pallas", "interpret")


def unshared_with(taken: Sequence[str | None], axes: Sequence[str | None]) -> tuple[str | None, ...]:
    """``axes`` with None for each logical axis whose rule shares a mesh axis with one of
    ``taken``. A kernel's output split by batch rows in one dimension and by ``axes`` in others
    must not use a mesh axis twice, and ``per_shard`` specifies each argument on its own: a
    weight's columns named ``embed`` (FSDP's axis, which batch takes too) stay whole."""
    rules = dict(nn.get_logical_axis_rules())
    busy = {mesh_axis for name in taken if name is not None for mesh_axis in rules.get(name, ())}
    return tuple(None if axis is None or busy & set(rules.get(axis, ())) else axis for axis in axes)


def per_head_group_shard(
    op: Callable[..., jax.Array],
    args: Sequence[Any],
    layouts: Sequence[str],
    *,
    out_layout: str,
    groups: int,
    kernel: bool,
) -> jax.Array:
    """``op(*args)``, run per shard of the current mesh when ``kernel`` (the op runs a Pallas
    kernel; XLA's own path is partitioned by XLA, which also splits heads that do not divide into
    ``groups`` evenly over the mesh). Each argument is an array, a tuple of arrays (one layout
    for all) or None; the result is one array with ``out_layout``."""
    if not kernel:
        return op(*args)

    def mapped(*grouped):
        local_groups = next(
            jax.tree.leaves(arg)[0].shape[layout.index("h")] for arg, layout in zip(grouped, layouts) if "h" in layout
        )
        merged = [jax.tree.map(partial(_merge_heads, layout=layout), arg) for arg, layout in zip(grouped, layouts)]
        return _split_heads(op(*merged), out_layout, local_groups)

    split = [partial(_split_heads, layout=layout, groups=groups) for layout in layouts]
    grouped = [jax.tree.map(split_one, arg) for split_one, arg in zip(split, args)]
    out = per_shard(mapped, [_axes(layout) for layout in layouts], _axes(out_layout))(*grouped)
    return _merge_heads(out, out_layout)


def _split_heads(x: jax.Array, layout: str, groups: int) -> jax.Array:
    if "h" not in layout:
        return x
    dim = layout.index("h")
    return x.reshape(*x.shape[:dim], groups, x.shape[dim] // groups, *x.shape[dim + 1 :])


def _merge_heads(x: jax.Array, layout: str) -> jax.Array:
    if "h" not in layout:
        return x
    dim = layout.index("h")
    return x.reshape(*x.shape[:dim], x.shape[dim] * x.shape[dim + 1], *x.shape[dim + 2 :])


def _axes(layout: str) -> tuple[str | None, ...]:
    """Logical axes of an argument with its heads split: ``(groups, heads per group)``."""
    axes: list[str | None] = []
    for letter in layout:
        axes.append(_LOGICAL.get(letter))
        if letter == "h":
            axes.append(None)
    return tuple(axes)


__all__ = ["per_head_group_shard", "runs_per_shard", "unshared_with"]

"""Dropless expert dispatch: token-slots sorted by expert, grouped matmuls, unsorted, combined.

:func:`routed_expert_mlp` is the single-device dispatch; :func:`routed_expert_mlp_per_shard` runs
it on each device's tokens under a mesh whose tokens are not split over the ``expert`` axis (none,
or serving's replicated tokens over experts split there); ``expert_parallel.py`` has a twin with
the same signature that exchanges token-slots over the ``expert`` mesh axis that splits them.
:func:`apply_capacity` turns dropless routing into capacity-factor routing by marking the slots
past each expert's capacity as dropped.

Conventions: a *slot* is one (token, choice) pair, ``tokens * top_k`` of them, numbered
token-major. Expert ids outside ``[0, num_experts)`` (dropped slots, MoE++'s zero-computation
experts) contribute nothing and cost no matmul rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ember.core.sharding import per_shard
from ember.kernels_pallas import grouped_matmul
from ember.models.layers.kernel_shards import unshared_with
from ember.models.layers.mlp import ACTIVATIONS


@jax.custom_vjp
def permute_rows(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """``x[order]`` for a permutation ``order`` whose inverse is ``inverse``.

    The VJP is ``g[inverse]``, another gather: autodiff of a gather would scatter-add, which
    is slow on accelerators and needless for a permutation.
    """
    return jnp.take(x, order, axis=0)


def _permute_fwd(x, order, inverse):
    return jnp.take(x, order, axis=0), (order, inverse)


def _permute_bwd(residuals, g):
    _, inverse = residuals
    return jnp.take(g, inverse, axis=0), None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def sort_slots(expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(order, inverse, group_sizes [num_experts])`` of the flattened slots sorted by expert
    (stable: within an expert, slot order); out-of-range ids sort last, outside every group."""
    flat = expert_ids.reshape(-1)
    key = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = jnp.argsort(key, stable=True)
    inverse = jnp.argsort(order)
    # Group boundaries by binary search in the sorted keys (a bincount would scatter-add).
    bounds = jnp.searchsorted(jnp.take(key, order), jnp.arange(num_experts + 1), side="left")
    return order, inverse, jnp.diff(bounds).astype(jnp.int32)


def dispatched_rows(x: jax.Array, expert_ids: jax.Array, num_experts: int):
    """``(rows [tokens * top_k, embed], order, inverse, group_sizes [num_experts])``: the row of
    ``x [tokens, embed]`` of each token-slot of ``expert_ids [tokens, top_k]``, sorted by expert
    (:func:`sort_slots`; slots of out-of-range ids last, in no group)."""
    tokens, top_k = expert_ids.shape
    order, inverse, group_sizes = sort_slots(expert_ids, num_experts)
    # Slot s = t * top_k + k holds token t; broadcasting (not gathering) keeps its VJP a sum.
    slots = jnp.broadcast_to(x[:, None, :], (tokens, top_k, x.shape[-1])).reshape(tokens * top_k, -1)
    return permute_rows(slots, order, inverse), order, inverse, group_sizes


def grouped_expert_hidden(rows, gate, up, group_sizes, *, activation: str, impl: str) -> jax.Array:
    """The experts' hidden activations ``[m, f]`` on ``rows [m, embed]`` grouped contiguously by
    expert (``group_sizes [E]``): ``act(rows @ gate) * (rows @ up)`` per group (``act(rows @ up)``
    without a gate), through ``grouped_matmul``."""
    hidden = grouped_matmul(rows, up, group_sizes, impl=impl)
    if gate is not None:
        return ACTIVATIONS[activation](grouped_matmul(rows, gate, group_sizes, impl=impl)) * hidden
    return ACTIVATIONS[activation](hidden)


def grouped_expert_mlp(rows, gate, up, down, group_sizes, *, activation: str, impl: str) -> jax.Array:
    """The expert MLP on ``rows [m, embed]`` grouped contiguously by expert (``group_sizes``
    ``[E]``): ``down(act(rows @ gate) * (rows @ up))`` per group, through ``grouped_matmul``."""
    hidden = grouped_expert_hidden(rows, gate, up, group_sizes, activation=activation, impl=impl)
    return grouped_matmul(hidden, down, group_sizes, impl=impl)


def grouped_grams(rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """f32 ``[E, k, k]``: ``rows_e^T rows_e`` of each contiguous group of ``rows [m, k]`` (rows
    past ``sum(group_sizes)`` belong to none). One ``ragged_dot_general`` with the rows as its
    ragged contracted dimension (the transposed grouped matmul): XLA's ragged dot on GPU and
    TPU; elsewhere JAX expands it with row masks, an ``[E, m, k]`` temporary per operand."""
    rows = rows.astype(jnp.float32)
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
    )
    return jax.lax.ragged_dot_general(rows, rows, group_sizes, numbers, precision=jax.lax.Precision.HIGHEST)


def expert_input_grams(x, expert_ids, gate, up, *, activation: str, impl: str) -> tuple[jax.Array, jax.Array]:
    """Each expert's GPTQ statistics: the Gram matrices of the inputs its weights multiply.

    Args:
      x: ``[tokens, embed]``.
      expert_ids: int32 ``[tokens, top_k]`` as :func:`routed_expert_mlp` takes them: ids outside
        ``[0, E)`` (capacity drops, padding, zero-computation experts) are no expert's input.
      gate, up: ``[E, embed, f]`` (``gate`` None for ungated activations).

    Returns:
      f32 ``(inputs [E, embed, embed], hidden [E, f, f])``: ``sum x_t x_t^T`` over the token-slots
      dispatched to each expert (its gate's and up's input), and ``sum h h^T`` of their hidden
      activations (its down's input). Unweighted by the router's combine weights, which scale the
      expert's output after ``down``: GPTQ's objective is the error of each matrix's own product.
      An expert no slot reached gets zero matrices.
    """
    rows, _, _, group_sizes = dispatched_rows(x, expert_ids, up.shape[0])
    hidden = grouped_expert_hidden(rows, gate, up, group_sizes, activation=activation, impl=impl)
    return grouped_grams(rows, group_sizes), grouped_grams(hidden, group_sizes)


def routed_expert_mlp(
    x: jax.Array,
    expert_ids: jax.Array,
    combine_weights: jax.Array,
    gate: jax.Array | None,
    up: jax.Array,
    down: jax.Array,
    *,
    activation: str,
    impl: str,
    out_dtype=None,
) -> jax.Array:
    """Each token's chosen experts' MLP outputs, weighted and summed.

    Args:
      x: ``[tokens, embed]``.
      expert_ids: int32 ``[tokens, top_k]``; ids outside ``[0, E)`` are skipped.
      combine_weights: f32 ``[tokens, top_k]``, the weight of each choice's output.
      gate: ``[E, embed, f]`` for gated activations (``swiglu``, ``geglu``), else None.
      up: ``[E, embed, f]``. down: ``[E, f, embed]``.
      activation: an ``ember.models.layers.mlp`` kind.
      impl: ``grouped_matmul``'s implementation.
      out_dtype: the result's dtype (None: ``x``'s).

    Returns:
      ``[tokens, embed]``: ``sum_k w[t, k] * mlp_{e[t, k]}(x[t])``.
    """
    tokens, top_k = expert_ids.shape
    num_experts = up.shape[0]
    rows, order, inverse, group_sizes = dispatched_rows(x, expert_ids, num_experts)
    out = permute_rows(
        grouped_expert_mlp(rows, gate, up, down, group_sizes, activation=activation, impl=impl), inverse, order
    )
    out = out.reshape(tokens, top_k, -1).astype(jnp.float32)
    routed = ((expert_ids >= 0) & (expert_ids < num_experts))[..., None]
    # Rows past the groups are unspecified in grouped_matmul's contract: select, never multiply.
    out = jnp.where(routed, out * combine_weights[..., None].astype(jnp.float32), 0.0)
    return jnp.sum(out, axis=1).astype(out_dtype or x.dtype)


def routed_expert_mlp_per_shard(x, expert_ids, combine_weights, gate, up, down, *, activation: str, impl: str):
    """:func:`routed_expert_mlp` on each device's tokens and experts under the current mesh (``per_shard``).

    The dispatch sorts slots by expert, a global permutation XLA cannot partition: on a mesh
    every device built the whole batch's sorted slots (all-reduced forward and backward) and ran
    the expert matmuls on all of them, with XLA's ragged_dot as with the Pallas kernel. Given the
    expert ids (capacity drops already decided on the whole batch) each token's output is its
    own, so each device dispatches its batch rows alone: the experts' hidden columns split as
    the ``mlp`` axis, the down projection's partial products summed (in f32), as XLA splits a
    dense MLP. The experts' ``embed`` axis (FSDP's) is whole on every device, as the rows' is,
    gathered as XLA gathers an FSDP weight; so is an axis whose mesh axes the batch takes too.

    Experts split over a mesh axis the batch does not take (serving's ``expert`` axis: one
    step's token budget is replicated, so tokens need no exchange) are summed like the hidden
    columns: each device runs its own experts on the slots routed to them (its experts' global
    numbers shift the ids; every other slot is out of its range and costs nothing) and the
    partial outputs of every expert shard and column shard are summed in one ``psum``.
    """
    rows = ("batch", None)
    columns = unshared_with(("batch",), ("expert", None, "mlp"))
    down_axes = unshared_with(("batch",), ("expert", "mlp", None))
    experts, hidden = columns[0], columns[2]

    def local_experts(x, expert_ids, combine_weights, gate, up, down, numbers):
        # numbers [local experts]: the global numbers of this shard's experts, in order.
        return routed_expert_mlp(
            x,
            expert_ids - numbers[0],
            combine_weights,
            gate,
            up,
            down,
            activation=activation,
            impl=impl,
            out_dtype=jnp.float32,
        )

    in_axes = [rows, rows, rows, columns, columns, down_axes, (experts,)]
    numbers = jnp.arange(up.shape[0], dtype=expert_ids.dtype)
    summed = per_shard(local_experts, in_axes, rows, sum_over=(experts, hidden))
    return summed(x, expert_ids, combine_weights, gate, up, down, numbers).astype(x.dtype)


def slot_capacity(capacity_factor: float, tokens: int | jax.Array, top_k: int, num_experts: int) -> int | jax.Array:
    """Token-slots one expert takes: ``ceil(capacity_factor * tokens * top_k / num_experts)``, at
    least 1. ``tokens`` traced (a count of real tokens) gives a traced int32 capacity."""
    if isinstance(tokens, int):
        return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))
    slots = jnp.ceil(capacity_factor * tokens.astype(jnp.float32) * top_k / num_experts)
    return jnp.maximum(1, slots.astype(jnp.int32))


def apply_capacity(expert_ids: jax.Array, num_experts: int, capacity: int | jax.Array) -> tuple[jax.Array, jax.Array]:
    """Capacity-factor routing: each expert in ``[0, num_experts)`` keeps its first ``capacity``
    slots (an int, or a traced int32 scalar), first choices before second ones (``k``-major),
    each in token order.

    Returns:
      ``(expert_ids with dropped slots set to num_experts, dropped bool [tokens, top_k])``. Ids
      outside ``[0, num_experts)`` (zero-computation experts) are never dropped.
    """
    by_priority = expert_ids.T  # [top_k, tokens]: row-major order is the priority order
    order, inverse, group_sizes = sort_slots(by_priority, num_experts)
    starts = jnp.cumsum(group_sizes) - group_sizes
    sorted_ids = jnp.take(by_priority.reshape(-1), order)
    in_range = (sorted_ids >= 0) & (sorted_ids < num_experts)
    rank = jnp.arange(sorted_ids.shape[0]) - jnp.take(starts, jnp.clip(sorted_ids, 0, num_experts - 1))
    dropped = jnp.take(in_range & (rank >= capacity), inverse).reshape(by_priority.shape).T
    return jnp.where(dropped, num_experts, expert_ids), dropped


__all__ = [
    "apply_capacity",
    "dispatched_rows",
    "expert_input_grams",
    "grouped_expert_hidden",
    "grouped_grams",
    "permute_rows",
    "routed_expert_mlp",
    "routed_expert_mlp_per_shard",
    "slot_capacity",
    "sort_slots",
]

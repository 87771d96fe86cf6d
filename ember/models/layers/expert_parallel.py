"""Expert parallelism: routed experts sharded over the ``expert`` mesh axis, tokens exchanged
with ``jax.lax.all_to_all`` inside ``shard_map``.

:func:`expert_parallel_routed_mlp` has the signature of the MoE layer's local dispatch
(``routed_expert_mlp``) and the same result; it reads the mesh and logical rules that
``ember.core.sharding.use_sharding`` made current. Per device, with ``D`` expert-parallel
ranks, ``E_l = E / D`` local experts and ``S = tokens_local * top_k`` token-slots:

1. sort the slots by expert (so the slots bound for each rank are one contiguous run);
2. exchange each rank's per-expert counts, then its rows, with ``all_to_all`` over
   ``expert``; a send buffer holds ``S`` rows per destination, so even every slot of a
   device going to one rank fits: **dropless, no capacity bound** (memory ``D * S`` rows);
3. regroup the received rows by local expert and run the expert MLP with ``grouped_matmul``
   on the local experts (local group sizes);
4. send the results back with the inverse ``all_to_all``, unsort, weight and sum over top-k.

Other mesh axes combine: tokens are split over every axis the ``batch`` rule names (data,
fsdp, expert); expert weights are gathered over fsdp where the rules shard ``embed`` and
split over ``tensor`` on their hidden dimension where the ``mlp`` rule names it (the partial
down-projections are summed with ``psum``). Without a current mesh it runs the same
algorithm on one device with no exchange.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ember.core.errors import ConfigError, EmberError
from ember.core.sharding import DEFAULT_RULES, splitting_axes
from ember.models.layers.mlp import ACTIVATIONS, GATED
from ember.models.layers.moe_dispatch import grouped_expert_mlp

EXPERT_AXIS = "expert"
"""The mesh axis experts are sharded over (the ``expert`` logical axis's rule)."""


def expert_parallel_ranks() -> int:
    """The ranks that exchange tokens over the current mesh's ``expert`` axis: its size where the
    current logical rules split the batch over it (the default rules, as training runs), else 1
    (no mesh, no such axis, or rules whose batch is whole over it, as serving's replicated token
    budget: ``moe_dispatch.routed_expert_mlp_per_shard`` then runs each device's experts on the
    tokens every device holds, and sums)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return 1
    rules = nn.get_logical_axis_rules() or DEFAULT_RULES
    return mesh.shape[EXPERT_AXIS] if EXPERT_AXIS in dict(rules).get("batch", ()) else 1


def expert_parallel_routed_mlp(
    x: jax.Array,
    expert_ids: jax.Array,
    combine_weights: jax.Array,
    gate: jax.Array | None,
    up: jax.Array,
    down: jax.Array,
    *,
    activation: str,
    impl: str = "auto",
) -> jax.Array:
    """The routed experts' output ``[tokens, embed]``, experts sharded over the mesh.

    Args:
      x: ``[tokens, embed]`` token activations.
      expert_ids: int32 ``[tokens, top_k]`` the experts each token is routed to; ids outside
        ``[0, E)`` (dropped slots, MoE++ zero-computation experts, padding) cost nothing and
        contribute nothing, as in the local dispatch.
      combine_weights: f32 ``[tokens, top_k]`` the weight of each routed expert's output.
      gate: ``[E, embed, f]`` (gated ``activation`` kinds) or ``None``.
      up: ``[E, embed, f]``; down: ``[E, f, embed]``.
      activation: an MLP kind of ``ember.models.layers.mlp`` (``swiglu``, ``gelu``, ...).
      impl: the ``grouped_matmul`` implementation.

    Raises:
      ConfigError: the expert count does not divide over the ``expert`` mesh axis (keyed
        ``mesh.expert``), or the tokens do not divide over the token-parallel axes (keyed
        ``train.batch_size``, the key the trainer's batch errors carry).
      EmberError: an unknown ``activation``, or gate weights that do not match it.
    """
    if activation not in ACTIVATIONS:
        raise EmberError(f"activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
    if (activation in GATED) != (gate is not None):
        raise EmberError(f"activation {activation!r} {'needs' if activation in GATED else 'takes no'} gate weights")
    mesh = jax.sharding.get_abstract_mesh()
    body = functools.partial(_dispatch_on_device, activation=activation, impl=impl)
    if mesh is None or mesh.empty:
        return body(x, expert_ids, combine_weights, gate, up, down, expert_axis=None, tensor_axes=())
    token_axes, tensor_axes = _mesh_axes(mesh, x.shape[0], up.shape[0], up.shape[2])
    ranks = mesh.shape[EXPERT_AXIS] if EXPERT_AXIS in mesh.axis_names else 1
    tokens = PartitionSpec(token_axes or None)
    hidden = tensor_axes or None
    in_weights = PartitionSpec(EXPERT_AXIS if ranks > 1 else None, None, hidden)
    down_spec = PartitionSpec(EXPERT_AXIS if ranks > 1 else None, hidden, None)  # embed whole (gathered over fsdp)
    mapped = jax.shard_map(
        functools.partial(body, expert_axis=EXPERT_AXIS if ranks > 1 else None, tensor_axes=tensor_axes),
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, None if gate is None else in_weights, in_weights, down_spec),
        out_specs=tokens,
        check_vma=False,
    )
    return mapped(x, expert_ids, combine_weights, gate, up, down)


def _mesh_axes(mesh, num_tokens: int, num_experts: int, hidden: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(mesh axes splitting the tokens, mesh axes splitting the experts' hidden dim)`` from
    the current logical rules (``batch`` and ``mlp``); raises ``ConfigError`` when they do not divide."""
    rules = nn.get_logical_axis_rules() or DEFAULT_RULES
    ranks = mesh.shape[EXPERT_AXIS] if EXPERT_AXIS in mesh.axis_names else 1
    if num_experts % ranks:
        raise ConfigError(
            f"{num_experts} experts do not divide over the {ranks} ranks of the {EXPERT_AXIS!r} mesh axis; "
            "choose mesh.expert dividing the expert count",
            key="mesh.expert",
        )
    token_axes = splitting_axes(mesh, "batch", rules)
    if ranks > 1 and EXPERT_AXIS not in token_axes:
        token_axes += (EXPERT_AXIS,)
    token_ranks = math.prod(mesh.shape.get(axis, 1) for axis in token_axes)
    if num_tokens % token_ranks:
        axes = " x ".join(f"mesh.{axis}={mesh.shape[axis]}" for axis in token_axes)
        raise ConfigError(
            f"the {num_tokens} tokens of a batch (rows x tokens per row) do not divide over the {token_ranks} "
            f"token-parallel ranks ({axes}) that expert parallelism splits them over; the tokens of each (micro-)"
            f"batch must be a multiple of {token_ranks}: a train.batch_size / train.grad_accum that is a multiple "
            f"of {token_ranks} splits every row",
            key="train.batch_size",
        )
    tensor_axes = tuple(
        axis for axis in splitting_axes(mesh, "mlp", rules) if axis not in token_axes and axis != EXPERT_AXIS
    )
    if hidden % math.prod(mesh.shape.get(axis, 1) for axis in tensor_axes):
        tensor_axes = ()
    return token_axes, tensor_axes


def _dispatch_on_device(x, expert_ids, combine_weights, gate, up, down, *, activation, impl, expert_axis, tensor_axes):
    """One device's share: its tokens ``x [t, embed]`` through the experts of all ranks,
    its local experts ``up [E_l, embed, f_local]`` applied to the rows other ranks send."""
    tokens, top_k = expert_ids.shape
    local_experts = up.shape[0]
    ranks = jax.lax.axis_size(expert_axis) if expert_axis else 1
    slots = tokens * top_k
    # 1. slots sorted by expert: rows bound for rank r are one run starting at starts[r].
    flat_ids = expert_ids.reshape(slots).astype(jnp.int32)
    order = jnp.argsort(flat_ids, stable=True)
    sorted_rows = x[order // top_k]
    counts = jnp.bincount(flat_ids, length=local_experts * ranks).astype(jnp.int32).reshape(ranks, local_experts)
    rank_counts = counts.sum(axis=1)
    starts = jnp.cumsum(rank_counts) - rank_counts
    # 2. a block of ``slots`` rows per destination rank (the worst case: all slots to one rank).
    index = jnp.arange(slots)
    send_valid = index[None, :] < rank_counts[:, None]  # [ranks, slots]
    send = jnp.where(send_valid[..., None], sorted_rows[jnp.minimum(starts[:, None] + index, slots - 1)], 0)
    if expert_axis:
        counts_in = jax.lax.all_to_all(counts, expert_axis, 0, 0, tiled=True)  # [source ranks, E_l]
        received = jax.lax.all_to_all(send, expert_axis, 0, 0, tiled=True)  # [source ranks, slots, embed]
    else:
        counts_in, received = counts, send
    # 3. regroup every source's (expert-sorted) block by local expert, invalid rows last.
    local_ids = _local_expert_of_rows(counts_in, slots)  # [source ranks * slots], E_l = padding
    regroup = jnp.argsort(local_ids, stable=True)
    rows = received.reshape(ranks * slots, -1)[regroup]
    group_sizes = counts_in.sum(axis=0)
    out = grouped_expert_mlp(rows, gate, up, down, group_sizes, activation=activation, impl=impl)
    if tensor_axes:
        out = jax.lax.psum(out, tensor_axes)
    out = jnp.zeros_like(out).at[regroup].set(out).reshape(ranks, slots, -1)
    # 4. results back to the ranks that sent the rows, then slot order, then top-k sum.
    back = jax.lax.all_to_all(out, expert_axis, 0, 0, tiled=True) if expert_axis else out
    rank_of_sorted = jnp.searchsorted(jnp.cumsum(rank_counts), index, side="right")
    rank_of_sorted = jnp.minimum(rank_of_sorted, ranks - 1)
    sorted_out = back[rank_of_sorted, index - starts[rank_of_sorted]]
    slot_out = jnp.zeros_like(sorted_out).at[order].set(sorted_out).reshape(tokens, top_k, -1)
    in_range = (flat_ids < local_experts * ranks).reshape(tokens, top_k, 1)
    # An out-of-range slot reads a row past the groups, unspecified in grouped_matmul's
    # contract (NaN * 0 is NaN): select, never multiply, as the local dispatch does.
    weighted = slot_out.astype(jnp.float32) * combine_weights.astype(jnp.float32)[..., None]
    return jnp.sum(jnp.where(in_range, weighted, 0.0), axis=1).astype(x.dtype)


def _local_expert_of_rows(counts_in: jax.Array, slots: int) -> jax.Array:
    """``[sources * slots]`` the local expert of every received row (``E_l`` for padding):
    a source's block holds ``counts_in[s, 0]`` rows of expert 0, then expert 1's, ..."""
    local_experts = counts_in.shape[1]
    ends = jnp.cumsum(counts_in, axis=1)  # [sources, E_l]
    index = jnp.arange(slots)
    ids = jax.vmap(lambda e: jnp.searchsorted(e, index, side="right"))(ends)  # [sources, slots]
    return jnp.minimum(ids, local_experts).reshape(-1)


__all__ = ["EXPERT_AXIS", "expert_parallel_ranks", "expert_parallel_routed_mlp"]

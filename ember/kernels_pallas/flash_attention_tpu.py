"""TPU (Mosaic TPU) kernels of :func:`ember.kernels_pallas.flash_attention.flash_attention`.

Three ``pallas_call`` s tied by ``custom_vjp``, their bodies in
:mod:`ember.kernels_pallas.flash_attention_tpu_kernels`:

- forward, grid ``(batch, heads, q_blocks, kv_slots)``: step ``t`` of query block ``i``
  folds in key block ``kv_index[i, t]``; saves the log-sum-exp for the backward;
- dq, the same grid, accumulating ``ds @ k``;
- dk/dv, grid ``(batch, kv_heads, kv_blocks, group, q_slots)``: key block ``j`` of key
  head ``g_kv`` gathers ``p.T @ dO`` and ``ds.T @ q`` from the live query blocks
  ``q_index[j, t]`` of each of its ``group`` query heads (query head ``h`` reads key
  head ``h // group``), so dk/dv accumulate per key head.

Block sparsity: the live blocks of the mask (:func:`~ember.kernels_pallas.block_mask.live_block_grid`,
as :class:`~ember.kernels_pallas.block_mask.LiveBlocks` lists) reach the TPU as
scalar-prefetched SMEM tables ``index [1 or batch, rows, slots]`` and ``count [1 or
batch, rows]``. The grid's last axis runs over the slots of the longest list; the key (or
query) ``BlockSpec`` index maps read the table, and slots past a row's count repeat its
last live block, so the pipeline fetches nothing new and the body computes nothing. Dead
blocks are neither copied to VMEM nor multiplied (a row with no live block at all still
copies one block, which it ignores). With segment positions (per-document global tokens of
:class:`~ember.kernels_pallas.block_mask.LocalGlobalMask`) the tables are built per batch
row at run time from :func:`~ember.kernels_pallas.block_mask.document_live_grid`, with as
many slots as the static bound :func:`~ember.kernels_pallas.block_mask.document_live_bound`
can need.

Layout for the TPU: inputs go to ``[batch, heads, seq, head_dim]`` (one head's tile is then
a ``[block, head_dim]`` slice whose last two dims tile into (8, 128)), ``head_dim`` is
zero-padded to a multiple of 128 lanes and the sequences to block multiples (masked
inside, sliced off after). Block sizes: ``FlashBlockSizes`` fitted to the sequences, then
raised to at least 128, because the keys run along the lanes of the forward's and dq's
scores tile and the queries along those of dk/dv's transposed one; an
:class:`~ember.kernels_pallas.block_mask.ExplicitBlockMask` therefore needs cells that are
multiples of these sizes. Per-query values and segment ids/positions travel as
lane-broadcast columns ``[.., len, 128]`` or sublane-broadcast rows ``[.., 8, len]``, as
each grid needs them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ember.kernels_pallas.block_mask import document_live_grid, traced_live_lists
from ember.kernels_pallas.flash_attention_tiles import attention_vjp
from ember.kernels_pallas.flash_attention_tpu_kernels import (
    NUM_LANES,
    NUM_SUBLANES,
    TpuKernelConfig,
    dkv_kernel,
    dq_kernel,
    forward_kernel,
)
from ember.kernels_pallas.sequence_padding import pad_axis_to_multiple


class BlockTables(NamedTuple):
    """The live-block lists as int32 tables ``[1 or batch, rows, slots]`` (indices) and
    ``[1 or batch, rows]`` (counts): per query block its live key blocks (forward, dq), per
    key block its live query blocks (dk/dv). Padding slots repeat the last live index."""

    kv_index: jax.Array
    kv_count: jax.Array
    q_index: jax.Array
    q_count: jax.Array


def block_tables(config: TpuKernelConfig, rows) -> BlockTables:
    """The tables of a call: static from the mask, or per batch row from the segment
    positions (``rows`` as in :func:`flash_attention_tpu`)."""
    live = config.live
    if not config.problem.has_segment_positions:
        lists = (live.kv_indices, live.kv_counts, live.q_indices, live.q_counts)
        return BlockTables(*(jnp.asarray(table)[None] for table in lists))
    segments, positions = rows
    grid = document_live_grid(config.problem.mask, config.block_q, config.block_kv, *positions, segments)
    kv_lists = traced_live_lists(grid, live.kv_indices.shape[1])
    q_lists = traced_live_lists(jnp.swapaxes(grid, 1, 2), live.q_indices.shape[1])
    return BlockTables(*kv_lists, *q_lists)


def heads_major(x: jax.Array, block: int) -> jax.Array:
    """``[batch, seq, heads, head_dim]`` -> ``[batch, heads, padded seq, padded head_dim]``."""
    x = pad_axis_to_multiple(pad_axis_to_multiple(x, 1, block), 3, NUM_LANES)
    return jnp.swapaxes(x, 1, 2)


def _lane_columns(x: jax.Array) -> jax.Array:
    """``[..., len]`` -> ``[..., len, 128]``, each value broadcast over the lanes: a tile
    of it is a column, for a grid whose tile runs ``len`` along the sublanes."""
    return jnp.broadcast_to(x[..., None], (*x.shape, NUM_LANES))


def _sublane_rows(x: jax.Array) -> jax.Array:
    """``[..., len]`` -> ``[..., 8, len]``, broadcast over the sublanes: a tile of it is a
    row, for a grid whose tile runs ``len`` along the lanes."""
    return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], NUM_SUBLANES, x.shape[-1]))


def _row_arrays(rows, config: TpuKernelConfig, *, queries_on_lanes: bool) -> list[jax.Array]:
    """The present segment ids/positions ``(query [batch, q_len], key [batch, kv_len])``,
    padded to blocks, in the order the bodies read them: with keys on the lanes (forward,
    dq) query columns and key rows; with queries on the lanes (dk/dv) the other way round."""
    q_layout, kv_layout = (_sublane_rows, _lane_columns) if queries_on_lanes else (_lane_columns, _sublane_rows)
    arrays = []
    for pair in rows:
        if pair is not None:
            arrays.append(q_layout(pad_axis_to_multiple(pair[0], 1, config.block_q)))
            arrays.append(kv_layout(pad_axis_to_multiple(pair[1], 1, config.block_kv)))
    return arrays


def _by_query_block_specs(config: TpuKernelConfig, tables: BlockTables, num_rows: int):
    """Block specs of the (batch, head, query block, slot) grid: ``(query tile, key tile,
    query-side row-array tile, key-side row-array tile)``."""
    bq, bk, dim, group = config.block_q, config.block_kv, config.head_dim, config.problem.group
    per_batch = tables.kv_index.shape[0] > 1

    def kv_block(b, i, t, kv_index):
        return kv_index[b if per_batch else 0, i, t]

    q_tile = pl.BlockSpec((None, None, bq, dim), lambda b, h, i, t, *_: (b, h, i, 0))
    kv_tile = pl.BlockSpec(
        (None, None, bk, dim), lambda b, h, i, t, kv_index, _: (b, lax.div(h, group), kv_block(b, i, t, kv_index), 0)
    )
    q_side = pl.BlockSpec((None, bq, NUM_LANES), lambda b, h, i, t, *_: (b, i, 0))
    kv_side = pl.BlockSpec(
        (None, NUM_SUBLANES, bk), lambda b, h, i, t, kv_index, _: (b, 0, kv_block(b, i, t, kv_index))
    )
    return q_tile, kv_tile, [q_side, kv_side] * (num_rows // 2)


def tpu_forward(q, k, v, rows, config: TpuKernelConfig, count_visits: bool = False):
    """The forward kernel on heads-major, padded ``q [batch, heads, q_len', dim']``, ``k,
    v [batch, kv_heads, kv_len', dim']`` (``rows`` unpadded, as in :func:`flash_attention_tpu`).

    Returns ``(out like q, lse [batch, heads, q_len'] f32)`` and, with ``count_visits``,
    also int32 ``[batch, heads, q_blocks]``: how many key blocks each query block computed.
    """
    p = config.problem
    tables = block_tables(config, rows)
    row_args = _row_arrays(rows, config, queries_on_lanes=False)
    q_tile, kv_tile, row_specs = _by_query_block_specs(config, tables, len(row_args))
    num_q_blocks, slots = config.padded_q_len // config.block_q, tables.kv_index.shape[-1]
    lse_tile = pl.BlockSpec((None, None, config.block_q, NUM_LANES), lambda b, h, i, t, *_: (b, h, i, 0))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((*q.shape[:3], NUM_LANES), jnp.float32)]
    out_specs = [q_tile, lse_tile]
    if count_visits:
        out_shape.append(jax.ShapeDtypeStruct((*q.shape[:2], num_q_blocks, NUM_SUBLANES, NUM_LANES), jnp.int32))
        out_specs.append(
            pl.BlockSpec((None, None, None, NUM_SUBLANES, NUM_LANES), lambda b, h, i, t, *_: (b, h, i, 0, 0))
        )
    outs = pl.pallas_call(
        functools.partial(forward_kernel, config=config),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(p.batch, p.heads, num_q_blocks, slots),
            in_specs=[q_tile, kv_tile, kv_tile, *row_specs],
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((config.block_q, NUM_LANES), jnp.float32),  # running row max
                pltpu.VMEM((config.block_q, NUM_LANES), jnp.float32),  # running row sum
                pltpu.VMEM((config.block_q, config.head_dim), jnp.float32),  # output accumulator
            ],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=config.cost(2, q.dtype.itemsize * (2 * q.size + 2 * k.size * p.group)),
        interpret=config.interpret,
        name="flash_attention_tpu_forward",
    )(tables.kv_index, tables.kv_count, q, k, v, *row_args)
    out, lse = outs[0], outs[1][..., 0]
    return (out, lse, outs[2][..., 0, 0]) if count_visits else (out, lse)


def _dq_call(q, k, v, rows, d_out, lse, delta, tables: BlockTables, config: TpuKernelConfig):
    """dq on the (batch, head, query block, slot) grid; ``lse``, ``delta`` ``[batch, heads, q_len']``."""
    p, bq = config.problem, config.block_q
    row_args = _row_arrays(rows, config, queries_on_lanes=False)
    q_tile, kv_tile, row_specs = _by_query_block_specs(config, tables, len(row_args))
    per_query = pl.BlockSpec((None, None, bq, NUM_LANES), lambda b, h, i, t, *_: (b, h, i, 0))
    return pl.pallas_call(
        functools.partial(dq_kernel, config=config),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(p.batch, p.heads, config.padded_q_len // bq, tables.kv_index.shape[-1]),
            in_specs=[q_tile, kv_tile, kv_tile, q_tile, per_query, per_query, *row_specs],
            out_specs=q_tile,
            scratch_shapes=[pltpu.VMEM((bq, config.head_dim), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=config.cost(3, q.dtype.itemsize * (3 * q.size + 2 * k.size * p.group)),
        interpret=config.interpret,
        name="flash_attention_tpu_dq",
    )(tables.kv_index, tables.kv_count, q, k, v, d_out, _lane_columns(lse), _lane_columns(delta), *row_args)


def _dkv_call(q, k, v, rows, d_out, lse, delta, tables: BlockTables, config: TpuKernelConfig):
    """dk, dv on the (batch, key head, key block, query head of the group, slot) grid."""
    p, bq, bk, dim, group = config.problem, config.block_q, config.block_kv, config.head_dim, config.problem.group
    per_batch = tables.q_index.shape[0] > 1

    def q_block(b, j, t, q_index):
        return q_index[b if per_batch else 0, j, t]

    def q_head_tile(b, g_kv, j, g, t, q_index, _):
        return b, g_kv * group + g, q_block(b, j, t, q_index), 0

    def q_head_row(b, g_kv, j, g, t, q_index, _):
        return b, g_kv * group + g, 0, q_block(b, j, t, q_index)

    q_tile = pl.BlockSpec((None, None, bq, dim), q_head_tile)
    kv_tile = pl.BlockSpec((None, None, bk, dim), lambda b, g_kv, j, g, t, *_: (b, g_kv, j, 0))
    per_query = pl.BlockSpec((None, None, NUM_SUBLANES, bq), q_head_row)
    q_side = pl.BlockSpec(
        (None, NUM_SUBLANES, bq), lambda b, g_kv, j, g, t, q_index, _: (b, 0, q_block(b, j, t, q_index))
    )
    kv_side = pl.BlockSpec((None, bk, NUM_LANES), lambda b, g_kv, j, g, t, *_: (b, j, 0))
    row_args = _row_arrays(rows, config, queries_on_lanes=True)
    return pl.pallas_call(
        functools.partial(dkv_kernel, config=config),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(p.batch, p.kv_heads, config.padded_kv_len // bk, group, tables.q_index.shape[-1]),
            in_specs=[
                q_tile,
                kv_tile,
                kv_tile,
                q_tile,
                per_query,
                per_query,
                *[q_side, kv_side] * (len(row_args) // 2),
            ],
            out_specs=[kv_tile, kv_tile],
            scratch_shapes=[pltpu.VMEM((bk, dim), jnp.float32), pltpu.VMEM((bk, dim), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
        ),
        cost_estimate=config.cost(4, q.dtype.itemsize * (3 * q.size + 4 * k.size)),
        interpret=config.interpret,
        name="flash_attention_tpu_dkv",
    )(tables.q_index, tables.q_count, q, k, v, d_out, _sublane_rows(lse), _sublane_rows(delta), *row_args)


def tpu_backward(q, k, v, rows, out, lse, d_out, config: TpuKernelConfig):
    """``(dq, dk, dv)`` shaped like the heads-major ``q, k, v``, from the forward's ``out``
    and ``lse [batch, heads, q_len']`` and the cotangent ``d_out`` (like ``out``)."""
    tables = block_tables(config, rows)
    # delta_i = sum_d dO_id * O_id: the softmax Jacobian's row term, [batch, heads, q_len'].
    delta = jnp.einsum("bhqd,bhqd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    d_out = d_out.astype(q.dtype)
    dq = _dq_call(q, k, v, rows, d_out, lse, delta, tables, config)
    dk, dv = _dkv_call(q, k, v, rows, d_out, lse, delta, tables, config)
    return dq, dk, dv


_flash = attention_vjp(tpu_forward, tpu_backward)


def tpu_kernel_config(problem, block_sizes, interpret) -> TpuKernelConfig:
    """The config of a call: ``block_sizes`` (fitted ``FlashBlockSizes``) raised to at
    least 128 each (the lane width); ``interpret`` is ``pallas_call`` 's argument.

    Raises:
      ValueError: if an :class:`~ember.kernels_pallas.block_mask.ExplicitBlockMask` 's
        cells are not multiples of these sizes.
    """
    block_q, block_kv = max(NUM_LANES, block_sizes.block_q), max(NUM_LANES, block_sizes.block_kv)
    if problem.mask is not None:
        try:
            problem.mask.validate_block_sizes(block_q, block_kv)
        except ValueError as error:
            raise ValueError(f"{error} (the TPU kernel runs blocks of at least {NUM_LANES})") from None
    return TpuKernelConfig(problem, block_q, block_kv, interpret)


def flash_attention_tpu(q, k, v, segments, segment_positions=None, *, problem, block_sizes, interpret):
    """The TPU path of ``flash_attention`` (arguments already validated).

    Args:
      q: ``[batch, q_len, heads, head_dim]``; k, v: ``[batch, kv_len, kv_heads, head_dim]``.
      segments, segment_positions: each ``None`` or a pair ``(query [batch, q_len], key
        [batch, kv_len])`` of int32; positions only where ``problem.has_segment_positions``.
      problem: the call's ``AttentionProblem``; block_sizes: fitted ``FlashBlockSizes``.
      interpret: ``pallas_call`` 's ``interpret`` (``dispatch.pallas_interpret``).

    Returns:
      ``[batch, q_len, heads, head_dim]`` in ``q.dtype``.
    """
    config = tpu_kernel_config(problem, block_sizes, interpret)
    qt = heads_major(q, config.block_q)
    kt, vt = (heads_major(x, config.block_kv) for x in (k, v))
    out = _flash(qt, kt, vt, (segments, segment_positions), config)
    return jnp.swapaxes(out, 1, 2)[:, : problem.q_len, :, : problem.head_dim]

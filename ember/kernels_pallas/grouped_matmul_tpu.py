"""Mosaic TPU kernels of :func:`ember.kernels_pallas.grouped_matmul.grouped_matmul`.

Groups reach the kernels as int32 ``bounds [groups + 1]``, as for the GPU kernels: local
group ``g`` owns rows ``[bounds[g], bounds[g + 1])``; other rows belong to no local group.

The TPU pipeline keeps an output block in VMEM for as long as consecutive grid steps map to
it, and writes it back once. The kernels use this the way JAX's megablox kernels do: a grid
axis walks a list of *visits*, scalar-prefetched into SMEM (:class:`GroupMetadata`), ordered
so that every visit to one output block is consecutive, and an f32 VMEM accumulator sums them:

- ``gmm`` (forward, and ``d_lhs = gmm(d_out, rhs^T)``): grid ``(n_tiles, visits, k_tiles)``.
  A visit is ``(m-tile, group)``: each m-tile once per non-empty group whose rows meet it --
  a tile straddling a group boundary once per group, its rows outside the group masked to
  zero -- or once with no group (its rows belong to none: the tile comes out zero). The
  accumulator is zeroed at the first visit of a tile and stored at its last, so each output
  block is written exactly once.
- ``tgmm`` (``d_rhs``): grid ``(k_tiles, n_tiles, visits)``. A visit is ``(group, m-tile)``:
  each group once per m-tile its rows meet, an empty group once with no rows, so its
  ``[k, n]`` block is written as zeros.

Both lists have the static length ``m_tiles + groups - 1`` (the most visits there can be);
the tail repeats the last visit. A *dead* visit (an m-tile of no group, an empty group, the
tail) computes nothing, and its input blocks are the previous visit's wherever its output
block allows, so the pipeline fetches nothing for it (``gmm`` still reads one lhs tile for
an m-tile of no group).

Operands are zero-padded to whole tiles outside the kernels (a no-op for tile-aligned
shapes) and rows masked inside, so nothing unowned -- not even a NaN in rows past the
groups -- reaches a result. Tiles: rows a multiple of 8 sublanes (16 for bf16), the
contracted and output columns multiples of 128 lanes, each shrunk to the whole dimension
when that is shorter (:func:`tpu_tiles`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ember.kernels_pallas.grouped_matmul_vjp import grouped_matmul_vjp
from ember.kernels_pallas.sequence_padding import pad_axis_to_multiple, round_up

LANES = 128
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b
_NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T


@dataclasses.dataclass(frozen=True)
class TpuGmmConfig:
    """Everything static about one call (hashable: a ``custom_vjp`` non-diff argument).

    ``block_m``/``block_k``/``block_n``: the requested tiles (powers of two >= 8), fitted per
    product by :func:`tpu_tiles`. ``interpret``: ``pallas_call``'s ``interpret`` (``False``
    when compiled, or ``pltpu.InterpretParams``).
    """

    block_m: int
    block_k: int
    block_n: int
    out_dtype: str
    interpret: Any = False


class GroupMetadata(NamedTuple):
    """The visit list of a grid, int32 ``[visits]`` each, scalar-prefetched into SMEM.

    ``group_ids``: the group whose matrix (``gmm``) or output block (``tgmm``) a visit uses.
    ``m_tile_ids``: the m-tile whose rows it reads (and, for ``gmm``, writes).
    ``row_starts``/``row_ends``: its group's rows; equal for a dead visit, which computes
    nothing.
    """

    group_ids: jax.Array
    m_tile_ids: jax.Array
    row_starts: jax.Array
    row_ends: jax.Array


def num_visits(m_tiles: int, groups: int) -> int:
    """The static length of both visit lists, the most visits there can be: each m-tile once,
    plus once more for each of the ``groups - 1`` group boundaries that falls inside a tile
    (``tgmm``'s one dead visit for an empty group stands in for its boundary)."""
    return m_tiles + groups - 1


def _expand(visits_per_item: jax.Array, length: int):
    """Numbers the visits of items visited ``visits_per_item [items]`` times, one after the
    other, padded to ``length``: per visit ``(item, j, real)`` -- the item, the index of the
    visit among the item's, and whether it is one (the padding repeats the last visit)."""
    ends = jnp.cumsum(visits_per_item, dtype=jnp.int32)
    index = jnp.arange(length, dtype=jnp.int32)
    real = index < ends[-1]
    index = jnp.minimum(index, ends[-1] - 1)
    item = jnp.searchsorted(ends, index, side="right").astype(jnp.int32)
    return item, index - (ends[item] - visits_per_item[item]), real


def _carried(values: jax.Array, live: jax.Array) -> jax.Array:
    """``values`` at the live visits; a dead visit takes the last live visit's value (0 before
    any), so its blocks are the ones already in VMEM. ``values`` rise along the list."""
    return lax.cummax(jnp.where(live, values, 0))


def _live_rows(group: jax.Array, live: jax.Array, bounds: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per visit its group's rows ``[start, end)``, empty for a dead visit."""
    return jnp.where(live, bounds[group], 0), jnp.where(live, bounds[group + 1], 0)


def gmm_metadata(bounds: jax.Array, m_tiles: int, block_m: int) -> GroupMetadata:
    """``gmm``'s visits, m-tile by m-tile: per tile the non-empty groups whose rows meet it,
    in order, or one dead visit when none does (``num_visits`` entries)."""
    groups = bounds.shape[0] - 1
    starts, ends = bounds[:-1], bounds[1:]
    nonempty = ends > starts
    # The non-empty groups' ids in order, then the empty ones, whose rows are pushed past every tile.
    order = jnp.argsort(~nonempty, stable=True).astype(jnp.int32)
    past = jnp.int32(m_tiles * block_m)
    starts_ne, ends_ne = jnp.where(nonempty, starts, past)[order], jnp.where(nonempty, ends, past)[order]
    tile_starts = jnp.arange(m_tiles, dtype=jnp.int32) * block_m
    first = jnp.searchsorted(ends_ne, tile_starts, side="right").astype(jnp.int32)  # first ending past the start
    stop = jnp.searchsorted(starts_ne, tile_starts + block_m, side="left").astype(jnp.int32)
    count = jnp.maximum(stop - first, 0)
    tile, j, real = _expand(jnp.maximum(count, 1), num_visits(m_tiles, groups))
    live = real & (j < count[tile])
    group = order[jnp.minimum(first[tile] + j, groups - 1)]
    # Every visit keeps its own tile: the output block it accumulates into.
    return GroupMetadata(_carried(group, live), tile, *_live_rows(group, live, bounds))


def tgmm_metadata(bounds: jax.Array, m_tiles: int, block_m: int) -> GroupMetadata:
    """``tgmm``'s visits, group by group: per group the m-tiles its rows meet, or one dead
    visit for an empty group (``num_visits`` entries)."""
    groups = bounds.shape[0] - 1
    starts, ends = bounds[:-1], bounds[1:]
    nonempty = ends > starts
    first_tile = starts // block_m
    span = jnp.where(nonempty, (ends - 1) // block_m - first_tile + 1, 0)
    group, j, real = _expand(jnp.maximum(span, 1), num_visits(m_tiles, groups))
    live = real & nonempty[group]
    # Every visit keeps its own group: the output block it accumulates into.
    return GroupMetadata(group, _carried(first_tile[group] + j, live), *_live_rows(group, live, bounds))


def _sublanes(*dtypes) -> int:
    """Rows per native TPU tile for the narrowest of ``dtypes``: 8 for 32-bit, 16 for 16-bit."""
    return 8 * 4 // min(jnp.dtype(d).itemsize for d in dtypes)


def tpu_tiles(config: TpuGmmConfig, rows: int, contracted: int, columns: int, *dtypes) -> tuple[int, int, int]:
    """``(block_m, block_k, block_n)`` for a product of ``rows x contracted`` by
    ``contracted x columns``: rows a multiple of the dtypes' sublanes (at most the rows
    rounded up to it), the lane dimensions at least 128 or the whole dimension."""
    sublanes = _sublanes(*dtypes)
    block_m = min(max(config.block_m, sublanes), round_up(rows, sublanes))

    def lane_tile(block, length):
        block = max(block, LANES)
        return length if length <= block else block

    return block_m, lane_tile(config.block_k, contracted), lane_tile(config.block_n, columns)


def _first_visit(ids, v):
    return (v == 0) | (ids[jnp.maximum(v - 1, 0)] != ids[v])


def _last_visit(ids, v, visits: int):
    return (v == visits - 1) | (ids[jnp.minimum(v + 1, visits - 1)] != ids[v])


def _owned(x, first_row, lo, hi):
    """``x [rows, cols]`` with the rows outside ``[lo, hi)`` zeroed; ``first_row`` is ``x``'s
    first row. Selects in f32 (TPUs before v6 have no bf16 VPU)."""
    rows = first_row + lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.where((rows >= lo) & (rows < hi), x.astype(jnp.float32), 0.0)


def _gmm_kernel(group_ids, m_tile_ids, row_starts, row_ends, lhs_ref, rhs_ref, out_ref, acc_ref, *, transpose_rhs):
    v, kt = pl.program_id(1), pl.program_id(2)
    visits, k_tiles = pl.num_programs(1), pl.num_programs(2)
    block_m = lhs_ref.shape[0]
    lo, hi = row_starts[v], row_ends[v]

    @pl.when((kt == 0) & _first_visit(m_tile_ids, v))
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(hi > lo)
    def _accumulate():
        x = _owned(lhs_ref[...], m_tile_ids[v] * block_m, lo, hi).astype(lhs_ref.dtype)
        dims = _NT_DIMS if transpose_rhs else _NN_DIMS
        acc_ref[...] += lax.dot_general(x, rhs_ref[...], dims, preferred_element_type=jnp.float32)

    @pl.when((kt == k_tiles - 1) & _last_visit(m_tile_ids, v, visits))
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def gmm(lhs, rhs, bounds, config: TpuGmmConfig, *, transpose_rhs: bool = False, out_dtype=None):
    """``out[r] = lhs[r] @ rhs[g]`` for the rows ``r`` of local group ``g``; 0 elsewhere.

    Args:
      lhs: ``[m, k]``.
      rhs: ``[groups, k, n]``; with ``transpose_rhs``, ``[groups, n, k]`` used as its transpose.
      bounds: int32 ``[groups + 1]``, nondecreasing, within ``[0, m]``.
      config: tiles and interpret mode; ``out_dtype`` overrides ``config.out_dtype``.

    Returns:
      ``[m, n]``.
    """
    m, k = lhs.shape
    groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = jnp.dtype(out_dtype or config.out_dtype)
    if 0 in (m, k, n, groups):  # an empty grid or contraction: nothing to launch
        return jnp.zeros((m, n), out_dtype)
    bm, bk, bn = tpu_tiles(config, m, k, n, lhs.dtype, out_dtype)
    lhs_p = pad_axis_to_multiple(pad_axis_to_multiple(lhs, 0, bm), 1, bk)
    k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
    rhs_p = pad_axis_to_multiple(pad_axis_to_multiple(rhs, k_axis, bk), n_axis, bn)
    m_tiles, k_tiles, n_tiles = lhs_p.shape[0] // bm, lhs_p.shape[1] // bk, rhs_p.shape[n_axis] // bn
    meta = gmm_metadata(bounds, m_tiles, bm)
    visits = num_visits(m_tiles, groups)

    def k_index(v, kt, meta):
        # A visit with no rows stays on the last k-tile, the previous visit's: nothing to fetch.
        return jnp.where(meta[3][v] > meta[2][v], kt, k_tiles - 1)

    def lhs_map(nt, v, kt, *meta):
        return meta[1][v], k_index(v, kt, meta)

    def rhs_map(nt, v, kt, *meta):
        kt = k_index(v, kt, meta)
        return (meta[0][v], nt, kt) if transpose_rhs else (meta[0][v], kt, nt)

    rhs_block = (None, bn, bk) if transpose_rhs else (None, bk, bn)
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, transpose_rhs=transpose_rhs),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(meta),
            grid=(n_tiles, visits, k_tiles),
            in_specs=[pl.BlockSpec((bm, bk), lhs_map), pl.BlockSpec(rhs_block, rhs_map)],
            out_specs=pl.BlockSpec((bm, bn), lambda nt, v, kt, *meta: (meta[1][v], nt)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((lhs_p.shape[0], n_tiles * bn), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=2 * m * k * n,
            transcendentals=0,
            # lhs once per n-tile, a [k, n] slice of rhs per visit, the output once.
            bytes_accessed=lhs.dtype.itemsize * (lhs.size * n_tiles + visits * k * n) + out_dtype.itemsize * m * n,
        ),
        interpret=config.interpret,
        name="grouped_matmul_tpu_transposed_rhs" if transpose_rhs else "grouped_matmul_tpu",
    )(*meta, lhs_p, rhs_p)
    return out[:m, :n]


def _tgmm_kernel(group_ids, m_tile_ids, row_starts, row_ends, lhs_ref, d_out_ref, out_ref, acc_ref):
    v, visits = pl.program_id(2), pl.num_programs(2)
    block_m = lhs_ref.shape[0]
    lo, hi = row_starts[v], row_ends[v]

    @pl.when(_first_visit(group_ids, v))
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(hi > lo)
    def _accumulate():
        first_row = m_tile_ids[v] * block_m
        # Both operands masked: a NaN in an unowned row of either would survive a 0 product.
        # The transpose runs in f32, which every TPU generation transposes natively.
        x_t = _owned(lhs_ref[...], first_row, lo, hi).T.astype(lhs_ref.dtype)
        dy = _owned(d_out_ref[...], first_row, lo, hi).astype(d_out_ref.dtype)
        acc_ref[...] += lax.dot_general(x_t, dy, _NN_DIMS, preferred_element_type=jnp.float32)

    @pl.when(_last_visit(group_ids, v, visits))
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def tgmm(lhs, d_out, bounds, config: TpuGmmConfig, *, out_dtype):
    """Per local group ``g``: ``lhs_g^T @ d_out_g`` over its rows, ``[groups, k, n]`` (an empty
    group gives zeros).

    Args:
      lhs: ``[m, k]``; d_out: ``[m, n]`` (same dtype); bounds: int32 ``[groups + 1]``.
    """
    m, k = lhs.shape
    n = d_out.shape[1]
    groups = bounds.shape[0] - 1
    out_dtype = jnp.dtype(out_dtype)
    if 0 in (m, k, n, groups):
        return jnp.zeros((groups, k, n), out_dtype)
    bm, bk, bn = tpu_tiles(config, m, k, n, lhs.dtype)
    lhs_p = pad_axis_to_multiple(pad_axis_to_multiple(lhs, 0, bm), 1, bk)
    d_out_p = pad_axis_to_multiple(pad_axis_to_multiple(d_out, 0, bm), 1, bn)
    m_tiles, k_tiles, n_tiles = lhs_p.shape[0] // bm, lhs_p.shape[1] // bk, d_out_p.shape[1] // bn
    meta = tgmm_metadata(bounds, m_tiles, bm)
    out = pl.pallas_call(
        _tgmm_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(meta),
            grid=(k_tiles, n_tiles, num_visits(m_tiles, groups)),
            in_specs=[
                pl.BlockSpec((bm, bk), lambda kt, nt, v, *meta: (meta[1][v], kt)),
                pl.BlockSpec((bm, bn), lambda kt, nt, v, *meta: (meta[1][v], nt)),
            ],
            out_specs=pl.BlockSpec((None, bk, bn), lambda kt, nt, v, *meta: (meta[0][v], kt, nt)),
            scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((groups, k_tiles * bk, n_tiles * bn), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=2 * m * k * n,
            transcendentals=0,
            # lhs once per n-tile, d_out once per k-tile, the output once.
            bytes_accessed=lhs.dtype.itemsize * (lhs.size * n_tiles + d_out.size * k_tiles)
            + out_dtype.itemsize * groups * k * n,
        ),
        interpret=config.interpret,
        name="grouped_matmul_tpu_tgmm",
    )(*meta, lhs_p, d_out_p)
    return out[:, :k, :n]


_grouped_matmul = grouped_matmul_vjp(gmm, tgmm)


def grouped_matmul_tpu(lhs, rhs, bounds, *, block_sizes, out_dtype, interpret=False):
    """The TPU Pallas path of ``grouped_matmul`` (arguments already validated): ``lhs [m, k]``,
    ``rhs [groups, k, n]`` (float32 or bfloat16), ``bounds`` int32 ``[groups + 1]`` (see the
    module docstring), ``block_sizes`` a ``GroupedMatmulBlockSizes`` (its Triton parameters
    unused), ``interpret`` ``pallas_call``'s. Differentiable in ``lhs`` and ``rhs``.

    Raises:
      ValueError: for operands neither float32 nor bfloat16 (the dtypes the MXU kernels take).
    """
    if jnp.dtype(lhs.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(
            f"grouped_matmul: the TPU kernel takes float32 or bfloat16 operands, got {jnp.dtype(lhs.dtype).name}; "
            "use impl='xla'"
        )
    config = TpuGmmConfig(
        block_m=block_sizes.block_m,
        block_k=block_sizes.block_k,
        block_n=block_sizes.block_n,
        out_dtype=jnp.dtype(out_dtype).name,
        interpret=interpret,
    )
    return _grouped_matmul(lhs, rhs, bounds.astype(jnp.int32), config)

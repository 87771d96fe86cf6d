"""Pallas kernels of :func:`ember.kernels_pallas.grouped_matmul.grouped_matmul`.

Groups reach the kernels as one int32 vector ``bounds``: local group ``g`` owns the rows
``[bounds[g], bounds[g + 1])`` (local groups are contiguous; rows outside
``[bounds[0], bounds[groups])`` belong to no local group). Two kernels, tied by ``custom_vjp``:

- ``gmm`` (forward, and ``d_lhs = gmm(d_out, rhs^T)``): a 1-D grid over the
  ``m_tiles x n_tiles`` output tiles (numbered in L2-friendly bands, :func:`swizzled_tile`). A
  metadata table gives every m-tile ``[first group, group count]``: the groups whose rows
  meet the tile. The program visits each of them once -- a tile straddling a group boundary
  once per group, with the rows outside the group masked to zero -- streaming the k-tiles of
  that group's matrix, and sums every visit into one ``[block_m, block_n]`` accumulator, so
  each output tile is written exactly once (no cross-program accumulation, which GPU
  programs cannot share). An empty group streams nothing; rows of no local group come out 0.
- ``tgmm`` (``d_rhs``): grid ``(groups, k_tiles, n_tiles)``; a program streams only the
  m-tiles its group's rows meet and writes ``lhs_g^T @ d_out_g``; an empty group writes 0.

On an sm90 GPU, ``gpu_kernel="hopper"`` runs ``gmm`` (forward and ``d_lhs``) as the Mosaic
GPU kernel of :mod:`ember.kernels_pallas.grouped_matmul_mgpu` instead; ``tgmm`` stays this one.

Unlike JAX's TPU megablox kernels (which accumulate consecutive grid steps in VMEM), every
program owns its output tile, the form GPU (Triton) programs need. Operands the program
indexes by group (``rhs``) or by a data-dependent row range are passed as whole slabs and
read a tile at a time with dynamic slices, as Triton kernels do. Arrays are padded to tile
multiples outside (zeros) and rows masked inside, so nothing unowned -- not even a NaN in
rows past the groups -- reaches a result.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ember.kernels_pallas.dispatch import choose_gpu_kernel, triton_compiler_params
from ember.kernels_pallas.grouped_matmul_mgpu import (
    DEFAULT_HOPPER_GMM_BLOCKS,
    HopperGmmBlockSizes,
    hopper_gmm,
    hopper_gmm_reason,
)
from ember.kernels_pallas.grouped_matmul_vjp import grouped_matmul_vjp
from ember.kernels_pallas.hopper import GpuInfo
from ember.kernels_pallas.sequence_padding import pad_axis_to_multiple, round_up

# Output tiles are numbered in bands of this many m-tiles, column by column inside a band, so
# programs running at the same time share their lhs rows and rhs columns in the L2 cache.
SWIZZLE_M_TILES = 8
_NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b
_NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
_TN_DIMS = (((0,), (0,)), ((), ()))  # a.T @ b


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """Everything static about one call (hashable: a ``custom_vjp`` non-diff argument).

    Tiles: ``block_m`` rows, ``block_k`` of the contracted dimension, ``block_n`` of the
    output columns (each already validated, powers of two). ``num_warps``/``num_stages`` are
    the Triton compiler parameters on a GPU.
    """

    block_m: int
    block_k: int
    block_n: int
    out_dtype: str
    interpret: bool
    num_warps: int = 4
    num_stages: int = 3
    hopper_blocks: HopperGmmBlockSizes | None = None  # gmm by the Hopper kernel; None: Triton's


def _fit(block: int, length: int) -> int:
    """``block``, shrunk to the next power of two >= ``length`` (at least 16, what GPU dots want)."""
    return min(block, max(16, 1 << max(0, length - 1).bit_length()))


def _compiler_params(config: GmmConfig):
    return triton_compiler_params(interpret=config.interpret, num_warps=config.num_warps, num_stages=config.num_stages)


def padded_bounds(bounds: jax.Array) -> jax.Array:
    """``bounds [groups + 1]`` padded with its last value to a power-of-two length (GPU
    programs load whole power-of-two blocks)."""
    length = 1 << (bounds.shape[0] - 1).bit_length()
    return jnp.pad(bounds, (0, length - bounds.shape[0]), mode="edge")


def tile_group_table(bounds: jax.Array, num_tiles: int, block_m: int) -> jax.Array:
    """``[num_tiles, 2]`` int32: per m-tile its first group and how many groups it visits
    (those with a row in ``[tile * block_m, (tile + 1) * block_m)``, plus any empty group
    between them, which costs a skipped loop step)."""
    starts, ends = bounds[:-1], bounds[1:]
    tile_starts = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
    # compare_all: one fused comparison, where the default (scan) is a while loop of small kernels.
    first = jnp.searchsorted(ends, tile_starts, side="right", method="compare_all")  # first group ending past the start
    stop = jnp.searchsorted(starts, tile_starts + block_m, side="left", method="compare_all")
    first, stop = first.astype(jnp.int32), stop.astype(jnp.int32)
    return jnp.stack([first, jnp.maximum(stop - first, 0)], axis=1)


def swizzled_tile(pid, m_tiles: int, n_tiles: int):
    """``(m_tile, n_tile)`` of program ``pid`` of a 1-D grid over the ``m_tiles x n_tiles``
    output tiles: bands of :data:`SWIZZLE_M_TILES` m-tiles, each walked column by column."""
    per_band = SWIZZLE_M_TILES * n_tiles
    first_m = (pid // per_band) * SWIZZLE_M_TILES
    band_height = jnp.minimum(m_tiles - first_m, SWIZZLE_M_TILES)
    within = pid % per_band
    return first_m + within % band_height, within // band_height


def _owned(rows, lo, hi):
    return ((rows >= lo) & (rows < hi))[:, None]


def _gmm_kernel(table_ref, bounds_ref, lhs_ref, rhs_ref, out_ref, *, config: GmmConfig, tiles, transpose_rhs):
    bm, bk = config.block_m, config.block_k
    m_tiles, k_tiles, n_tiles = tiles
    m_tile, _ = swizzled_tile(pl.program_id(0), m_tiles, n_tiles)
    rows = m_tile * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)

    def visit_group(t, acc):
        group = table_ref[0] + t
        lo, hi = bounds_ref[group], bounds_ref[group + 1]
        owned = _owned(rows, lo, hi)

        def k_step(kt, acc):
            cols = pl.ds(pl.multiple_of(kt * bk, bk), bk)
            x = jnp.where(owned, lhs_ref[:, cols], 0)
            if transpose_rhs:
                return acc + lax.dot_general(x, rhs_ref[group, :, cols], _NT_DIMS, preferred_element_type=jnp.float32)
            return acc + lax.dot_general(x, rhs_ref[group, cols, :], _NN_DIMS, preferred_element_type=jnp.float32)

        # int32 operands: the Triton lowering typed the weak scalars of where(hi > lo, k_tiles, 0) as i1
        return lax.fori_loop(0, jnp.where(hi > lo, jnp.int32(k_tiles), jnp.int32(0)), k_step, acc)

    acc = jnp.zeros(out_ref.shape, jnp.float32)
    out_ref[...] = lax.fori_loop(0, table_ref[1], visit_group, acc).astype(out_ref.dtype)


def gmm(lhs, rhs, bounds, config: GmmConfig, *, transpose_rhs: bool = False, out_dtype=None):
    """``out[r] = lhs[r] @ rhs[g]`` for the rows ``r`` of local group ``g``; 0 elsewhere.

    Args:
      lhs: ``[m, k]``.
      rhs: ``[groups, k, n]``; with ``transpose_rhs``, ``[groups, n, k]`` used as its transpose.
      bounds: int32 ``[groups + 1]``, nondecreasing, within ``[0, m]``.
      config: tiles and backend; ``out_dtype`` overrides ``config.out_dtype``.

    Returns:
      ``[m, n]``.
    """
    m, k = lhs.shape
    groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = jnp.dtype(out_dtype or config.out_dtype)
    if 0 in (m, k, n, groups):  # an empty grid or contraction: nothing to launch
        return jnp.zeros((m, n), out_dtype)
    bm, bk, bn = _fit(config.block_m, m), _fit(config.block_k, k), _fit(config.block_n, n)
    config = dataclasses.replace(config, block_m=bm, block_k=bk, block_n=bn)
    lhs_p = pad_axis_to_multiple(pad_axis_to_multiple(lhs, 0, bm), 1, bk)
    k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
    rhs_p = pad_axis_to_multiple(pad_axis_to_multiple(rhs, k_axis, bk), n_axis, bn)
    m_tiles, k_pad, n_pad = lhs_p.shape[0] // bm, lhs_p.shape[1], round_up(n, bn)
    tiles = (m_tiles, k_pad // bk, n_pad // bn)
    table = tile_group_table(bounds, m_tiles, bm)
    bounds_p = padded_bounds(bounds)

    def m_tile(pid):
        return swizzled_tile(pid, m_tiles, tiles[2])[0]

    def n_tile(pid):
        return swizzled_tile(pid, m_tiles, tiles[2])[1]

    if transpose_rhs:
        rhs_spec = pl.BlockSpec((groups, bn, k_pad), lambda pid: (0, n_tile(pid), 0))
    else:
        rhs_spec = pl.BlockSpec((groups, k_pad, bn), lambda pid: (0, 0, n_tile(pid)))
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, config=config, tiles=tiles, transpose_rhs=transpose_rhs),
        grid=(m_tiles * tiles[2],),
        in_specs=[
            pl.BlockSpec((None, 2), lambda pid: (m_tile(pid), 0)),
            pl.BlockSpec(bounds_p.shape, lambda pid: (0,)),
            pl.BlockSpec((bm, k_pad), lambda pid: (m_tile(pid), 0)),
            rhs_spec,
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda pid: (m_tile(pid), n_tile(pid))),
        out_shape=jax.ShapeDtypeStruct((lhs_p.shape[0], n_pad), out_dtype),
        compiler_params=_compiler_params(config),
        cost_estimate=pl.CostEstimate(
            flops=2 * m * k * n,
            transcendentals=0,
            bytes_accessed=lhs.dtype.itemsize * (lhs.size + rhs.size) + out_dtype.itemsize * m * n,
        ),
        interpret=config.interpret,
        name="grouped_matmul_transposed_rhs" if transpose_rhs else "grouped_matmul",
    )(table, bounds_p, lhs_p, rhs_p)
    return out[:m, :n]


def _tgmm_kernel(bounds_ref, lhs_ref, d_out_ref, out_ref, *, config: GmmConfig):
    bm = config.block_m
    group = pl.program_id(0)
    lo, hi = bounds_ref[group], bounds_ref[group + 1]
    first_tile = lo // bm
    num_tiles = jnp.where(hi > lo, (hi + bm - 1) // bm - first_tile, 0)

    def m_step(t, acc):
        start = pl.multiple_of((first_tile + t) * bm, bm)
        owned = _owned(start + lax.broadcasted_iota(jnp.int32, (bm,), 0), lo, hi)
        x = jnp.where(owned, lhs_ref[pl.ds(start, bm), :], 0)
        dy = jnp.where(owned, d_out_ref[pl.ds(start, bm), :], 0)
        return acc + lax.dot_general(x, dy, _TN_DIMS, preferred_element_type=jnp.float32)

    acc = jnp.zeros(out_ref.shape, jnp.float32)
    out_ref[...] = lax.fori_loop(0, num_tiles, m_step, acc).astype(out_ref.dtype)


def tgmm(lhs, d_out, bounds, config: GmmConfig, *, out_dtype):
    """Per local group ``g``: ``lhs_g^T @ d_out_g`` over its rows, ``[groups, k, n]`` (an empty
    group gives zeros).

    Args:
      lhs: ``[m, k]``; d_out: ``[m, n]`` (same dtype); bounds: int32 ``[groups + 1]``.
    """
    m, k = lhs.shape
    n = d_out.shape[1]
    groups = bounds.shape[0] - 1
    if 0 in (m, k, n, groups):
        return jnp.zeros((groups, k, n), out_dtype)
    bm, bk, bn = _fit(config.block_m, m), _fit(config.block_k, k), _fit(config.block_n, n)
    config = dataclasses.replace(config, block_m=bm, block_k=bk, block_n=bn)
    lhs_p = pad_axis_to_multiple(pad_axis_to_multiple(lhs, 0, bm), 1, bk)
    d_out_p = pad_axis_to_multiple(pad_axis_to_multiple(d_out, 0, bm), 1, bn)
    m_pad, k_pad, n_pad = lhs_p.shape[0], lhs_p.shape[1], d_out_p.shape[1]
    bounds_p = padded_bounds(bounds)
    out_bytes = jnp.dtype(out_dtype).itemsize * groups * k * n
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, config=config),
        grid=(groups, k_pad // bk, n_pad // bn),
        in_specs=[
            pl.BlockSpec(bounds_p.shape, lambda g, a, b: (0,)),
            pl.BlockSpec((m_pad, bk), lambda g, a, b: (0, a)),
            pl.BlockSpec((m_pad, bn), lambda g, a, b: (0, b)),
        ],
        out_specs=pl.BlockSpec((None, bk, bn), lambda g, a, b: (g, a, b)),
        out_shape=jax.ShapeDtypeStruct((groups, k_pad, n_pad), out_dtype),
        compiler_params=_compiler_params(config),
        cost_estimate=pl.CostEstimate(
            flops=2 * m * k * n,
            transcendentals=0,
            bytes_accessed=lhs.dtype.itemsize * (lhs.size + d_out.size) + out_bytes,
        ),
        interpret=config.interpret,
        name="grouped_matmul_tgmm",
    )(bounds_p, lhs_p, d_out_p)
    return out[:, :k, :n]


def _configured_gmm(lhs, rhs, bounds, config: GmmConfig, *, transpose_rhs: bool = False, out_dtype=None):
    """:func:`gmm`, or the Hopper kernel where ``config.hopper_blocks`` is set."""
    if config.hopper_blocks is None:
        return gmm(lhs, rhs, bounds, config, transpose_rhs=transpose_rhs, out_dtype=out_dtype)
    out_dtype = out_dtype or config.out_dtype
    return hopper_gmm(lhs, rhs, bounds, transpose_rhs=transpose_rhs, out_dtype=out_dtype, blocks=config.hopper_blocks)


# "auto" takes the Hopper gmm once its values have been checked on an sm90 device (python -m
# benchmarks.gpu, check grouped_matmul[hopper...]); until then it has run only in jax's Mosaic
# GPU interpreter, lowered for CUDA on CPU, so it runs when asked for (gpu_kernel="hopper").
HOPPER_GMM_BY_DEFAULT = False
_grouped_matmul = grouped_matmul_vjp(_configured_gmm, tgmm)


def grouped_matmul_kernel(lhs, rhs, bounds, *, block_sizes, out_dtype, interpret: bool, gpu_kernel: str = "auto"):
    """The Pallas path of ``grouped_matmul`` (arguments already validated): ``lhs [m, k]``,
    ``rhs [groups, k, n]``, ``bounds`` int32 ``[groups + 1]`` (see the module docstring),
    ``block_sizes`` a ``GroupedMatmulBlockSizes``. Differentiable in ``lhs`` and ``rhs``.
    ``gpu_kernel`` (:data:`ember.kernels_pallas.dispatch.GPU_KERNELS`) chooses the forward and
    ``d_lhs`` kernel: the Hopper ``gmm`` of :mod:`ember.kernels_pallas.grouped_matmul_mgpu` or
    Triton's; ``d_rhs`` is Triton's ``tgmm`` either way."""
    gpu = None if interpret else GpuInfo.here()
    reason = hopper_gmm_reason((lhs.dtype, rhs.dtype), gpu, interpret=interpret)
    choice = choose_gpu_kernel("grouped matmul", gpu_kernel, reason, hopper_by_default=HOPPER_GMM_BY_DEFAULT)
    config = GmmConfig(
        block_m=block_sizes.block_m,
        block_k=block_sizes.block_k,
        block_n=block_sizes.block_n,
        out_dtype=jnp.dtype(out_dtype).name,
        interpret=interpret,
        num_warps=block_sizes.num_warps,
        num_stages=block_sizes.num_stages,
        hopper_blocks=DEFAULT_HOPPER_GMM_BLOCKS if choice == "hopper" else None,
    )
    return _grouped_matmul(lhs, rhs, bounds.astype(jnp.int32), config)

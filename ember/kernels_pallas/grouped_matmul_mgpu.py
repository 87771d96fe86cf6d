"""The Hopper (sm90) grouped matmul ``gmm`` for Mosaic GPU: TMA, wgmma and warp
specialisation. It serves the forward and ``d_lhs = gmm(d_out, rhs^T)`` of
:func:`ember.kernels_pallas.grouped_matmul.grouped_matmul`; ``d_rhs`` stays the Triton
``tgmm`` of :mod:`ember.kernels_pallas.grouped_matmul_kernels` (the same ``custom_vjp``,
:mod:`ember.kernels_pallas.grouped_matmul_vjp`).

One CTA per (visit, n-tile). A *visit* is one (group, m-tile) pair whose rows meet: a tile
inside one group is visited once, a tile straddling a boundary once per group it meets, and
an empty group never (the visit table is built from ``bounds`` by XLA, its length bounded
statically by ``m_tiles + groups - 1``; visits past the real count do nothing). Each visit
computes its whole ``[block_m, block_n]`` tile against its group's matrix and stores only its
group's rows, so every output row is written exactly once with no accumulation across CTAs.

Two warpgroups: a memory warpgroup streams the ``lhs`` and ``rhs`` k-tiles by TMA through a
ring of ``stages`` shared-memory slots; the compute warpgroup issues one wgmma per k-tile
into a ``[block_m, block_n]`` f32 accumulator, keeping one in flight (a slot is released once
the wgmma after it has been issued and the one reading it has completed). The tile is then
stored by TMA in power-of-two row runs (TMA boxes are static; a visit's row count is not).
Rows of no local group are zeroed by XLA afterwards (the kernel never writes them).

Written against jax 0.11's ``jax.experimental.pallas.mosaic_gpu``, imported lazily like
:mod:`ember.kernels_pallas.flash_attention_mgpu`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ember.kernels_pallas.hopper import (
    WGMMA_DTYPES,
    GpuInfo,
    feed_ring,
    hopper_device_reason,
    shared_memory_reason,
    tma_transforms,
    warp_specialized,
)
from ember.kernels_pallas.sequence_padding import pad_axis_to_multiple


@dataclasses.dataclass(frozen=True)
class HopperGmmBlockSizes:
    """Tiles of the Hopper grouped matmul: ``block_m`` rows by ``block_n`` columns per CTA,
    k-tiles of 64 (one 128-byte swizzle row of 16-bit values), ``stages`` k-tiles in flight.
    ``block_m`` and ``block_n`` are multiples of 64 (wgmma's row count; 128-byte rows)."""

    block_m: int = 128
    block_n: int = 128
    stages: int = 4

    block_k = 64

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 64 or value % 64:
                raise ValueError(f"{name} must be a positive multiple of 64, got {value!r}")
        if not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"stages must be an int >= 2, got {self.stages!r}")

    def smem_bytes(self, itemsize: int) -> int:
        ring = self.stages * (self.block_m + self.block_n) * self.block_k * itemsize
        return ring + self.block_m * self.block_n * 4  # and the output tile, f32 at most


DEFAULT_HOPPER_GMM_BLOCKS = HopperGmmBlockSizes()


def hopper_gmm_reason(dtypes, gpu: GpuInfo | None, *, interpret: bool, blocks=DEFAULT_HOPPER_GMM_BLOCKS) -> str | None:
    """None when the Hopper ``gmm`` runs operands of ``dtypes`` (lhs, rhs) on ``gpu`` (None:
    not an NVIDIA GPU), else why not."""
    if interpret:
        return "interpret mode (the Pallas interpreter runs the Triton kernels)"
    names = [jnp.dtype(d).name for d in dtypes]
    if len(set(names)) != 1 or names[0] not in WGMMA_DTYPES:
        return f"operand dtypes {', '.join(names)} (wgmma takes two of {' or '.join(WGMMA_DTYPES)})"
    smem = blocks.smem_bytes(jnp.dtype(names[0]).itemsize)
    return hopper_device_reason(gpu, causal=False) or shared_memory_reason(blocks, smem)


def visit_table(bounds: jax.Array, m_tiles: int, block_m: int) -> jax.Array:
    """int32 ``[m_tiles + groups - 1, 4]``: per visit ``(group, m_tile, first row, end row)``,
    the rows relative to the tile; visits past the real count have group ``-1``."""
    groups = bounds.shape[0] - 1
    lo, hi = bounds[:-1], bounds[1:]
    first = lo // block_m
    counts = jnp.where(hi > lo, (hi - 1) // block_m - first + 1, 0)
    ends = jnp.cumsum(counts)
    visit = jnp.arange(m_tiles + groups - 1, dtype=jnp.int32)
    # compare_all: one fused comparison, where the default (scan) is a while loop of small kernels.
    group = jnp.searchsorted(ends, visit, side="right", method="compare_all")
    group = jnp.minimum(group, groups - 1).astype(jnp.int32)
    tile = first[group] + visit - (ends[group] - counts[group])
    tile_start = tile * block_m
    row_lo = jnp.maximum(lo[group], tile_start) - tile_start
    row_hi = jnp.minimum(hi[group], tile_start + block_m) - tile_start
    valid = visit < ends[-1]
    return jnp.stack([jnp.where(valid, group, -1), tile, row_lo, row_hi], axis=1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    k_tiles: int
    transpose_rhs: bool
    blocks: HopperGmmBlockSizes


class _Shared(NamedTuple):
    lhs: object  # [stages, block_m, block_k]
    rhs: object  # [stages, block_k, block_n], or [stages, block_n, block_k] transposed
    out: object  # [block_m, block_n] in the output dtype
    lhs_loaded: object  # [stages] barriers
    rhs_loaded: object
    consumed: object  # [stages] barriers: the compute warpgroup is done with a slot


def _compute_warpgroup(geo: _Geometry, shared: _Shared, out_ref, visit, n_tile):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bm, bn, stages = geo.blocks.block_m, geo.blocks.block_n, geo.blocks.stages
    plgpu.set_max_registers(232, action="increase")
    _, m_tile, row_lo, row_hi = visit

    def k_loop(acc_ref):
        def step(kt, _):
            slot = lax.rem(kt, jnp.int32(stages))
            plgpu.barrier_wait(shared.lhs_loaded.at[slot])
            plgpu.barrier_wait(shared.rhs_loaded.at[slot])
            rhs = shared.rhs.at[slot].transpose((1, 0)) if geo.transpose_rhs else shared.rhs.at[slot]
            plgpu.wgmma(acc_ref, shared.lhs.at[slot], rhs)
            plgpu.wgmma_wait(1)  # the previous k-tile's wgmma is done: release its slot

            @pl.when(kt > 0)
            def _():
                plgpu.barrier_arrive(shared.consumed.at[lax.rem(kt - 1, jnp.int32(stages))])

        lax.fori_loop(0, geo.k_tiles, step, None)
        return acc_ref[...]

    acc = pl.run_scoped(k_loop, plgpu.ACC((bm, bn), jnp.float32))
    plgpu.barrier_arrive(shared.consumed.at[(geo.k_tiles - 1) % stages])
    shared.out[...] = acc.astype(shared.out.dtype)
    plgpu.commit_smem()
    # Store rows [row_lo, row_hi) in runs of 2^i rows, largest first: TMA boxes are static.
    start, run = row_lo, bm
    while run >= 1:
        this = (row_hi - row_lo) & run

        @pl.when(this != 0)
        def _(start=start, run=run):
            rows = pl.ds(m_tile * bm + start, run)
            plgpu.copy_smem_to_gmem(shared.out.at[pl.ds(start, run)], out_ref.at[rows, pl.ds(n_tile * bn, bn)])

        start, run = start + this, run // 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _memory_warpgroup(geo: _Geometry, shared: _Shared, lhs_ref, rhs_ref, visit, n_tile):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bm, bn, bk, stages = geo.blocks.block_m, geo.blocks.block_n, geo.blocks.block_k, geo.blocks.stages
    plgpu.set_max_registers(40, action="decrease")
    group, m_tile, _, _ = visit

    def load(kt, slot):
        cols = pl.ds(kt * bk, bk)
        lhs_tile = lhs_ref.at[pl.ds(m_tile * bm, bm), cols]
        plgpu.copy_gmem_to_smem(lhs_tile, shared.lhs.at[slot], shared.lhs_loaded.at[slot])
        if geo.transpose_rhs:
            rhs_tile = rhs_ref.at[group, pl.ds(n_tile * bn, bn), cols]
        else:
            rhs_tile = rhs_ref.at[group, cols, pl.ds(n_tile * bn, bn)]
        plgpu.copy_gmem_to_smem(rhs_tile, shared.rhs.at[slot], shared.rhs_loaded.at[slot])

    feed_ring(load, geo.k_tiles, stages, shared.consumed)


def _kernel(table_ref, lhs_ref, rhs_ref, out_ref, smem, loaded, consumed, *, geo: _Geometry):
    shared = _Shared(*smem, *loaded, consumed)
    index = lax.axis_index("visits")
    visit = tuple(table_ref[index, column] for column in range(4))
    n_tile = lax.axis_index("n_tiles")

    @pl.when(visit[0] >= 0)  # past the real visits: nothing to do
    def _():
        warp_specialized(
            lambda wg: _compute_warpgroup(geo, shared, out_ref, visit, n_tile),
            lambda: _memory_warpgroup(geo, shared, lhs_ref, rhs_ref, visit, n_tile),
            compute_warpgroups=1,
        )


def _scratch(geo: _Geometry, dtype, out_dtype):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bm, bn, bk, stages = geo.blocks.block_m, geo.blocks.block_n, geo.blocks.block_k, geo.blocks.stages
    tiles = tma_transforms()
    rhs_shape = (stages, bn, bk) if geo.transpose_rhs else (stages, bk, bn)
    smem = (
        plgpu.SMEM((stages, bm, bk), dtype, transforms=tiles),
        plgpu.SMEM(rhs_shape, dtype, transforms=tiles),
        plgpu.SMEM((bm, bn), out_dtype),  # untiled: runs of rows are sliced at any offset
    )
    loaded = (plgpu.Barrier(num_barriers=stages),) * 2
    return smem, loaded, plgpu.Barrier(num_barriers=stages)


def hopper_gmm(lhs, rhs, bounds, *, transpose_rhs: bool = False, out_dtype=None, blocks=DEFAULT_HOPPER_GMM_BLOCKS):
    """``out[r] = lhs[r] @ rhs[g]`` for the rows ``r`` of local group ``g``; 0 elsewhere, on
    an sm90 GPU (callers check :func:`hopper_gmm_reason`).

    Args:
      lhs: ``[m, k]``; rhs: ``[groups, k, n]`` (with ``transpose_rhs``, ``[groups, n, k]``
        used as its transpose), the same 16-bit dtype.
      bounds: int32 ``[groups + 1]``, nondecreasing, within ``[0, m]``: group ``g`` owns
        rows ``[bounds[g], bounds[g + 1])``.

    Returns:
      ``[m, n]`` in ``out_dtype`` (default ``lhs.dtype``).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = lhs.shape
    groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if 0 in (m, k, n, groups):
        return jnp.zeros((m, n), out_dtype)
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    lhs_p = pad_axis_to_multiple(pad_axis_to_multiple(lhs, 0, bm), 1, bk)
    k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
    rhs_p = pad_axis_to_multiple(pad_axis_to_multiple(rhs, k_axis, bk), n_axis, bn)
    m_tiles, n_tiles = lhs_p.shape[0] // bm, rhs_p.shape[n_axis] // bn
    geo = _Geometry(k_tiles=lhs_p.shape[1] // bk, transpose_rhs=transpose_rhs, blocks=blocks)
    table = visit_table(bounds.astype(jnp.int32), m_tiles, bm)
    smem, loaded, consumed = _scratch(geo, lhs.dtype, out_dtype)
    out = plgpu.kernel(
        functools.partial(_kernel, geo=geo),
        out_type=jax.ShapeDtypeStruct((lhs_p.shape[0], n_tiles * bn), out_dtype),
        scratch_types=(smem, loaded, consumed),
        # Visits vary fastest: CTAs running together share their group's rhs columns.
        grid=(table.shape[0], n_tiles),
        grid_names=("visits", "n_tiles"),
        num_threads=2,
        thread_name="wg",
        kernel_name="grouped_matmul_transposed_rhs_hopper" if transpose_rhs else "grouped_matmul_hopper",
    )(table, lhs_p, rhs_p)
    rows = jnp.arange(m)[:, None]
    return jnp.where((rows >= bounds[0]) & (rows < bounds[-1]), out[:m, :n], 0).astype(out_dtype)

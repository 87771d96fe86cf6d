"""The Hopper (sm90) backward of flash attention, written for Mosaic GPU: TMA, wgmma and
warp specialisation, the counterpart of the forward in
:mod:`ember.kernels_pallas.flash_attention_mgpu`.

Two kernels, split as the Triton backward of
:mod:`ember.kernels_pallas.flash_attention_kernels` is:

- **dq**: one CTA per (query head, query tile of ``2 * block_q`` rows, batch row). Two
  compute warpgroups own ``block_q`` of the tile's rows each. Per key block they form
  ``S = Q K^T`` and ``dP = dO V^T`` by wgmma, ``P = exp(S * sm_scale - lse)`` and
  ``dS = P (dP - delta)`` in registers, then ``dQ += dS K`` by wgmma with ``dS`` straight
  from registers. A memory warpgroup streams the key and value blocks by TMA through a
  ring of ``stages`` shared-memory slots; a slot is refilled once both compute warpgroups
  have arrived on its "consumed" barrier.
- **dk/dv**: one CTA per (key head, key tile of ``2 * block_kv`` rows, batch row). Two
  compute warpgroups own ``block_kv`` key rows each, their K and V tiles resident in shared
  memory. The memory warpgroup streams the query-side blocks (Q, dO and the lse/delta
  rows) of *every query head of the key head's GQA group*, so ``dV += P^T dO`` and
  ``dK += dS^T Q`` accumulate per key head in f32 registers: memory does not grow with the
  group ratio, and no per-query-head partials are summed afterwards.

``delta = rowsum(dO * O)`` is computed by XLA beforehand and travels with ``lse * log2(e)``
as one ``[batch, heads, 2, q_len]`` f32 array, so each query block's rows are one TMA load.

Causal masking (top-left aligned, as everywhere in Ember) visits only the blocks on or
below the diagonal and masks the diagonal ones. Lengths that are not tile multiples are
padded outside: padded keys are masked in the dq kernel's last key block; padded query
rows get ``lse = +inf`` and ``dO = 0``, so they add exactly zero to dk and dv and need no
mask.

Which problems it runs is :func:`hopper_backward_supports` (the forward's conditions, with
this kernel's shared memory). Written against jax 0.11's
``jax.experimental.pallas.mosaic_gpu``, imported lazily like the forward's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ember.kernels_pallas.flash_attention_mgpu import (
    HopperBlockSizes,
    HopperGeometry,
    hopper_supports,
    visible_tile,
    walk_key_blocks,
)
from ember.kernels_pallas.hopper import feed_ring, tma_transforms, warp_specialized
from ember.kernels_pallas.sequence_padding import pad_axis_to_multiple, round_up

_LOG2_E = math.log2(math.e)
_COMPUTE_WARPGROUPS = 2
# Per compute warpgroup the dq kernel holds S, dP and dQ, the dk/dv kernel S^T, dP^T, dK and
# dV in f32 registers: key blocks of 64 keep that under the 232 registers a thread gets.
DEFAULT_HOPPER_BACKWARD_BLOCKS = HopperBlockSizes(block_q=64, block_kv=64, stages=2)


def backward_smem_bytes(blocks: HopperBlockSizes, head_dim: int, itemsize: int) -> int:
    """Shared memory of the larger of the two kernels' CTAs."""
    rows = 2 * 4  # lse and delta rows, f32
    dq = (2 * _COMPUTE_WARPGROUPS * blocks.block_q + 2 * blocks.stages * blocks.block_kv) * head_dim * itemsize
    dq += _COMPUTE_WARPGROUPS * blocks.block_q * rows
    dkv = (2 * _COMPUTE_WARPGROUPS * blocks.block_kv + 2 * blocks.stages * blocks.block_q) * head_dim * itemsize
    dkv += blocks.stages * blocks.block_q * rows
    return max(dq, dkv)


def hopper_backward_supports(problem, dtype, blocks: HopperBlockSizes = DEFAULT_HOPPER_BACKWARD_BLOCKS) -> str | None:
    """None when the Hopper backward computes ``problem``'s gradients in ``dtype`` with
    ``blocks``, else the reason it does not: the forward's conditions
    (:func:`~ember.kernels_pallas.flash_attention_mgpu.hopper_supports`) with this
    kernel's shared memory."""
    smem = backward_smem_bytes(blocks, problem.head_dim, jnp.dtype(dtype).itemsize)
    return hopper_supports(problem, dtype, blocks, smem_bytes=smem)


def _wait_all(*barriers):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for barrier in barriers:
        plgpu.barrier_wait(barrier)


def _zeros(shape):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _row_vector(ref, axis: int):
    """A ``[block]`` f32 row of shared memory in the layout that broadcasts along ``axis``
    of a wgmma result."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(axis))


def _pair_products(a, b_first, b_second, shape):
    """``(a_0 @ b_first, a_1 @ b_second)`` by two wgmmas awaited together; ``a`` is a pair
    of shared-memory operands, the ``b`` operands transposed views."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def products(refs):
        first, second = refs
        plgpu.wgmma(first, a[0], b_first)
        plgpu.wgmma(second, a[1], b_second)

    return pl.run_state(products)((plgpu.ACC.init(_zeros(shape)), plgpu.ACC.init(_zeros(shape))))


# ----------------------------------------------------------------------------- dq


class _DqShared(NamedTuple):
    """The dq CTA's shared memory and barriers (see :func:`_dq_scratch`)."""

    q: object  # [2, block_q, head_dim]: each compute warpgroup's Q tile, then its dQ tile
    do: object  # [2, block_q, head_dim]
    rows: object  # [2, 2, block_q] f32: each warpgroup's lse * log2(e) and delta rows
    k: object  # [stages, block_kv, head_dim], the ring of key blocks
    v: object  # [stages, block_kv, head_dim]
    q_loaded: object  # [2] barriers, one per compute warpgroup
    do_loaded: object
    rows_loaded: object
    k_loaded: object  # [stages] barriers: a slot's block has landed
    v_loaded: object
    consumed: object  # [stages] barriers of two arrivals: both warpgroups are done with a slot


def _dq_block(geo: HopperGeometry, shared: _DqShared, wg, row_start, kv_step, carry, masked: bool):
    """One key block for one compute warpgroup: ``dQ += dS K``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    dq, lse2, delta = carry
    bq, bkv = geo.blocks.block_q, geo.blocks.block_kv
    slot = lax.rem(kv_step, jnp.int32(geo.blocks.stages))
    _wait_all(shared.k_loaded.at[slot], shared.v_loaded.at[slot])
    scores, dp = _pair_products(
        (shared.q.at[wg], shared.do.at[wg]),
        shared.k.at[slot].transpose((1, 0)),
        shared.v.at[slot].transpose((1, 0)),
        (bq, bkv),
    )
    p = jnp.exp2(scores * (geo.sm_scale * _LOG2_E) - lax.broadcast_in_dim(lse2, (bq, bkv), [0]))
    if masked:
        p = jnp.where(visible_tile(geo, row_start, kv_step), p, 0.0)
    ds = p * (dp - lax.broadcast_in_dim(delta, (bq, bkv), [0]))

    def accumulate(acc_ref):
        plgpu.wgmma(acc_ref, ds.astype(geo.dtype), shared.k.at[slot])

    dq = pl.run_state(accumulate)(plgpu.ACC.init(dq))
    plgpu.barrier_arrive(shared.consumed.at[slot])
    return dq, lse2, delta


def _dq_skip_block(geo: HopperGeometry, shared: _DqShared, kv_step):
    """A key block only the other compute warpgroup visits (causal): observe its loads and
    release the slot."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    slot = lax.rem(kv_step, jnp.int32(geo.blocks.stages))
    _wait_all(shared.k_loaded.at[slot], shared.v_loaded.at[slot])
    plgpu.barrier_arrive(shared.consumed.at[slot])


def _dq_warpgroup(geo: HopperGeometry, shared: _DqShared, wg, tile, q_ref, do_ref, rows_ref, dq_ref):
    """One compute warpgroup: its ``block_q`` rows against every key block they see, then
    ``dQ * sm_scale`` stored by TMA."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bq = geo.blocks.block_q
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    plgpu.set_max_registers(232, action="increase")
    row_start = tile * (2 * bq) + wg * bq
    steps, all_steps = geo.kv_steps(row_start + bq), geo.kv_steps((tile + 1) * (2 * bq))
    tile_rows = (batch, pl.ds(row_start, bq), head)
    q_smem, rows_smem = shared.q.at[wg], shared.rows.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[tile_rows], q_smem, shared.q_loaded.at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[tile_rows], shared.do.at[wg], shared.do_loaded.at[wg])
    plgpu.copy_gmem_to_smem(rows_ref.at[batch, head, :, pl.ds(row_start, bq)], rows_smem, shared.rows_loaded.at[wg])
    _wait_all(shared.q_loaded.at[wg], shared.do_loaded.at[wg], shared.rows_loaded.at[wg])
    carry = (_zeros((bq, geo.head_dim)), _row_vector(rows_smem.at[0], 1), _row_vector(rows_smem.at[1], 1))

    def blocks(masked: bool):
        return lambda kv_step, carry: _dq_block(geo, shared, wg, row_start, kv_step, carry, masked)

    skip = functools.partial(_dq_skip_block, geo, shared)
    carry = walk_key_blocks(geo, row_start, (steps, all_steps), blocks, skip, carry)

    q_smem[...] = (carry[0] * geo.sm_scale).astype(geo.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[tile_rows])
    plgpu.wait_smem_to_gmem(0)


def _dq_memory_warpgroup(geo: HopperGeometry, shared: _DqShared, tile, k_ref, v_ref):
    """The TMA producer of the dq kernel: the tile's key and value blocks through the ring."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bq, bkv, stages = geo.blocks.block_q, geo.blocks.block_kv, geo.blocks.stages
    plgpu.set_max_registers(40, action="decrease")
    batch = lax.axis_index("batch")
    kv_head = lax.div(lax.axis_index("heads"), jnp.int32(geo.group))
    all_steps = geo.kv_steps((tile + 1) * (2 * bq))

    def load(kv_step, slot):
        rows = (batch, pl.ds(kv_step * bkv, bkv), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], shared.k.at[slot], shared.k_loaded.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], shared.v.at[slot], shared.v_loaded.at[slot])

    feed_ring(load, all_steps, stages, shared.consumed, max_steps=geo.num_kv_blocks)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, dq_ref, smem, loaded, consumed, *, geo, num_tiles):
    shared = _DqShared(*smem, *loaded, consumed)
    tile = lax.axis_index("q_tiles")
    if geo.causal:  # the longest tiles first: a shorter tail of the grid
        tile = num_tiles - 1 - tile
    warp_specialized(
        lambda wg: _dq_warpgroup(geo, shared, wg, tile, q_ref, do_ref, rows_ref, dq_ref),
        lambda: _dq_memory_warpgroup(geo, shared, tile, k_ref, v_ref),
        _COMPUTE_WARPGROUPS,
    )


def _dq_scratch(geo: HopperGeometry):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bq, bkv, stages, d = geo.blocks.block_q, geo.blocks.block_kv, geo.blocks.stages, geo.head_dim
    tiles = tma_transforms()
    smem = (
        plgpu.SMEM((_COMPUTE_WARPGROUPS, bq, d), geo.dtype, transforms=tiles),
        plgpu.SMEM((_COMPUTE_WARPGROUPS, bq, d), geo.dtype, transforms=tiles),
        plgpu.SMEM((_COMPUTE_WARPGROUPS, 2, bq), jnp.float32),
        plgpu.SMEM((stages, bkv, d), geo.dtype, transforms=tiles),
        plgpu.SMEM((stages, bkv, d), geo.dtype, transforms=tiles),
    )
    per_warpgroup = (plgpu.Barrier(num_barriers=_COMPUTE_WARPGROUPS),) * 3
    per_slot = (plgpu.Barrier(num_barriers=stages),) * 2
    consumed = plgpu.Barrier(num_arrivals=_COMPUTE_WARPGROUPS, num_barriers=stages)
    return smem, per_warpgroup + per_slot, consumed


# ----------------------------------------------------------------------------- dk/dv


@dataclasses.dataclass(frozen=True)
class _KeyGeometry:
    """Static sizes of the dk/dv kernel: ``q_len`` is the real query count (the query
    blocks past it are never read)."""

    group: int
    head_dim: int
    q_len: int
    causal: bool
    sm_scale: float
    dtype: jnp.dtype
    blocks: HopperBlockSizes

    @property
    def num_q_blocks(self) -> int:
        return -(-self.q_len // self.blocks.block_q)

    def first_q_block(self, key_start):
        """The first query block any row of which sees a key from ``key_start`` on."""
        if not self.causal:
            return jnp.int32(0)
        return jnp.minimum(lax.div(key_start, jnp.int32(self.blocks.block_q)), self.num_q_blocks)

    def first_unmasked(self, key_start):
        """The first query block that sees all ``block_kv`` keys from ``key_start``: its
        first row is at or past the last of them."""
        if not self.causal:
            return jnp.int32(0)
        last_key = key_start + self.blocks.block_kv - 1
        return jnp.minimum(pl.cdiv(last_key, self.blocks.block_q), self.num_q_blocks)


class _DkvShared(NamedTuple):
    """The dk/dv CTA's shared memory and barriers (see :func:`_dkv_scratch`)."""

    k: object  # [2, block_kv, head_dim]: each compute warpgroup's K tile, then its dK tile
    v: object  # [2, block_kv, head_dim]: V, then dV
    q: object  # [stages, block_q, head_dim], the ring of query blocks
    do: object  # [stages, block_q, head_dim]
    rows: object  # [stages, 2, block_q] f32: lse * log2(e) and delta
    k_loaded: object  # [2] barriers, one per compute warpgroup
    v_loaded: object
    q_loaded: object  # [stages] barriers
    do_loaded: object
    rows_loaded: object
    consumed: object  # [stages] barriers of two arrivals


def _dkv_block(geo: _KeyGeometry, shared: _DkvShared, wg, key_start, step, q_block, carry, masked: bool):
    """One query block (of one query head) for one compute warpgroup: ``dV += P^T dO``,
    ``dK += dS^T Q``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    dk, dv = carry
    bq, bkv = geo.blocks.block_q, geo.blocks.block_kv
    slot = lax.rem(step, jnp.int32(geo.blocks.stages))
    _wait_all(shared.q_loaded.at[slot], shared.do_loaded.at[slot], shared.rows_loaded.at[slot])
    scores_t, dp_t = _pair_products(
        (shared.k.at[wg], shared.v.at[wg]),
        shared.q.at[slot].transpose((1, 0)),
        shared.do.at[slot].transpose((1, 0)),
        (bkv, bq),
    )
    lse2, delta = _row_vector(shared.rows.at[slot, 0], 0), _row_vector(shared.rows.at[slot, 1], 0)
    p_t = jnp.exp2(scores_t * (geo.sm_scale * _LOG2_E) - lax.broadcast_in_dim(lse2, (bkv, bq), [1]))
    if masked:
        shape = (bkv, bq)
        keys = key_start + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        rows = q_block * bq + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        p_t = jnp.where(keys <= rows, p_t, 0.0)
    ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, (bkv, bq), [1]))

    def accumulate(refs):
        dk_ref, dv_ref = refs
        plgpu.wgmma(dv_ref, p_t.astype(geo.dtype), shared.do.at[slot])
        plgpu.wgmma(dk_ref, ds_t.astype(geo.dtype), shared.q.at[slot])

    dk, dv = pl.run_state(accumulate)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))
    plgpu.barrier_arrive(shared.consumed.at[slot])
    return dk, dv


def _dkv_skip_block(geo: _KeyGeometry, shared: _DkvShared, step):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    slot = lax.rem(step, jnp.int32(geo.blocks.stages))
    _wait_all(shared.q_loaded.at[slot], shared.do_loaded.at[slot], shared.rows_loaded.at[slot])
    plgpu.barrier_arrive(shared.consumed.at[slot])


def _dkv_warpgroup(geo: _KeyGeometry, shared: _DkvShared, wg, tile, k_ref, v_ref, dk_ref, dv_ref):
    """One compute warpgroup: its ``block_kv`` keys against every query block, of every
    query head of the group, that sees them; then ``dK * sm_scale`` and ``dV`` by TMA."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bkv = geo.blocks.block_kv
    batch, kv_head = lax.axis_index("batch"), lax.axis_index("kv_heads")
    plgpu.set_max_registers(232, action="increase")
    tile_start = tile * (2 * bkv)
    key_start = tile_start + wg * bkv
    tile_rows = (batch, pl.ds(key_start, bkv), kv_head)
    k_smem, v_smem = shared.k.at[wg], shared.v.at[wg]
    plgpu.copy_gmem_to_smem(k_ref.at[tile_rows], k_smem, shared.k_loaded.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[tile_rows], v_smem, shared.v_loaded.at[wg])
    _wait_all(shared.k_loaded.at[wg], shared.v_loaded.at[wg])

    # The CTA's steps run over (query head of the group, query block from tile_first on).
    tile_first, first = geo.first_q_block(tile_start), geo.first_q_block(key_start)
    unmasked_from = geo.first_unmasked(key_start)
    per_head = geo.num_q_blocks - tile_first

    def head_blocks(member, carry):
        base = member * per_head - tile_first  # step of query block i: base + i

        def blocks(masked: bool):
            return lambda i, carry: _dkv_block(geo, shared, wg, key_start, base + i, i, carry, masked)

        if geo.causal:
            lax.fori_loop(tile_first, first, lambda i, _: _dkv_skip_block(geo, shared, base + i), None)
            carry = lax.fori_loop(first, unmasked_from, blocks(masked=True), carry)
        return lax.fori_loop(unmasked_from, geo.num_q_blocks, blocks(masked=False), carry)

    zeros = _zeros((bkv, geo.head_dim))
    dk, dv = lax.fori_loop(0, geo.group, head_blocks, (zeros, zeros))
    k_smem[...] = (dk * geo.sm_scale).astype(geo.dtype)
    v_smem[...] = dv.astype(geo.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[tile_rows], commit_group=False)
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[tile_rows], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)


def _dkv_memory_warpgroup(geo: _KeyGeometry, shared: _DkvShared, tile, q_ref, do_ref, rows_ref):
    """The TMA producer of the dk/dv kernel: for each query head of the group in turn, the
    query blocks that see the tile's keys, through the ring."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bq, bkv, stages = geo.blocks.block_q, geo.blocks.block_kv, geo.blocks.stages
    plgpu.set_max_registers(40, action="decrease")
    batch = lax.axis_index("batch")
    first_head = lax.axis_index("kv_heads") * geo.group
    tile_first = geo.first_q_block(tile * (2 * bkv))
    per_head = geo.num_q_blocks - tile_first
    total = geo.group * per_head

    def load(step, slot):
        head = first_head + lax.div(step, per_head)
        rows = pl.ds((tile_first + lax.rem(step, per_head)) * bq, bq)
        plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], shared.q.at[slot], shared.q_loaded.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], shared.do.at[slot], shared.do_loaded.at[slot])
        plgpu.copy_gmem_to_smem(rows_ref.at[batch, head, :, rows], shared.rows.at[slot], shared.rows_loaded.at[slot])

    feed_ring(load, total, stages, shared.consumed)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, dk_ref, dv_ref, smem, loaded, consumed, *, geo):
    shared = _DkvShared(*smem, *loaded, consumed)
    tile = lax.axis_index("kv_tiles")  # causal: the first tiles see the most query blocks
    warp_specialized(
        lambda wg: _dkv_warpgroup(geo, shared, wg, tile, k_ref, v_ref, dk_ref, dv_ref),
        lambda: _dkv_memory_warpgroup(geo, shared, tile, q_ref, do_ref, rows_ref),
        _COMPUTE_WARPGROUPS,
    )


def _dkv_scratch(geo: _KeyGeometry):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bq, bkv, stages, d = geo.blocks.block_q, geo.blocks.block_kv, geo.blocks.stages, geo.head_dim
    tiles = tma_transforms()
    smem = (
        plgpu.SMEM((_COMPUTE_WARPGROUPS, bkv, d), geo.dtype, transforms=tiles),
        plgpu.SMEM((_COMPUTE_WARPGROUPS, bkv, d), geo.dtype, transforms=tiles),
        plgpu.SMEM((stages, bq, d), geo.dtype, transforms=tiles),
        plgpu.SMEM((stages, bq, d), geo.dtype, transforms=tiles),
        plgpu.SMEM((stages, 2, bq), jnp.float32),
    )
    per_warpgroup = (plgpu.Barrier(num_barriers=_COMPUTE_WARPGROUPS),) * 2
    per_slot = (plgpu.Barrier(num_barriers=stages),) * 3
    consumed = plgpu.Barrier(num_arrivals=_COMPUTE_WARPGROUPS, num_barriers=stages)
    return smem, per_warpgroup + per_slot, consumed


# ----------------------------------------------------------------------------- entry


def _query_rows(lse, out, d_out, q_len: int, multiple: int):
    """``[batch, heads, 2, padded q_len]`` f32: ``lse * log2(e)`` (padded rows ``+inf``, so
    their weights are 0) and ``delta = rowsum(dO * O)`` (padded rows 0)."""
    lse2 = pad_axis_to_multiple(lse[:, :, :q_len] * _LOG2_E, 2, multiple, value=jnp.inf)
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    return jnp.stack([lse2, pad_axis_to_multiple(delta, 2, multiple)], axis=2)


def hopper_backward(
    q,
    k,
    v,
    out,
    lse,
    d_out,
    *,
    causal: bool,
    sm_scale: float,
    blocks: HopperBlockSizes = DEFAULT_HOPPER_BACKWARD_BLOCKS,
):
    """Softmax attention's gradients on an sm90 GPU (callers check
    :func:`hopper_backward_supports`).

    Args:
      q, d_out, out: ``[batch, q_len, heads, head_dim]``; k, v: ``[batch, kv_len, kv_heads,
        head_dim]``; q, k, v one dtype; ``heads % kv_heads == 0``.
      lse: ``[batch, heads, >= q_len]`` f32, the forward's natural-log log-sum-exp of each
        query row's scaled logits (rows past ``q_len`` are ignored).
      causal: top-left aligned causal mask.
      sm_scale: multiplies ``q.k`` (> 0).

    Returns:
      ``(dq, dk, dv)`` shaped and typed like ``q, k, v``.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    bq, bkv = blocks.block_q, blocks.block_kv
    dtype = jnp.dtype(q.dtype)
    q_multiple, kv_multiple = _COMPUTE_WARPGROUPS * bq, _COMPUTE_WARPGROUPS * bkv
    qp, dop = (pad_axis_to_multiple(x.astype(dtype), 1, q_multiple) for x in (q, d_out))
    kp, vp = (pad_axis_to_multiple(x, 1, kv_multiple) for x in (k, v))
    rows = _query_rows(lse, out, d_out, q_len, q_multiple)
    params = plgpu.CompilerParams(approx_math=True)

    dq_geo = HopperGeometry(
        group=heads // kv_heads,
        head_dim=head_dim,
        kv_len=kv_len,
        padded_kv_len=round_up(kv_len, bkv),  # key blocks wholly past kv_len are not visited
        causal=causal,
        sm_scale=float(sm_scale),
        dtype=dtype,
        blocks=blocks,
    )
    num_q_tiles = qp.shape[1] // q_multiple
    smem, loaded, consumed = _dq_scratch(dq_geo)
    dq = plgpu.kernel(
        functools.partial(_dq_kernel, geo=dq_geo, num_tiles=num_q_tiles),
        out_type=jax.ShapeDtypeStruct(qp.shape, dtype),
        scratch_types=(smem, loaded, consumed),
        grid=(heads, num_q_tiles, batch),
        grid_names=("heads", "q_tiles", "batch"),
        num_threads=_COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        kernel_name="flash_attention_dq_hopper",
        compiler_params=params,
    )(qp, kp, vp, dop, rows)

    dkv_geo = _KeyGeometry(
        group=heads // kv_heads,
        head_dim=head_dim,
        q_len=q_len,
        causal=causal,
        sm_scale=float(sm_scale),
        dtype=dtype,
        blocks=blocks,
    )
    smem, loaded, consumed = _dkv_scratch(dkv_geo)
    dk, dv = plgpu.kernel(
        functools.partial(_dkv_kernel, geo=dkv_geo),
        out_type=(jax.ShapeDtypeStruct(kp.shape, dtype), jax.ShapeDtypeStruct(vp.shape, dtype)),
        scratch_types=(smem, loaded, consumed),
        grid=(kv_heads, kp.shape[1] // kv_multiple, batch),
        grid_names=("kv_heads", "kv_tiles", "batch"),
        num_threads=_COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        kernel_name="flash_attention_dkv_hopper",
        compiler_params=params,
    )(qp, kp, vp, dop, rows)
    return dq[:, :q_len], dk[:, :kv_len].astype(k.dtype), dv[:, :kv_len].astype(v.dtype)

"""Kernel bodies of the TPU (Mosaic TPU) flash attention, and the tile math they share.

The ``pallas_call`` s around them (grids, block specs, the scalar-prefetched block tables,
``custom_vjp``) are in :mod:`ember.kernels_pallas.flash_attention_tpu`, which says how the
data is laid out. Here each body sees VMEM tiles:

- forward and dq, one program per (batch, head, query block, live key-block slot): ``q``,
  ``dO`` ``[block_q, head_dim]``, ``k``, ``v`` ``[block_kv, head_dim]``, and the scores
  tile ``[block_q, block_kv]`` (keys along the lanes);
- dk/dv, one program per (batch, key head, key block, query head of the group, live
  query-block slot): the *transposed* scores tile ``[block_kv, block_q]`` (queries along
  the lanes), so that ``dv += p @ dO`` and ``dk += ds @ q`` are plain MXU matmuls.

Per-query values (log-sum-exp, ``delta``) and the segment ids/positions come as lane- or
sublane-broadcast tiles: a *column* ``[rows, 128]`` when the query (or key) runs along the
sublanes, a *row* ``[8, cols]`` when it runs along the lanes; a body reads ``[:, :1]`` or
``[:1, :]`` of it. Accumulators are f32 VMEM scratch carried across the grid's last
("arbitrary") axes: set at the first step, written out at the last. Steps past a block's
live count do nothing (their tables repeat the last live block, so nothing is fetched).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ember.kernels_pallas.attention_math import soft_cap
from ember.kernels_pallas.block_mask import (
    BlockMask,
    LiveBlocks,
    MaskIntersection,
    document_live_bound,
    live_block_grid,
)
from ember.kernels_pallas.online_softmax import online_softmax_result, online_softmax_step
from ember.kernels_pallas.sequence_padding import round_up

NUM_LANES = 128
NUM_SUBLANES = 8
_NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T


@dataclasses.dataclass(frozen=True)
class TpuKernelConfig:
    """Everything static about one TPU call (hashable: a ``custom_vjp`` non-diff argument).

    ``problem`` is the :class:`ember.kernels_pallas.flash_attention.AttentionProblem`;
    ``block_q`` and ``block_kv`` are multiples of 128; ``interpret`` is ``pallas_call`` 's
    argument (``False`` compiled, ``pltpu.InterpretParams()`` in TPU interpret mode).
    """

    problem: Any
    block_q: int
    block_kv: int
    interpret: Any

    @property
    def head_dim(self) -> int:
        """The head size the kernels run at: a multiple of the 128 lanes (zero columns add
        nothing to a logit; the output columns they make are dropped)."""
        return round_up(self.problem.head_dim, NUM_LANES)

    @property
    def padded_q_len(self) -> int:
        return round_up(self.problem.q_len, self.block_q)

    @property
    def padded_kv_len(self) -> int:
        return round_up(self.problem.kv_len, self.block_kv)

    @functools.cached_property
    def live(self) -> LiveBlocks:
        """The live blocks; with segment positions, every block that can be live (a bound)."""
        p = self.problem
        grid = document_live_bound if p.has_segment_positions else live_block_grid
        return LiveBlocks.from_grid(grid(p.mask, p.q_len, p.kv_len, self.block_q, self.block_kv))

    @functools.cached_property
    def predicate_masks(self) -> tuple[BlockMask, ...]:
        """The mask parts evaluated inside a live block (an explicit grid needs none)."""
        mask = self.problem.mask
        if mask is None:
            return ()
        if isinstance(mask, MaskIntersection):
            return mask.kernel_masks()
        return (mask,) if mask.in_block_predicate_needed() else ()


def _split_row_refs(problem, refs):
    """``(query-side refs, key-side refs, the rest)`` of a body's refs after its fixed
    inputs: each side ``(segment ids, segment positions)``, None where the call has none."""
    segments, refs = (refs[:2], refs[2:]) if problem.has_segments else ((None, None), refs)
    positions, refs = (refs[:2], refs[2:]) if problem.has_segment_positions else ((None, None), refs)
    return (segments[0], positions[0]), (segments[1], positions[1]), refs


def _columns(refs):
    """``[rows, 1]`` values of lane-broadcast column tiles (None stays None)."""
    return tuple(None if ref is None else ref[:, :1] for ref in refs)


def _rows(refs):
    """``[1, cols]`` values of sublane-broadcast row tiles (None stays None)."""
    return tuple(None if ref is None else ref[:1, :] for ref in refs)


def _per_row(ref):
    """A scratch tile's per-row value ``[rows]``, kept broadcast over its 128 lanes."""
    return ref[...][:, 0]


def _set_per_row(ref, values):
    ref[...] = jnp.broadcast_to(values[:, None], ref.shape)


def _table_row(ref):
    """Which row of a block table this program reads: its batch row's, or the shared one."""
    return pl.program_id(0) if ref.shape[0] > 1 else 0


def _tile_visible(config: TpuKernelConfig, q_pos, kv_pos, q_rows, kv_rows):
    """Bool tile: which (query, key) pairs may attend. ``q_pos``/``kv_pos`` int32 position
    tiles of either orientation; ``q_rows``/``kv_rows`` ``(segment ids, segment positions)``
    broadcastable to them (or None)."""
    (q_seg, q_seg_pos), (kv_seg, kv_seg_pos) = q_rows, kv_rows
    visible = kv_pos < config.problem.kv_len
    for mask in config.predicate_masks:
        if q_seg_pos is None:
            visible = visible & mask.visible(q_pos, kv_pos)
        else:
            visible = visible & mask.visible_at(q_pos, kv_pos, q_seg_pos, kv_seg_pos)
    if q_seg is not None:
        visible = visible & (q_seg == kv_seg)
    return visible


def _capped_logits(config: TpuKernelConfig, a, b):
    """Scaled, soft-capped logits ``a @ b.T`` (f32) of a query and a key tile (either order)."""
    logits = lax.dot_general(a, b, _NT_DIMS, preferred_element_type=jnp.float32) * config.problem.sm_scale
    return soft_cap(logits, config.problem.logits_soft_cap)


def _weights(config: TpuKernelConfig, capped, visible, lse):
    """Attention weights of a tile (masked entries exactly 0): sigmoid scores, or softmax
    weights from the forward's log-sum-exp ``lse`` (broadcastable; +inf for a query that
    sees no key, which makes its weights 0)."""
    if config.problem.score == "sigmoid":
        return jnp.where(visible, jax.nn.sigmoid(capped + config.problem.sigmoid_bias), 0.0)
    return jnp.where(visible, jnp.exp(capped - lse), 0.0)


def _score_grad(config: TpuKernelConfig, capped, weights, dp, delta):
    """d loss / d (scaled logits) of a tile, from the weights, ``dp = dO . v`` and the
    softmax row term ``delta`` (broadcastable)."""
    p = config.problem
    ds = weights * (1.0 - weights) * dp if p.score == "sigmoid" else weights * (dp - delta)
    if p.logits_soft_cap is not None:
        ds = ds * (1.0 - jnp.square(capped / p.logits_soft_cap))
    return ds


def _positions(shape, q_start, kv_start, *, q_axis: int):
    """``(q_pos, kv_pos)`` int32 tiles of ``shape``, queries along ``q_axis``."""
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    kv_pos = kv_start + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    return q_pos, kv_pos


def forward_kernel(kv_index_ref, kv_count_ref, q_ref, k_ref, v_ref, *refs, config: TpuKernelConfig):
    """One step of the forward: folds key block ``kv_index[i, t]`` into the running
    softmax (or sigmoid sum) of query block ``i``. Refs after the inputs: ``out``, ``lse``
    column ``[block_q, 128]``, optionally ``visits`` ``[8, 128]`` (steps computed), then
    scratch ``row_max``, ``row_sum`` ``[block_q, 128]`` and ``acc`` ``[block_q, head_dim]``."""
    p = config.problem
    q_refs, kv_refs, refs = _split_row_refs(p, refs)
    o_ref, lse_ref, *visits_ref, max_ref, sum_ref, acc_ref = refs
    i, t = pl.program_id(2), pl.program_id(3)
    row = _table_row(kv_count_ref)

    @pl.when(t == 0)
    def _init():
        max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        if visits_ref:
            visits_ref[0][...] = jnp.zeros(visits_ref[0].shape, jnp.int32)

    @pl.when(t < kv_count_ref[row, i])
    def _visit():
        shape = (config.block_q, config.block_kv)
        q_pos, kv_pos = _positions(shape, i * config.block_q, kv_index_ref[row, i, t] * config.block_kv, q_axis=0)
        visible = _tile_visible(config, q_pos, kv_pos, _columns(q_refs), _rows(kv_refs))
        capped = _capped_logits(config, q_ref[...], k_ref[...])
        v = v_ref[...]
        if p.score == "sigmoid":
            weights = _weights(config, capped, visible, lse=None)
            acc_ref[...] += jnp.dot(weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        else:
            carry = (_per_row(max_ref), _per_row(sum_ref), acc_ref[...])
            row_max, row_sum, acc = online_softmax_step(carry, capped, visible, v)
            _set_per_row(max_ref, row_max)
            _set_per_row(sum_ref, row_sum)
            acc_ref[...] = acc
        if visits_ref:
            visits_ref[0][...] += 1

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        if p.score == "sigmoid":
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)
            lse_ref[...] = jnp.zeros(lse_ref.shape, jnp.float32)  # no normalizer: the backward ignores it
            return
        o_ref[...] = online_softmax_result((_per_row(max_ref), _per_row(sum_ref), acc_ref[...])).astype(o_ref.dtype)
        row_max, row_sum = max_ref[...], sum_ref[...]
        # +inf for rows with no visible key: exp(s - lse) is then 0 in the backward.
        empty = row_sum == 0.0
        lse_ref[...] = jnp.where(empty, jnp.inf, row_max + jnp.log(jnp.where(empty, 1.0, row_sum)))


def dq_kernel(
    kv_index_ref, kv_count_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, config: TpuKernelConfig
):
    """One step of dq: adds key block ``kv_index[i, t]`` 's share ``ds @ k`` to query block
    ``i``. ``lse``/``delta``: columns ``[block_q, 128]``. Refs after the inputs: ``dq``, then
    scratch ``acc`` ``[block_q, head_dim]`` f32."""
    q_refs, kv_refs, (dq_ref, acc_ref) = _split_row_refs(config.problem, refs)
    i, t = pl.program_id(2), pl.program_id(3)
    row = _table_row(kv_count_ref)

    @pl.when(t == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(t < kv_count_ref[row, i])
    def _visit():
        shape = (config.block_q, config.block_kv)
        q_pos, kv_pos = _positions(shape, i * config.block_q, kv_index_ref[row, i, t] * config.block_kv, q_axis=0)
        visible = _tile_visible(config, q_pos, kv_pos, _columns(q_refs), _rows(kv_refs))
        k = k_ref[...]
        capped = _capped_logits(config, q_ref[...], k)
        weights = _weights(config, capped, visible, lse_ref[:, :1])
        dp = lax.dot_general(do_ref[...], v_ref[...], _NT_DIMS, preferred_element_type=jnp.float32)
        ds = _score_grad(config, capped, weights, dp, delta_ref[:, :1])
        acc_ref[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (acc_ref[...] * config.problem.sm_scale).astype(dq_ref.dtype)


def dkv_kernel(
    q_index_ref, q_count_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, config: TpuKernelConfig
):
    """One step of dk/dv: adds query block ``q_index[j, t]`` of query head ``g`` of the
    group to key block ``j`` 's ``dv += p @ dO`` and ``dk += ds @ q``, on the transposed
    scores ``[block_kv, block_q]``. ``lse``/``delta``: rows ``[8, block_q]``. Refs after the
    inputs: ``dk``, ``dv``, then scratch ``dk_acc``, ``dv_acc`` ``[block_kv, head_dim]`` f32."""
    q_refs, kv_refs, (dk_ref, dv_ref, dk_acc_ref, dv_acc_ref) = _split_row_refs(config.problem, refs)
    j, g, t = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    row = _table_row(q_count_ref)

    @pl.when((g == 0) & (t == 0))
    def _init():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

    @pl.when(t < q_count_ref[row, j])
    def _visit():
        shape = (config.block_kv, config.block_q)
        q_pos, kv_pos = _positions(shape, q_index_ref[row, j, t] * config.block_q, j * config.block_kv, q_axis=1)
        visible = _tile_visible(config, q_pos, kv_pos, _rows(q_refs), _columns(kv_refs))
        q, do = q_ref[...], do_ref[...]
        capped = _capped_logits(config, k_ref[...], q)
        weights = _weights(config, capped, visible, lse_ref[:1, :])
        dv_acc_ref[...] += jnp.dot(weights.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dp = lax.dot_general(v_ref[...], do, _NT_DIMS, preferred_element_type=jnp.float32)
        ds = _score_grad(config, capped, weights, dp, delta_ref[:1, :])
        dk_acc_ref[...] += jnp.dot(ds.astype(q.dtype), q, preferred_element_type=jnp.float32)

    @pl.when((g == pl.num_programs(3) - 1) & (t == pl.num_programs(4) - 1))
    def _finish():
        dk_ref[...] = (dk_acc_ref[...] * config.problem.sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)

"""Kernel bodies of the TPU (Mosaic TPU) flash attention (their tile math is
:mod:`ember.kernels_pallas.flash_attention_tiles`, shared with the GPU kernels).

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
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ember.kernels_pallas.flash_attention_tiles import (
    AttentionBlocks,
    capped_logits,
    score_grad,
    split_row_refs,
    tile_positions,
    tile_visible,
    tile_weights,
)
from ember.kernels_pallas.online_softmax import (
    online_softmax_lse,
    online_softmax_result,
    online_softmax_step,
    per_row,
    set_per_row,
)
from ember.kernels_pallas.sequence_padding import round_up

NUM_LANES = 128
NUM_SUBLANES = 8
_NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T


@dataclasses.dataclass(frozen=True)
class TpuKernelConfig(AttentionBlocks):
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


def _columns(refs):
    """``[rows, 1]`` values of lane-broadcast column tiles (None stays None)."""
    return tuple(None if ref is None else ref[:, :1] for ref in refs)


def _rows(refs):
    """``[1, cols]`` values of sublane-broadcast row tiles (None stays None)."""
    return tuple(None if ref is None else ref[:1, :] for ref in refs)


def _table_row(ref):
    """Which row of a block table this program reads: its batch row's, or the shared one."""
    return pl.program_id(0) if ref.shape[0] > 1 else 0


def forward_kernel(kv_index_ref, kv_count_ref, q_ref, k_ref, v_ref, *refs, config: TpuKernelConfig):
    """One step of the forward: folds key block ``kv_index[i, t]`` into the running
    softmax (or sigmoid sum) of query block ``i``. Refs after the inputs: ``out``, ``lse``
    column ``[block_q, 128]``, optionally ``visits`` ``[8, 128]`` (steps computed), then
    scratch ``row_max``, ``row_sum`` ``[block_q, 128]`` and ``acc`` ``[block_q, head_dim]``."""
    p = config.problem
    q_refs, kv_refs, refs = split_row_refs(p, refs)
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
        q_pos, kv_pos = tile_positions(shape, i * config.block_q, kv_index_ref[row, i, t] * config.block_kv, q_axis=0)
        visible = tile_visible(config, q_pos, kv_pos, _columns(q_refs), _rows(kv_refs))
        capped = capped_logits(config, q_ref[...], k_ref[...])
        v = v_ref[...]
        if p.score == "sigmoid":
            weights = tile_weights(config, capped, visible, lse=None)
            acc_ref[...] += jnp.dot(weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        else:
            carry = (per_row(max_ref), per_row(sum_ref), acc_ref[...])
            row_max, row_sum, acc = online_softmax_step(carry, capped, visible, v)
            set_per_row(max_ref, row_max)
            set_per_row(sum_ref, row_sum)
            acc_ref[...] = acc
        if visits_ref:
            visits_ref[0][...] += 1

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        if p.score == "sigmoid":
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)
            lse_ref[...] = jnp.zeros(lse_ref.shape, jnp.float32)  # no normalizer: the backward ignores it
            return
        o_ref[...] = online_softmax_result((per_row(max_ref), per_row(sum_ref), acc_ref[...])).astype(o_ref.dtype)
        lse_ref[...] = online_softmax_lse(max_ref[...], sum_ref[...])


def dq_kernel(
    kv_index_ref, kv_count_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, config: TpuKernelConfig
):
    """One step of dq: adds key block ``kv_index[i, t]`` 's share ``ds @ k`` to query block
    ``i``. ``lse``/``delta``: columns ``[block_q, 128]``. Refs after the inputs: ``dq``, then
    scratch ``acc`` ``[block_q, head_dim]`` f32."""
    q_refs, kv_refs, (dq_ref, acc_ref) = split_row_refs(config.problem, refs)
    i, t = pl.program_id(2), pl.program_id(3)
    row = _table_row(kv_count_ref)

    @pl.when(t == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(t < kv_count_ref[row, i])
    def _visit():
        shape = (config.block_q, config.block_kv)
        q_pos, kv_pos = tile_positions(shape, i * config.block_q, kv_index_ref[row, i, t] * config.block_kv, q_axis=0)
        visible = tile_visible(config, q_pos, kv_pos, _columns(q_refs), _rows(kv_refs))
        k = k_ref[...]
        capped = capped_logits(config, q_ref[...], k)
        weights = tile_weights(config, capped, visible, lse_ref[:, :1])
        dp = lax.dot_general(do_ref[...], v_ref[...], _NT_DIMS, preferred_element_type=jnp.float32)
        ds = score_grad(config, capped, weights, dp, delta_ref[:, :1])
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
    q_refs, kv_refs, (dk_ref, dv_ref, dk_acc_ref, dv_acc_ref) = split_row_refs(config.problem, refs)
    j, g, t = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    row = _table_row(q_count_ref)

    @pl.when((g == 0) & (t == 0))
    def _init():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

    @pl.when(t < q_count_ref[row, j])
    def _visit():
        shape = (config.block_kv, config.block_q)
        q_pos, kv_pos = tile_positions(shape, q_index_ref[row, j, t] * config.block_q, j * config.block_kv, q_axis=1)
        visible = tile_visible(config, q_pos, kv_pos, _rows(q_refs), _columns(kv_refs))
        q, do = q_ref[...], do_ref[...]
        capped = capped_logits(config, k_ref[...], q)
        weights = tile_weights(config, capped, visible, lse_ref[:1, :])
        dv_acc_ref[...] += jnp.dot(weights.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dp = lax.dot_general(v_ref[...], do, _NT_DIMS, preferred_element_type=jnp.float32)
        ds = score_grad(config, capped, weights, dp, delta_ref[:1, :])
        dk_acc_ref[...] += jnp.dot(ds.astype(q.dtype), q, preferred_element_type=jnp.float32)

    @pl.when((g == pl.num_programs(3) - 1) & (t == pl.num_programs(4) - 1))
    def _finish():
        dk_ref[...] = (dk_acc_ref[...] * config.problem.sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)

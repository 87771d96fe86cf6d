"""Pallas kernels of :func:`ember.kernels_pallas.flash_attention.flash_attention`.

Three kernels tied together by ``custom_vjp``:

- forward: grid ``(batch, heads, q_blocks)``; each program streams the *live* key blocks of
  its query block (online softmax, or plain sums for sigmoid scores) and saves the
  log-sum-exp ``[batch, heads, q_len]`` for the backward;
- dq: grid ``(batch, heads, q_blocks)``, streams the same live key blocks;
- dk/dv: grid ``(batch, kv_heads, kv_blocks)``, streams the live query blocks of its key
  block for every query head of its GQA group, accumulating dk/dv per key head in f32
  (backward memory does not grow with the group ratio).

Which blocks are live comes from the mask description
(:func:`ember.kernels_pallas.block_mask.live_block_grid`) and reaches the kernels as small
int32 tables ``[batch or 1, rows, width]`` whose row is ``[count, index_0, index_1, ...]``.
Dead blocks are never loaded or multiplied, so cost follows the number of live blocks. The
tables are static unless the mask reads segment positions (per-document global tokens):
then they are built per batch row from the positions
(:func:`ember.kernels_pallas.block_mask.document_live_grid`), sized for a static bound.
Inside a live block the mask predicate (causal, window, ..., key padding, segment ids,
segment positions) is evaluated on position iotas. That and the rest of the tile math
(logits, weights, score gradients) is :mod:`ember.kernels_pallas.flash_attention_tiles`,
shared with the TPU kernels.

Layout stays ``[batch, seq, heads, head_dim]`` (no transposes): a program sees one head's
``[block, head_dim]`` tiles. Keys/values for a program are its head's whole
``[kv_len, head_dim]`` slab, read a tile at a time with dynamic slices, as GPU (Triton)
kernels do. Sequences are padded to block multiples outside and masked inside.

On an sm90 (Hopper) GPU the forward of the problems it supports (softmax, no mask or
causal, bf16/f16, head_dim padded to 64 or 128) is instead the Mosaic GPU kernel of
:mod:`ember.kernels_pallas.flash_attention_mgpu` (TMA, wgmma, warp specialisation); it
saves the same log-sum-exp, so either forward pairs with either backward. The Hopper
backward (:mod:`ember.kernels_pallas.flash_attention_mgpu_backward`) covers the same
problems. :mod:`ember.kernels_pallas.flash_attention_routing` makes both choices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ember.kernels_pallas.block_mask import (
    CausalMask,
    LiveBlocks,
    document_live_bound,
    document_live_grid,
    traced_live_lists,
)
from ember.kernels_pallas.dispatch import triton_compiler_params
from ember.kernels_pallas.flash_attention_mgpu import DEFAULT_HOPPER_BLOCKS, HopperBlockSizes, hopper_forward
from ember.kernels_pallas.flash_attention_mgpu_backward import DEFAULT_HOPPER_BACKWARD_BLOCKS, hopper_backward
from ember.kernels_pallas.flash_attention_routing import backward_kernel, forward_kernel
from ember.kernels_pallas.flash_attention_tiles import (
    AttentionBlocks,
    attention_vjp,
    capped_logits,
    score_grad,
    split_row_refs,
    tile_positions,
    tile_visible,
    tile_weights,
)
from ember.kernels_pallas.hopper import GpuInfo
from ember.kernels_pallas.online_softmax import (
    online_softmax_init,
    online_softmax_lse,
    online_softmax_result,
    online_softmax_step,
)
from ember.kernels_pallas.sequence_padding import pad_axis_to_multiple

_NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
_TN_DIMS = (((0,), (0,)), ((), ()))  # a.T @ b


@dataclasses.dataclass(frozen=True)
class KernelConfig(AttentionBlocks):
    """Everything static about one call (hashable: a ``custom_vjp`` non-diff argument).

    ``problem`` is the :class:`ember.kernels_pallas.flash_attention.AttentionProblem`, its
    ``head_dim`` already the padded one the kernels run at (:func:`padded_head_dim`).
    """

    problem: object
    block_q: int
    block_kv: int
    interpret: bool
    num_warps: int | None = None  # None: by head_dim
    num_stages: int = 2
    hopper_blocks: HopperBlockSizes | None = None  # the Hopper forward's tiles; None: Triton's
    hopper_backward_blocks: HopperBlockSizes | None = None  # the Hopper backward's; None: Triton's
    backward_block_kv: int | None = None  # the Triton backward's key tile; None: block_kv
    backward_num_warps: int | None = None  # the Triton backward's warps; None: num_warps

    @property
    def head_dim(self) -> int:
        return self.problem.head_dim

    def for_backward(self) -> KernelConfig:
        """This config with the Triton backward kernels' tiles and warps (same ``block_q``,
        so the forward's ``lse`` rows line up)."""
        return dataclasses.replace(
            self,
            block_kv=self.backward_block_kv or self.block_kv,
            num_warps=self.backward_num_warps or self.num_warps,
        )


def _table_width(indices: np.ndarray) -> int:
    """A power of two (GPU tiles want them) > ``indices.shape[1]``, so the count fits too."""
    return 1 << indices.shape[1].bit_length()


def _count_table(indices: np.ndarray, counts: np.ndarray) -> jax.Array:
    """``[1, rows, _table_width]`` int32 rows ``[count, index_0, ..., padding]``."""
    width = _table_width(indices)
    table = np.zeros((indices.shape[0], width), dtype=np.int32)
    table[:, 0] = counts
    table[:, 1 : 1 + indices.shape[1]] = indices
    table[:, 1 + indices.shape[1] :] = indices[:, -1:]
    return jnp.asarray(table)[None]


def _traced_count_table(live: jax.Array, bound: np.ndarray) -> jax.Array:
    """The table of a traced grid ``live [batch, rows, cols]`` (inside the static ``bound
    [rows, cols]``): ``[batch, rows, _table_width]``, rows as in :func:`_count_table`."""
    width = _table_width(LiveBlocks.from_grid(bound).kv_indices)
    indices, counts = traced_live_lists(live, width - 1)
    return jnp.concatenate([counts[..., None], indices], axis=-1)


def _block_tables(config: KernelConfig, rows) -> tuple[jax.Array, jax.Array]:
    """``(kv_table, q_table)``: per query block its live key blocks (forward, dq), per key
    block its live query blocks (dk/dv); ``[1 or batch, rows, width]`` int32."""
    if not config.problem.has_segment_positions:
        live = config.live
        return _count_table(live.kv_indices, live.kv_counts), _count_table(live.q_indices, live.q_counts)
    p = config.problem
    segments, segment_positions = rows
    live = document_live_grid(p.mask, config.block_q, config.block_kv, *segment_positions, segments)
    bound = document_live_bound(p.mask, p.q_len, p.kv_len, config.block_q, config.block_kv)
    return _traced_count_table(live, bound), _traced_count_table(jnp.swapaxes(live, 1, 2), bound.T)


def _table_spec(table: jax.Array):
    """The row of a query (or key) block, from the batch row's table when there is one each."""
    if table.shape[0] == 1:
        return pl.BlockSpec((None, None, table.shape[2]), lambda b, h, i: (0, i, 0))
    return pl.BlockSpec((None, None, table.shape[2]), lambda b, h, i: (b, i, 0))


def _read(refs, index):
    """``ref[index]`` of each of ``refs`` (None stays None)."""
    return tuple(None if ref is None else ref[index] for ref in refs)


def _visible(config: KernelConfig, q_start, kv_start, q_side, kv_side):
    """Bool ``[block_q, block_kv]``: which pairs of this tile may attend. ``q_side``,
    ``kv_side``: ``(segment ids, segment positions)`` vectors ``[block_q]``, ``[block_kv]``
    of the tile's queries and keys (None where the call has none)."""
    q_pos, kv_pos = tile_positions((config.block_q, config.block_kv), q_start, kv_start, q_axis=0)
    q_columns = tuple(None if x is None else x[:, None] for x in q_side)
    kv_rows = tuple(None if x is None else x[None, :] for x in kv_side)
    return tile_visible(config, q_pos, kv_pos, q_columns, kv_rows)


def _softmax_column(config: KernelConfig, x):
    """A per-query vector ``x [block_q]`` (log-sum-exp or ``delta``) as a column ``[block_q,
    1]`` of the tile; None for sigmoid scores, which read neither (so nothing loads them)."""
    return x[:, None] if config.problem.score == "softmax" else None


def _forward_kernel(table_ref, q_ref, k_ref, v_ref, *refs, config: KernelConfig, count_visits: bool):
    p = config.problem
    q_refs, kv_refs, refs = split_row_refs(p, refs)
    o_ref, lse_ref, *visits_ref = refs
    bq, bk = config.block_q, config.block_kv
    q_start = pl.program_id(2) * bq
    q = q_ref[...]
    q_side = _read(q_refs, ...)

    def body(t, carry):
        softmax_carry, acc, visits = carry
        kv_start = pl.multiple_of(table_ref[t + 1] * bk, bk)
        kv_rows = pl.ds(kv_start, bk)
        k, v = k_ref[kv_rows, :], v_ref[kv_rows, :]
        visible = _visible(config, q_start, kv_start, q_side, _read(kv_refs, kv_rows))
        capped = capped_logits(config, q, k)
        if p.score == "sigmoid":
            weights = tile_weights(config, capped, visible, lse=None)
            acc = acc + jnp.dot(weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        else:
            softmax_carry = online_softmax_step(softmax_carry, capped, visible, v)
        return softmax_carry, acc, visits + 1

    init = (online_softmax_init(bq, p.head_dim), jnp.zeros((bq, p.head_dim), jnp.float32), jnp.int32(0))
    softmax_carry, acc, visits = lax.fori_loop(0, table_ref[0], body, init)
    if p.score == "sigmoid":
        o_ref[...] = acc.astype(o_ref.dtype)
        lse_ref[...] = jnp.zeros((bq,), jnp.float32)  # no normalizer: the backward ignores it
    else:
        row_max, row_sum, _ = softmax_carry
        o_ref[...] = online_softmax_result(softmax_carry).astype(o_ref.dtype)
        lse_ref[...] = online_softmax_lse(row_max, row_sum)
    if count_visits:
        visits_ref[0][...] = jnp.full(visits_ref[0].shape, visits, jnp.int32)


def _dq_kernel(table_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, config: KernelConfig):
    p = config.problem
    q_refs, kv_refs, (dq_ref,) = split_row_refs(p, refs)
    bq, bk = config.block_q, config.block_kv
    q_start = pl.program_id(2) * bq
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_side = _read(q_refs, ...)

    def body(t, dq):
        kv_start = pl.multiple_of(table_ref[t + 1] * bk, bk)
        kv_rows = pl.ds(kv_start, bk)
        k, v = k_ref[kv_rows, :], v_ref[kv_rows, :]
        visible = _visible(config, q_start, kv_start, q_side, _read(kv_refs, kv_rows))
        capped = capped_logits(config, q, k)
        weights = tile_weights(config, capped, visible, _softmax_column(config, lse))
        dp = lax.dot_general(do, v, _NT_DIMS, preferred_element_type=jnp.float32)
        ds = score_grad(config, capped, weights, dp, _softmax_column(config, delta))
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    dq = lax.fori_loop(0, table_ref[0], body, jnp.zeros((bq, p.head_dim), jnp.float32))
    dq_ref[...] = (dq * p.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(table_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, config: KernelConfig):
    """One (batch, key head, key block): streams the live query blocks of every query head
    of the key head's GQA group, so dk and dv accumulate per key head (f32, in registers).
    Refs: q/dO ``[q_len, group, head_dim]``, lse/delta ``[group, q_len]``."""
    p = config.problem
    q_refs, kv_refs, (dk_ref, dv_ref) = split_row_refs(p, refs)
    bq, bk, group = config.block_q, config.block_kv, p.group
    kv_start = pl.program_id(2) * bk
    k, v = k_ref[...], v_ref[...]
    kv_side = _read(kv_refs, ...)

    def body(step, carry):
        dk, dv = carry
        # lax.div/rem (step >= 0): jnp's floor // and % lowered to ill-typed Triton IR
        t, head = (step, 0) if group == 1 else (lax.div(step, jnp.int32(group)), lax.rem(step, jnp.int32(group)))
        q_start = pl.multiple_of(table_ref[t + 1] * bq, bq)
        rows = pl.ds(q_start, bq)
        q, do = q_ref[rows, head, :], do_ref[rows, head, :]
        lse, delta = lse_ref[head, rows], delta_ref[head, rows]
        visible = _visible(config, q_start, kv_start, _read(q_refs, rows), kv_side)
        capped = capped_logits(config, q, k)
        weights = tile_weights(config, capped, visible, _softmax_column(config, lse))
        dv = dv + lax.dot_general(weights.astype(do.dtype), do, _TN_DIMS, preferred_element_type=jnp.float32)
        dp = lax.dot_general(do, v, _NT_DIMS, preferred_element_type=jnp.float32)
        ds = score_grad(config, capped, weights, dp, _softmax_column(config, delta))
        dk = dk + lax.dot_general(ds.astype(q.dtype), q, _TN_DIMS, preferred_element_type=jnp.float32)
        return dk, dv

    zeros = jnp.zeros((bk, p.head_dim), jnp.float32)
    dk, dv = lax.fori_loop(0, table_ref[0] * group, body, (zeros, zeros))
    dk_ref[...] = (dk * p.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def default_num_warps(block_q: int, block_kv: int) -> int:
    """Warps of a Triton flash-attention program when not given: 8, or 4 for tiles of fewer
    than 64 x 64 pairs (short sequences). Compiled for sm_90, 128 x 128 forward tiles at 4
    warps spilled registers even at head_dim 32 and 64 (48 and 56 bytes); at 8 none did."""
    return 4 if block_q * block_kv < 64 * 64 else 8


def _compiler_params(config: KernelConfig):
    num_warps = config.num_warps or default_num_warps(config.block_q, config.block_kv)
    return triton_compiler_params(interpret=config.interpret, num_warps=num_warps, num_stages=config.num_stages)


def _padded_inputs(config: KernelConfig, q, k, v, rows):
    """``q, k, v`` padded to block multiples, and the flat list of the present row arrays of
    ``rows = (segment ids, segment positions)`` (each None or a ``(query, key)`` pair),
    padded likewise, in the order :func:`~ember.kernels_pallas.flash_attention_tiles.split_row_refs`
    reads them."""
    q = pad_axis_to_multiple(q, 1, config.block_q)
    k = pad_axis_to_multiple(k, 1, config.block_kv)
    v = pad_axis_to_multiple(v, 1, config.block_kv)
    row_args = []
    for pair in rows:
        if pair is not None:
            row_args.append(pad_axis_to_multiple(pair[0], 1, config.block_q))
            row_args.append(pad_axis_to_multiple(pair[1], 1, config.block_kv))
    return q, k, v, row_args


def _row_specs(config: KernelConfig, row_args, *, per_query_block: bool):
    """Specs of the row arrays: on a grid over query blocks, the program's query tile and
    the whole key row; over key blocks, the whole query row and the key tile."""
    bq, bk = config.block_q, config.block_kv
    if per_query_block:
        q_spec = pl.BlockSpec((None, bq), lambda b, h, i: (b, i))
        kv_spec = pl.BlockSpec((None, config.padded_kv_len), lambda b, h, i: (b, 0))
    else:
        q_spec = pl.BlockSpec((None, config.padded_q_len), lambda b, h, j: (b, 0))
        kv_spec = pl.BlockSpec((None, bk), lambda b, h, j: (b, j))
    return [q_spec, kv_spec] * (len(row_args) // 2)


def _row_spec(block: int, head_dim: int, head_of):
    """``[block, head_dim]`` tile of a ``[batch, seq, heads, head_dim]`` array."""
    return pl.BlockSpec((None, block, None, head_dim), lambda b, h, i: (b, i, head_of(h), 0))


def _slab_spec(length: int, head_dim: int, head_of):
    """One head's whole ``[length, head_dim]`` slab of a ``[batch, seq, heads, head_dim]`` array."""
    return pl.BlockSpec((None, length, None, head_dim), lambda b, h, i: (b, 0, head_of(h), 0))


def flash_forward(q, k, v, rows, config: KernelConfig, count_visits: bool = False):
    """Runs the forward kernel on unpadded inputs (``rows``: ``(segment ids, segment
    positions)``, each None or a ``(query [batch, q_len], key [batch, kv_len])`` pair).

    Returns ``(out [batch, q_len, heads, head_dim], lse [batch, heads, padded_q_len] f32)``
    and, with ``count_visits``, also int32 ``[batch, heads, q_blocks]``: how many key blocks
    each program visited.
    """
    p = config.problem
    bq, group = config.block_q, p.group
    qp, kp, vp, row_args = _padded_inputs(config, q, k, v, rows)
    kv_table, _ = _block_tables(config, rows)
    num_q_blocks = config.padded_q_len // bq
    same_head, kv_head = (lambda h: h), (lambda h: h // group)
    in_specs = [
        _table_spec(kv_table),
        _row_spec(bq, p.head_dim, same_head),
        _slab_spec(config.padded_kv_len, p.head_dim, kv_head),
        _slab_spec(config.padded_kv_len, p.head_dim, kv_head),
        *_row_specs(config, row_args, per_query_block=True),
    ]
    args = [kv_table, qp, kp, vp, *row_args]
    out_shape = [
        jax.ShapeDtypeStruct(qp.shape, q.dtype),
        jax.ShapeDtypeStruct((p.batch, p.heads, config.padded_q_len), jnp.float32),
    ]
    out_specs = [_row_spec(bq, p.head_dim, same_head), pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))]
    if count_visits:
        out_shape.append(jax.ShapeDtypeStruct((p.batch, p.heads, num_q_blocks, 1), jnp.int32))
        out_specs.append(pl.BlockSpec((None, None, None, 1), lambda b, h, i: (b, h, i, 0)))
    itemsize = q.dtype.itemsize
    outs = pl.pallas_call(
        functools.partial(_forward_kernel, config=config, count_visits=count_visits),
        grid=(p.batch, p.heads, num_q_blocks),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(config),
        cost_estimate=config.cost(2, itemsize * (2 * qp.size + 2 * kp.size)),
        interpret=config.interpret,
        name="flash_attention_forward",
    )(*args)
    out, lse = outs[0][:, : p.q_len], outs[1]
    if count_visits:
        return out, lse, outs[2][..., 0]
    return out, lse


def flash_backward(q, k, v, rows, out, lse, d_out, config: KernelConfig):
    """``(dq, dk, dv)`` shaped like ``q, k, v``, from the forward's ``out`` and ``lse``, with
    the backward's tiles (:meth:`KernelConfig.for_backward`)."""
    config = config.for_backward()
    p = config.problem
    bq, bk, group = config.block_q, config.block_kv, p.group
    # delta_i = sum_d dO_id * O_id: the softmax Jacobian's row term, [batch, heads, q_len].
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = pad_axis_to_multiple(delta, 2, bq)
    qp, kp, vp, row_args = _padded_inputs(config, q, k, v, rows)
    kv_table, q_table = _block_tables(config, rows)
    dop = pad_axis_to_multiple(d_out.astype(q.dtype), 1, bq)
    same_head, kv_head = (lambda h: h), (lambda h: h // group)
    itemsize = q.dtype.itemsize

    dq_specs = [
        _table_spec(kv_table),
        _row_spec(bq, p.head_dim, same_head),
        _slab_spec(config.padded_kv_len, p.head_dim, kv_head),
        _slab_spec(config.padded_kv_len, p.head_dim, kv_head),
        _row_spec(bq, p.head_dim, same_head),
        pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
        pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
        *_row_specs(config, row_args, per_query_block=True),
    ]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, config=config),
        grid=(p.batch, p.heads, config.padded_q_len // bq),
        in_specs=dq_specs,
        out_specs=_row_spec(bq, p.head_dim, same_head),
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=_compiler_params(config),
        cost_estimate=config.cost(3, itemsize * (3 * qp.size + 2 * kp.size)),
        interpret=config.interpret,
        name="flash_attention_dq",
    )(kv_table, qp, kp, vp, dop, lse, delta, *row_args)

    # dk/dv: one program per key head; the q-side blocks hold the whole GQA group of heads.
    def group_slab(length):
        return pl.BlockSpec((None, length, group, p.head_dim), lambda b, g, j: (b, 0, g, 0))

    def group_rows(length):
        return pl.BlockSpec((None, group, length), lambda b, g, j: (b, g, 0))

    kv_tile = pl.BlockSpec((None, bk, None, p.head_dim), lambda b, g, j: (b, j, g, 0))
    dkv_specs = [
        _table_spec(q_table),
        group_slab(config.padded_q_len),
        kv_tile,
        kv_tile,
        group_slab(config.padded_q_len),
        group_rows(config.padded_q_len),
        group_rows(config.padded_q_len),
        *_row_specs(config, row_args, per_query_block=False),
    ]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, config=config),
        grid=(p.batch, p.kv_heads, config.padded_kv_len // bk),
        in_specs=dkv_specs,
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(kp.shape, k.dtype), jax.ShapeDtypeStruct(vp.shape, v.dtype)],
        compiler_params=_compiler_params(config),
        cost_estimate=config.cost(4, itemsize * (3 * qp.size + 4 * kp.size)),
        interpret=config.interpret,
        name="flash_attention_dkv",
    )(q_table, qp, kp, vp, dop, lse, delta, *row_args)
    return dq[:, : p.q_len], dk[:, : p.kv_len], dv[:, : p.kv_len]


def _forward(q, k, v, rows, config: KernelConfig):
    """``(out, lse [batch, heads, padded_q_len])`` from the configured forward kernel."""
    if config.hopper_blocks is None:
        return flash_forward(q, k, v, rows, config)
    p = config.problem
    out, lse = hopper_forward(
        q, k, v, causal=isinstance(p.mask, CausalMask), sm_scale=p.sm_scale, blocks=config.hopper_blocks
    )
    # The backward reads lse in its own query blocks: padded rows get +inf, i.e. weight 0.
    return out, pad_axis_to_multiple(lse, 2, config.block_q, value=jnp.inf)


def _backward(q, k, v, rows, out, lse, d_out, config: KernelConfig):
    """``(dq, dk, dv)`` from the configured backward kernels."""
    if config.hopper_backward_blocks is None:
        return flash_backward(q, k, v, rows, out, lse, d_out, config)
    p = config.problem
    causal = isinstance(p.mask, CausalMask)
    return hopper_backward(
        q, k, v, out, lse, d_out, causal=causal, sm_scale=p.sm_scale, blocks=config.hopper_backward_blocks
    )


_flash = attention_vjp(_forward, _backward)


def padded_head_dim(head_dim: int) -> int:
    """The head size the kernels run at: the next power of two (Triton tiles want them; 80
    and 96 run as 128). The zero columns add nothing to any logit, and the output columns
    they produce are dropped."""
    return 1 << (head_dim - 1).bit_length()


def flash_attention_kernel(
    q,
    k,
    v,
    segments,
    segment_positions=None,
    *,
    problem,
    block_sizes,
    interpret: bool,
    forward: str = "auto",
    backward: str = "auto",
    hopper_blocks: HopperBlockSizes = DEFAULT_HOPPER_BLOCKS,
    hopper_backward_blocks: HopperBlockSizes = DEFAULT_HOPPER_BACKWARD_BLOCKS,
):
    """The Pallas path of ``flash_attention`` (arguments already validated; ``segments`` and
    ``segment_positions`` are each ``None`` or a pair ``(query [batch, q_len], key [batch,
    kv_len])`` of int32; positions only where ``problem.has_segment_positions``).

    ``forward`` / ``backward``: ``"auto"``, ``"triton"`` or ``"hopper"``, chosen by
    :func:`~ember.kernels_pallas.flash_attention_routing.forward_kernel` and
    :func:`~ember.kernels_pallas.flash_attention_routing.backward_kernel`;
    ``hopper_blocks`` / ``hopper_backward_blocks``: the Hopper kernels' tiles.
    ``block_sizes`` are the Triton kernels'."""
    if problem.mask is not None:
        try:
            problem.mask.validate_block_sizes(block_sizes.block_q, block_sizes.block_kv)
        except ValueError as error:  # an explicit grid's cells of 12 fit no tile: say what does
            raise ValueError(
                f"{error} (the GPU kernels' tiles are powers of two of at least 8, so an ExplicitBlockMask "
                "needs blocks that are multiples of one of them; impl='xla' takes any block)"
            ) from None
    head_dim, padded = problem.head_dim, padded_head_dim(problem.head_dim)
    if padded != head_dim:
        q, k, v = (pad_axis_to_multiple(x, 3, padded) for x in (q, k, v))
        problem = dataclasses.replace(problem, head_dim=padded)
    gpu = None if interpret else GpuInfo.here()
    dtypes = (q.dtype, k.dtype, v.dtype)
    choice = forward_kernel(problem, dtypes, gpu, interpret=interpret, forward=forward, hopper_blocks=hopper_blocks)
    backward_choice = backward_kernel(
        problem, dtypes, gpu, interpret=interpret, backward=backward, hopper_blocks=hopper_backward_blocks
    )
    backward_block_kv, backward_num_warps = block_sizes.backward_tiles()
    config = KernelConfig(
        problem,
        block_sizes.block_q,
        block_sizes.block_kv,
        interpret,
        block_sizes.num_warps,
        block_sizes.num_stages,
        hopper_blocks=hopper_blocks if choice == "hopper" else None,
        hopper_backward_blocks=hopper_backward_blocks if backward_choice == "hopper" else None,
        backward_block_kv=backward_block_kv,
        backward_num_warps=backward_num_warps,
    )
    return _flash(q, k, v, (segments, segment_positions), config)[..., :head_dim]

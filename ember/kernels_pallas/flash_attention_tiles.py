"""The tile math of flash attention, one definition for every kernel that computes it: the
GPU (Triton) kernels of :mod:`ember.kernels_pallas.flash_attention_kernels` and the TPU
(Mosaic TPU) ones of :mod:`ember.kernels_pallas.flash_attention_tpu_kernels`.

A tile is one block of (query, key) pairs, in either orientation: queries down the rows
and keys across the columns (``[block_q, block_kv]``: every forward and dq, and the GPU's
dk/dv), or the transpose (``[block_kv, block_q]``: the TPU's dk/dv, queries on the lanes).
So per-query and per-key values come ready to broadcast against the tile: a column
``[n, 1]`` for the values along its rows, a row ``[1, n]`` for those along its columns.
The GPU kernels pass ``x[:, None]`` / ``x[None, :]`` of their vectors; the TPU kernels
read ``[:, :1]`` / ``[:1, :]`` of lane- or sublane-broadcast tiles.

Also here: what a kernel config derives from the call and its blocks
(:class:`AttentionBlocks`), and the ``custom_vjp`` that ties a forward kernel to its
backward kernels (:func:`attention_vjp`).
"""

from __future__ import annotations

import functools

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
from ember.kernels_pallas.sequence_padding import round_up

_NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T


class AttentionBlocks:
    """What a kernel config derives from its call and blocks. A base of the configs (frozen
    dataclasses) that have the fields ``problem`` (the
    :class:`ember.kernels_pallas.flash_attention.AttentionProblem`), ``block_q``, ``block_kv``
    and a ``head_dim``, the head size the kernels run at."""

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

    def cost(self, matmuls_per_block: int, bytes_accessed: int) -> pl.CostEstimate:
        """Cost of visiting the live blocks only (what the kernels do), each with
        ``matmuls_per_block`` tile matmuls."""
        p = self.problem
        pairs = self.live.num_live * self.block_q * self.block_kv * p.batch * p.heads
        flops = 2 * matmuls_per_block * pairs * self.head_dim
        return pl.CostEstimate(flops=flops, transcendentals=pairs, bytes_accessed=bytes_accessed)


def split_row_refs(problem, refs):
    """``(query-side refs, key-side refs, the rest)`` of a kernel's refs after its fixed
    inputs: each side ``(segment ids, segment positions)``, None where the call has none."""
    segments, refs = (refs[:2], refs[2:]) if problem.has_segments else ((None, None), refs)
    positions, refs = (refs[:2], refs[2:]) if problem.has_segment_positions else ((None, None), refs)
    return (segments[0], positions[0]), (segments[1], positions[1]), refs


def tile_positions(shape, q_start, kv_start, *, q_axis: int):
    """``(q_pos, kv_pos)`` int32 tiles of ``shape``, queries along ``q_axis``."""
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    kv_pos = kv_start + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    return q_pos, kv_pos


def tile_visible(config: AttentionBlocks, q_pos, kv_pos, q_rows, kv_rows):
    """Bool tile: which (query, key) pairs may attend. ``q_pos``/``kv_pos``: the int32
    position tiles (:func:`tile_positions`); ``q_rows``/``kv_rows``: ``(segment ids,
    segment positions)`` of the queries/keys, each broadcastable to the tile or None."""
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


def capped_logits(config: AttentionBlocks, a, b):
    """Scaled, soft-capped logits ``a @ b.T`` (f32) of a query and a key tile (either order:
    ``k @ q.T`` is the transposed tile)."""
    logits = lax.dot_general(a, b, _NT_DIMS, preferred_element_type=jnp.float32) * config.problem.sm_scale
    return soft_cap(logits, config.problem.logits_soft_cap)


def tile_weights(config: AttentionBlocks, capped, visible, lse):
    """Attention weights of a tile (masked entries exactly 0): sigmoid scores, or softmax
    weights from the forward's log-sum-exp ``lse`` (broadcastable; +inf for a query that
    sees no key, which makes its weights 0; unused for sigmoid scores)."""
    if config.problem.score == "sigmoid":
        return jnp.where(visible, jax.nn.sigmoid(capped + config.problem.sigmoid_bias), 0.0)
    return jnp.where(visible, jnp.exp(capped - lse), 0.0)


def score_grad(config: AttentionBlocks, capped, weights, dp, delta):
    """d loss / d (scaled logits) of a tile, from the weights (masked entries 0), ``dp``
    (``dO @ v.T``, or its transpose) and the softmax row term ``delta = sum_d dO * O``
    (broadcastable; unused for sigmoid scores)."""
    p = config.problem
    ds = weights * (1.0 - weights) * dp if p.score == "sigmoid" else weights * (dp - delta)
    if p.logits_soft_cap is not None:
        ds = ds * (1.0 - jnp.square(capped / p.logits_soft_cap))
    return ds


def attention_vjp(forward, backward):
    """``attend(q, k, v, rows, config) -> out``, differentiable in ``q, k, v`` through a
    ``custom_vjp`` that saves the forward's log-sum-exp for the backward kernels.

    ``forward(q, k, v, rows, config) -> (out, lse)``; ``backward(q, k, v, rows, out, lse,
    d_out, config) -> (dq, dk, dv)``. ``rows`` (segment ids and positions, integers) get no
    cotangent; ``config`` is static (hashable).
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
    def attend(q, k, v, rows, config):
        return forward(q, k, v, rows, config)[0]

    def attend_fwd(q, k, v, rows, config):
        out, lse = forward(q, k, v, rows, config)
        return out, (q, k, v, rows, out, lse)

    def attend_bwd(config, residuals, d_out):
        q, k, v, rows, out, lse = residuals
        dq, dk, dv = backward(q, k, v, rows, out, lse, d_out, config)
        return dq, dk, dv, None

    attend.defvjp(attend_fwd, attend_bwd)
    return attend

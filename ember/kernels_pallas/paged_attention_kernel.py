"""Pallas kernel of :func:`ember.kernels_pallas.paged_attention.paged_attention`.

Grid ``(batch, kv_heads)``: a program takes the ``group = heads // kv_heads`` query heads
that share one key head (one ``[max(group, 16), head_dim]`` tile, zero-padded, so every key
page read serves the whole GQA group) and streams that sequence's pages with an online softmax. It reads only
the pages that hold visible tokens, ``[first visible // page_size, cdiv(length,
page_size))``: cost follows the sequence's length (and window), not the table's width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ember.kernels_pallas.attention_math import soft_cap
from ember.kernels_pallas.online_softmax import online_softmax_init, online_softmax_result, online_softmax_step

_NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
MIN_QUERY_ROWS = 16


def _paged_decode_kernel(
    lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, *, page_size, pages_per_block, sm_scale, soft_cap_value, window
):
    kv_head = pl.program_id(1)
    length = lengths_ref[0]
    q = q_ref[...]
    first_visible = 0 if window is None else jnp.maximum(length - 1 - window[0], 0)
    first_block = first_visible // (page_size * pages_per_block)
    end_block = pl.cdiv(length, page_size * pages_per_block)

    def body(block, carry):
        for slot in range(pages_per_block):  # unrolled: pages_per_block pages per step
            page_index = block * pages_per_block + slot
            # Past the table's end only when the sequence is shorter than the block; clamp
            # the read (its tokens are masked out by position anyway).
            page = table_ref[jnp.minimum(page_index, table_ref.shape[0] - 1)]
            k = k_ref[page, :, kv_head, :]
            v = v_ref[page, :, kv_head, :]
            logits = lax.dot_general(q, k, _NT_DIMS, preferred_element_type=jnp.float32) * sm_scale
            logits = soft_cap(logits, soft_cap_value)
            pos = page_index * page_size + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
            visible = (pos < length) & (pos >= first_visible)
            carry = online_softmax_step(carry, logits, visible, v)
        return carry

    carry = lax.fori_loop(first_block, end_block, body, online_softmax_init(q.shape[0], q.shape[1]))
    o_ref[...] = online_softmax_result(carry).astype(o_ref.dtype)


def default_pages_per_block(page_size: int) -> int:
    """Enough pages for about 128 tokens per step, at least one."""
    return max(1, 128 // page_size)


def paged_attention_kernel(
    q, k_pages, v_pages, page_table, lengths, *, cache, sm_scale, logits_soft_cap, window, pages_per_block, interpret
):
    """The Pallas path of ``paged_attention`` (arguments already validated)."""
    batch, heads, head_dim = q.shape
    group = heads // cache.kv_heads
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(cache.page_size)
    if not isinstance(pages_per_block, int) or pages_per_block < 1:
        raise ValueError(f"pages_per_block must be a positive int, got {pages_per_block!r}")
    pages_per_block = min(pages_per_block, cache.max_pages_per_seq)
    kernel = functools.partial(
        _paged_decode_kernel,
        page_size=cache.page_size,
        pages_per_block=pages_per_block,
        sm_scale=sm_scale,
        soft_cap_value=logits_soft_cap,
        window=window,
    )
    # Each program's query tile is its GQA group, padded with zero rows to MIN_QUERY_ROWS
    # (GPU matmul tiles need at least 16 rows); the padded rows are dropped afterwards.
    rows = max(group, MIN_QUERY_ROWS)
    q_groups = q.reshape(batch, cache.kv_heads, group, head_dim)
    q_groups = jnp.pad(q_groups, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    whole_cache = pl.BlockSpec(k_pages.shape, lambda b, g: (0, 0, 0, 0))
    query_tile = pl.BlockSpec((None, None, rows, head_dim), lambda b, g: (b, g, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(batch, cache.kv_heads),
        in_specs=[
            pl.BlockSpec((1,), lambda b, g: (b,)),
            pl.BlockSpec((None, cache.max_pages_per_seq), lambda b, g: (b, 0)),
            query_tile,
            whole_cache,
            whole_cache,
        ],
        out_specs=query_tile,
        out_shape=jax.ShapeDtypeStruct(q_groups.shape, q.dtype),
        interpret=interpret,
        name="paged_attention",
    )(lengths.astype(jnp.int32), page_table.astype(jnp.int32), q_groups, k_pages, v_pages)
    return out[:, :, :group].reshape(batch, heads, head_dim)

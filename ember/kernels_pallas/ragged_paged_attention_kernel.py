"""Pallas kernel of :func:`ember.kernels_pallas.ragged_paged_attention.ragged_paged_attention`.

Each sequence's run of new tokens is cut into query blocks of ``block_q`` rows; every
block is one *work item*, so a block never mixes sequences. The work list is computed on
device from the metadata (it is data, not static), padded to the static bound
``cdiv(num_tokens, block_q) + num_seqs`` items; padding items do nothing.

Grid ``(work_items, kv_heads * group_splits)``: a program takes its block's query rows of
the query heads of one key head's GQA group -- all of them, or for large groups a share of
at most :data:`MAX_ROWS` rows -- token-major (the group padded to a power of two for the
tiles), so each cached page is read once per key head (per share), not once per query
head: a decode step is bound by reading the cache, and per-query-head programs read it
``group`` times. It streams, with an online softmax (or, for sigmoid
scores, a plain weighted sum), only the pages holding positions it can see: from the
window start, or 0, up to its last row's position, and with ``global_tokens`` also the
pages of the global prefix before the window (a first loop), never the pages between. It
writes its own ``[rows, head_dim]`` output tile, so programs never race; one
gather then puts rows back in token order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ember.kernels_pallas.attention_math import soft_cap
from ember.kernels_pallas.dispatch import triton_compiler_params
from ember.kernels_pallas.online_softmax import online_softmax_init, online_softmax_result, online_softmax_step

_NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
# Query rows a program serves at most (block_q positions x query heads): the tile's f32
# accumulator and logits live in registers.
MAX_ROWS = 128
# Columns of the work-item table (width 8: GPU tiles want powers of two).
_SEQ, _TOKEN_START, _ROWS, _FIRST_POS = 0, 1, 2, 3
_WORK_COLUMNS = 8


DEFAULT_BLOCK_Q = 16
# Rows Triton's dot needs at least (block_q positions x the padded query group).
MIN_ROWS = 16


def gpu_block_q(num_tokens: int, num_seqs: int, heads: int, kv_heads: int) -> int:
    """The GPU kernel's ``block_q`` when the caller leaves it to the kernel: the mean run
    (``num_tokens // num_seqs``) rounded up to a power of two, at most :data:`DEFAULT_BLOCK_Q`
    and at least enough positions for :data:`MIN_ROWS` rows. A decode step (one token per
    sequence) with groups of 4 gets 4: 16 rows a program, where 16 positions made 64 rows of
    which 4 were real, and compiled for sm_90 needed 255 registers and spilled (96 bytes)
    where 4 needs 181 and less than half the shared memory."""
    padded_group = 1 << (heads // kv_heads - 1).bit_length()
    mean_run = max(1, num_tokens // max(1, num_seqs))
    smallest = -(-MIN_ROWS // padded_group)
    return max(smallest, min(DEFAULT_BLOCK_Q, 1 << (mean_run - 1).bit_length()))


def warps_for_rows(rows: int) -> int:
    """Warps of a program serving ``rows`` query rows. Compiled for sm_90 (head_dim 128, 128
    tokens a step), 16 rows fit 4 warps without spilling; at 32 rows 4 warps spilled 80 bytes
    (8: 16) and at 128 rows 984 (8: 88)."""
    return 4 if rows <= MIN_ROWS else 8


def default_pages_per_block(page_size: int) -> int:
    """Enough pages for about 128 tokens per step, at least one."""
    return max(1, 128 // page_size)


def pages_per_step(pages_per_block, cache) -> int:
    """The pages a kernel step reads: ``pages_per_block`` (None: :func:`default_pages_per_block`),
    at most a sequence's ``cache.max_pages_per_seq``.

    Raises:
      ValueError: for a ``pages_per_block`` that is not a positive int.
    """
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(cache.page_size)
    if not isinstance(pages_per_block, int) or pages_per_block < 1:
        raise ValueError(f"pages_per_block must be a positive int, got {pages_per_block!r}")
    return min(pages_per_block, cache.max_pages_per_seq)


def work_items(query_starts, query_lens, kv_lens, *, num_tokens: int, block_q: int):
    """The work list, ``(table [max_items, 8] int32, item_offsets [num_seqs] int32)``.

    Row ``w`` of ``table`` is ``[seq, first token row in q, valid rows (0 for padding),
    position of the first row, 0, ...]``; sequence ``s``'s blocks are the items
    ``item_offsets[s] ..``.
    """
    num_seqs = query_lens.shape[0]
    max_items = -(-num_tokens // block_q) + num_seqs
    blocks = -(-query_lens // block_q)
    ends = jnp.cumsum(blocks)
    offsets = ends - blocks
    item = jnp.arange(max_items)
    # compare_all: one fused comparison; the default (scan) compiles to a while loop of small
    # kernels run one iteration at a time, in every serving step.
    seq = jnp.searchsorted(ends, item, side="right", method="compare_all")
    seq = jnp.minimum(seq, num_seqs - 1).astype(jnp.int32)
    block = item - offsets[seq]
    valid = item < ends[-1]
    rows = jnp.where(valid, jnp.minimum(block_q, query_lens[seq] - block * block_q), 0)
    table = jnp.zeros((max_items, _WORK_COLUMNS), jnp.int32)
    table = table.at[:, _SEQ].set(seq)
    table = table.at[:, _TOKEN_START].set(jnp.where(valid, query_starts[seq] + block * block_q, 0))
    table = table.at[:, _ROWS].set(rows)
    table = table.at[:, _FIRST_POS].set(jnp.where(valid, kv_lens[seq] - query_lens[seq] + block * block_q, 0))
    return table, offsets.astype(jnp.int32)


def _ragged_kernel(
    work_ref,
    page_table_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    *,
    block_q,
    group,
    group_splits,
    page_size,
    pages_per_block,
    sm_scale,
    soft_cap_value,
    window,
    score,
    sigmoid_bias,
    global_tokens,
):
    kv_head = pl.program_id(1) // group_splits
    seq, token_start, rows, first_pos = (work_ref[c] for c in (_SEQ, _TOKEN_START, _ROWS, _FIRST_POS))
    q = q_ref[pl.ds(token_start * group, block_q * group), :]  # row r: token r // group
    # lax.div (iota >= 0): jnp's floor // lowered to ill-typed Triton IR
    row = lax.div(lax.broadcasted_iota(jnp.int32, (block_q * group, page_size), 0), jnp.int32(group))
    q_pos = first_pos + row
    first_visible = 0 if window is None else jnp.maximum(first_pos - window[0], 0)
    tokens_per_block = page_size * pages_per_block
    first_block = first_visible // tokens_per_block
    # Padding items (rows == 0) visit nothing.
    end_block = jnp.where(rows > 0, pl.cdiv(first_pos + rows, tokens_per_block), first_block)
    max_pages = page_table_ref.shape[1]

    def body(block, carry):
        for slot in range(pages_per_block):  # unrolled
            page_index = block * pages_per_block + slot
            page = page_table_ref[seq, jnp.minimum(page_index, max_pages - 1)]
            k = k_ref[page, :, kv_head, :]
            v = v_ref[page, :, kv_head, :]
            logits = lax.dot_general(q, k, _NT_DIMS, preferred_element_type=jnp.float32) * sm_scale
            logits = soft_cap(logits, soft_cap_value)
            kv_pos = page_index * page_size + lax.broadcasted_iota(jnp.int32, (block_q * group, page_size), 1)
            visible = (kv_pos <= q_pos) & (row < rows)
            if window is not None:
                visible = visible & ((kv_pos >= q_pos - window[0]) | (kv_pos < global_tokens))
            if score == "sigmoid":
                weights = jnp.where(visible, jax.nn.sigmoid(logits + sigmoid_bias), 0.0)
                carry = carry + jnp.dot(weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
            else:
                carry = online_softmax_step(carry, logits, visible, v)
        return carry

    head_dim = q.shape[1]
    if score == "sigmoid":
        carry = jnp.zeros((block_q * group, head_dim), jnp.float32)
    else:
        carry = online_softmax_init(block_q * group, head_dim)
    if window is not None and global_tokens > 0:
        # The global prefix's blocks that come before the window's first block (that one
        # and the later ones are the second loop's), so no block is read twice.
        global_end = jnp.where(rows > 0, jnp.minimum(pl.cdiv(global_tokens, tokens_per_block), first_block), 0)
        carry = lax.fori_loop(0, global_end, body, carry)
    carry = lax.fori_loop(first_block, end_block, body, carry)
    out = carry if score == "sigmoid" else online_softmax_result(carry)
    o_ref[...] = out.astype(o_ref.dtype)


def ragged_paged_attention_kernel(
    q,
    k_pages,
    v_pages,
    page_table,
    query_starts,
    query_lens,
    kv_lens,
    *,
    owner,
    covered,
    cache,
    sm_scale,
    logits_soft_cap,
    window,
    score,
    sigmoid_bias,
    global_tokens,
    block_q,
    pages_per_block,
    interpret,
):
    """The Pallas path of ``ragged_paged_attention`` (arguments already validated;
    ``owner``/``covered`` ``[num_tokens]`` say which sequence owns each token row)."""
    num_tokens, heads, head_dim = q.shape
    pages_per_block = pages_per_step(pages_per_block, cache)
    query_starts, query_lens, kv_lens = (x.astype(jnp.int32) for x in (query_starts, query_lens, kv_lens))
    table, offsets = work_items(query_starts, query_lens, kv_lens, num_tokens=num_tokens, block_q=block_q)
    max_items = table.shape[0]
    kv_heads = cache.kv_heads
    group = heads // kv_heads
    padded_group = 1 << (group - 1).bit_length()  # GPU tiles: powers of two
    share = min(padded_group, max(1, MAX_ROWS // block_q))  # query heads per program
    splits = padded_group // share
    # [kv_heads * splits, tokens * share, head_dim]: a program's query heads, token-major (the
    # padded heads are zeros, their outputs dropped); block_q spare tokens so the last
    # block's read stays in bounds.
    q_grouped = jnp.pad(
        q.reshape(num_tokens, kv_heads, group, head_dim), ((0, block_q), (0, 0), (0, padded_group - group), (0, 0))
    )
    q_grouped = q_grouped.reshape(-1, kv_heads, splits, share, head_dim).transpose(1, 2, 0, 3, 4)
    q_grouped = q_grouped.reshape(kv_heads * splits, -1, head_dim)
    kernel = functools.partial(
        _ragged_kernel,
        block_q=block_q,
        group=share,
        group_splits=splits,
        page_size=cache.page_size,
        pages_per_block=pages_per_block,
        sm_scale=sm_scale,
        soft_cap_value=logits_soft_cap,
        window=window,
        score=score,
        sigmoid_bias=sigmoid_bias,
        global_tokens=global_tokens,
    )
    whole_cache = pl.BlockSpec(k_pages.shape, lambda w, g: (0, 0, 0, 0))
    rows = block_q * share
    out_items = pl.pallas_call(
        kernel,
        grid=(max_items, kv_heads * splits),
        in_specs=[
            pl.BlockSpec((None, _WORK_COLUMNS), lambda w, g: (w, 0)),
            pl.BlockSpec(page_table.shape, lambda w, g: (0, 0)),
            pl.BlockSpec((None, q_grouped.shape[1], head_dim), lambda w, g: (g, 0, 0)),
            whole_cache,
            whole_cache,
        ],
        out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda w, g: (w, g, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((max_items, kv_heads * splits, rows, head_dim), q.dtype),
        interpret=interpret,
        compiler_params=triton_compiler_params(interpret=interpret, num_warps=warps_for_rows(rows), num_stages=3),
        name="ragged_paged_attention",
    )(table, page_table.astype(jnp.int32), q_grouped, k_pages, v_pages)
    # [items, kv_heads, splits, block_q, share, d] -> [items, block_q, heads, d]
    out_items = out_items.reshape(max_items, kv_heads, splits, block_q, share, head_dim).transpose(0, 3, 1, 2, 4, 5)
    out_items = out_items.reshape(max_items, block_q, kv_heads, padded_group, head_dim)[:, :, :, :group]
    out_items = out_items.reshape(max_items, block_q, heads, head_dim)
    return items_to_tokens(out_items, offsets, query_starts, owner, covered).astype(q.dtype)


def items_to_tokens(out_items, item_offsets, query_starts, owner, covered):
    """Rows of work items ``[max_items, block_q, ...]`` back in token order ``[num_tokens,
    ...]`` (zeros for padding tokens): row ``offset`` of sequence ``owner``'s run is in
    item ``item_offsets[owner] + offset // block_q``, row ``offset % block_q``."""
    max_items, block_q = out_items.shape[:2]
    offset = jnp.arange(owner.shape[0]) - query_starts[owner]
    item = jnp.clip(item_offsets[owner] + offset // block_q, 0, max_items - 1)
    gathered = out_items[item, offset % block_q]
    return jnp.where(covered.reshape(-1, *[1] * (gathered.ndim - 1)), gathered, 0)

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
scores, a plain weighted sum), only the blocks of ``pages_per_block`` pages holding
positions it can see: from the window start, or 0, up to its last row's position, and with
``global_tokens`` also the blocks of the global prefix before the window (a first loop),
never the blocks between. It writes its own ``[rows, head_dim]`` output tile, so programs
never race; one gather then puts rows back in token order.

Split KV (flash-decoding), ``kv_splits > 1``: grid ``(work_items, kv_heads * group_splits,
kv_splits)``. A work item's ``n`` visible blocks, in the order the loops read them (global
prefix, then window), are cut into ``kv_splits`` consecutive runs of ``n // kv_splits`` or
one more blocks; split ``s`` reads run ``s`` only, so every block is read once, and a
split with no blocks (a short sequence, a padding item) reads nothing. It writes float32
partials, ``acc [kv_splits, work_items, kv_heads * group_splits, rows, head_dim]`` with
the online softmax's row max and row sum ``[kv_splits, work_items, kv_heads *
group_splits, rows]`` (sigmoid scores: the weighted sum alone), which plain jnp outside the
kernel merges (:func:`~ember.kernels_pallas.online_softmax.online_softmax_merge`; for
sigmoid scores, a sum over the splits). A decode step has one work item per sequence, so
without splits each program loops over a whole sequence's cache while most SMs idle;
:func:`gpu_kv_splits` picks the splits when the caller does not. ``kv_splits=1`` is the
kernel without splits: two grid axes, the normalized output written in ``q``'s dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ember.kernels_pallas.attention_math import soft_cap
from ember.kernels_pallas.dispatch import triton_compiler_params
from ember.kernels_pallas.int_options import check_positive_int
from ember.kernels_pallas.online_softmax import (
    online_softmax_init,
    online_softmax_merge,
    online_softmax_result,
    online_softmax_step,
)

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
# What gpu_kv_splits aims for: programs per SM, SMs of an H100 / H200.
PROGRAMS_PER_SM = 4
GPU_SMS = 132


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


def group_shares(group: int, block_q: int) -> tuple[int, int, int]:
    """``(padded_group, share, group_splits)``: the GQA group padded to a power of two (GPU
    tiles), the query heads a program serves (at most :data:`MAX_ROWS` rows of ``block_q``
    positions each) and the programs per key head, ``padded_group // share``."""
    padded_group = 1 << (group - 1).bit_length()
    share = min(padded_group, max(1, MAX_ROWS // block_q))
    return padded_group, share, padded_group // share


def gpu_kv_splits(num_tokens: int, num_seqs: int, heads: int, kv_heads: int, block_q: int, seq_blocks: int) -> int:
    """The GPU kernel's ``kv_splits`` when the caller leaves it to the kernel: the fewest
    splits that make :data:`PROGRAMS_PER_SM` programs for each of :data:`GPU_SMS` SMs (528),
    at most ``seq_blocks`` (the blocks of ``pages_per_block`` pages a sequence can have:
    more splits would all be empty), and 1 where the work items alone make that many.

    A program's loop over its blocks is a chain of page-table reads, loads and dots whose
    latency the SM hides only with other programs: a decode step of 64 sequences x 8 key
    heads at 4096 tokens (32 blocks of 128) made 512 programs of 32 steps and read the cache
    at 19% of an H200's bandwidth. It gets 2 splits here: 1,024 programs of 16 steps. A
    prefill budget of 4096 tokens in blocks of 16 makes 256 items, 2,048 programs, and gets 1.

    The live work items are estimated as the fewest a full budget makes,
    ``max(cdiv(num_tokens, block_q), min(num_seqs, num_tokens))`` (one per sequence in a
    decode step), not the grid's static bound ``cdiv(num_tokens, block_q) + num_seqs`` (80
    in that decode step), whose padding items return at once."""
    items = max(-(-num_tokens // block_q), min(num_seqs, num_tokens))
    programs = items * kv_heads * group_shares(heads // kv_heads, block_q)[2]
    wanted = -(-PROGRAMS_PER_SM * GPU_SMS // max(1, programs))
    return max(1, min(wanted, seq_blocks))


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
    check_positive_int("pages_per_block", pages_per_block)
    return min(pages_per_block, cache.max_pages_per_seq)


def default_kv_splits(num_tokens: int, num_seqs: int, heads: int, block_q: int, pages_per_block, cache) -> int:
    """``kv_splits=None`` resolved as the kernel resolves it for a call's sizes: :func:`gpu_kv_splits`
    over the blocks of :func:`pages_per_step` pages that ``cache`` (a ``PagedCacheShape``) gives
    a sequence."""
    seq_blocks = -(-cache.max_pages_per_seq // pages_per_step(pages_per_block, cache))
    return gpu_kv_splits(num_tokens, num_seqs, heads, cache.kv_heads, block_q, seq_blocks)


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


def _split_share(segments, split, kv_splits: int):
    """Split ``split``'s share of the visible blocks, given as ``segments`` ``[(start, stop),
    ...]`` read in that order: of their ``n`` blocks, it takes positions ``n * split //
    kv_splits`` up to ``n * (split + 1) // kv_splits``, cut back into the segments (as
    ``(start, stop)`` each, empty where the share misses one)."""
    total = sum(stop - start for start, stop in segments)
    splits = jnp.int32(kv_splits)
    lo, hi = lax.div(total * split, splits), lax.div(total * (split + 1), splits)
    share, before = [], 0
    for start, stop in segments:
        size = stop - start
        share.append(tuple(start + jnp.clip(edge - before, 0, size) for edge in (lo, hi)))
        before = before + size
    return share


def _ragged_kernel(
    work_ref,
    page_table_ref,
    q_ref,
    k_ref,
    v_ref,
    *out_refs,
    block_q,
    group,
    group_splits,
    kv_splits,
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
            # Positions past the block's last row (a reused page's unwritten tail, unused table
            # slots) may hold NaN, which would reach the output through p @ v even with p = 0.
            value_pos = page_index * page_size + lax.broadcasted_iota(jnp.int32, (page_size, q.shape[1]), 0)
            v = jnp.where(value_pos < first_pos + rows, v_ref[page, :, kv_head, :], 0)
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
    segments = [(first_block, end_block)]
    if window is not None and global_tokens > 0:
        # The global prefix's blocks that come before the window's first block (that one
        # and the later ones are the second loop's), so no block is read twice.
        global_end = jnp.where(rows > 0, jnp.minimum(pl.cdiv(global_tokens, tokens_per_block), first_block), 0)
        segments.insert(0, (0, global_end))
    if kv_splits > 1:
        segments = _split_share(segments, pl.program_id(2), kv_splits)
    for start, stop in segments:
        carry = lax.fori_loop(start, stop, body, carry)
    if kv_splits == 1:
        (o_ref,) = out_refs
        out = carry if score == "sigmoid" else online_softmax_result(carry)
        o_ref[...] = out.astype(o_ref.dtype)
    elif score == "sigmoid":
        (o_ref,) = out_refs
        o_ref[...] = carry
    else:
        acc_ref, max_ref, sum_ref = out_refs
        max_ref[...], sum_ref[...], acc_ref[...] = carry


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
    kv_splits,
    interpret,
):
    """The Pallas path of ``ragged_paged_attention`` (arguments already validated;
    ``owner``/``covered`` ``[num_tokens]`` say which sequence owns each token row;
    ``kv_splits`` None: :func:`default_kv_splits`)."""
    num_tokens, heads, head_dim = q.shape
    pages_per_block = pages_per_step(pages_per_block, cache)
    query_starts, query_lens, kv_lens = (x.astype(jnp.int32) for x in (query_starts, query_lens, kv_lens))
    table, offsets = work_items(query_starts, query_lens, kv_lens, num_tokens=num_tokens, block_q=block_q)
    max_items = table.shape[0]
    kv_heads = cache.kv_heads
    group = heads // kv_heads
    padded_group, share, group_splits = group_shares(group, block_q)
    if kv_splits is None:
        kv_splits = default_kv_splits(num_tokens, page_table.shape[0], heads, block_q, pages_per_block, cache)
    # [kv_heads * group_splits, tokens * share, head_dim]: a program's query heads, token-major
    # (the padded heads are zeros, their outputs dropped); block_q spare tokens so the last
    # block's read stays in bounds.
    q_grouped = jnp.pad(
        q.reshape(num_tokens, kv_heads, group, head_dim), ((0, block_q), (0, 0), (0, padded_group - group), (0, 0))
    )
    q_grouped = q_grouped.reshape(-1, kv_heads, group_splits, share, head_dim).transpose(1, 2, 0, 3, 4)
    q_grouped = q_grouped.reshape(kv_heads * group_splits, -1, head_dim)
    kernel = functools.partial(
        _ragged_kernel,
        block_q=block_q,
        group=share,
        group_splits=group_splits,
        kv_splits=kv_splits,
        page_size=cache.page_size,
        pages_per_block=pages_per_block,
        sm_scale=sm_scale,
        soft_cap_value=logits_soft_cap,
        window=window,
        score=score,
        sigmoid_bias=sigmoid_bias,
        global_tokens=global_tokens,
    )
    whole_cache = pl.BlockSpec(k_pages.shape, lambda *_: (0, 0, 0, 0))
    rows = block_q * share
    grid = (max_items, kv_heads * group_splits)
    if kv_splits == 1:
        out_specs = [pl.BlockSpec((None, None, rows, head_dim), lambda w, g: (w, g, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((*grid, rows, head_dim), q.dtype)]
    else:
        grid = (*grid, kv_splits)
        out_specs = [pl.BlockSpec((None, None, None, rows, head_dim), lambda w, g, s: (s, w, g, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((kv_splits, *grid[:2], rows, head_dim), jnp.float32)]
        if score != "sigmoid":  # the row max and row sum
            out_specs += [pl.BlockSpec((None, None, None, rows), lambda w, g, s: (s, w, g, 0))] * 2
            out_shape += [jax.ShapeDtypeStruct((kv_splits, *grid[:2], rows), jnp.float32)] * 2
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, _WORK_COLUMNS), lambda w, *_: (w, 0)),
            pl.BlockSpec(page_table.shape, lambda *_: (0, 0)),
            pl.BlockSpec((None, q_grouped.shape[1], head_dim), lambda w, g, *_: (g, 0, 0)),
            whole_cache,
            whole_cache,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=triton_compiler_params(interpret=interpret, num_warps=warps_for_rows(rows), num_stages=3),
        name="ragged_paged_attention",
    )(table, page_table.astype(jnp.int32), q_grouped, k_pages, v_pages)
    out_items = outs[0] if kv_splits == 1 else merge_splits(outs, score).astype(q.dtype)
    # [items, kv_heads, group_splits, block_q, share, d] -> [items, block_q, heads, d]
    out_items = out_items.reshape(max_items, kv_heads, group_splits, block_q, share, head_dim)
    out_items = out_items.transpose(0, 3, 1, 2, 4, 5)
    out_items = out_items.reshape(max_items, block_q, kv_heads, padded_group, head_dim)[:, :, :, :group]
    out_items = out_items.reshape(max_items, block_q, heads, head_dim)
    return items_to_tokens(out_items, offsets, query_starts, owner, covered).astype(q.dtype)


def merge_splits(partials, score: str):
    """The splits' partial results merged, ``[..., rows, head_dim]`` float32: for softmax
    ``partials`` are ``(acc [kv_splits, ..., rows, head_dim], row_max, row_sum [kv_splits,
    ..., rows])`` (unnormalized, as the online softmax carries them); for sigmoid scores
    ``(weighted_sum [kv_splits, ..., rows, head_dim],)``, summed."""
    if score == "sigmoid":
        return jnp.sum(partials[0], axis=0)
    acc, row_max, row_sum = partials
    return online_softmax_result(online_softmax_merge(row_max, row_sum, acc))


def items_to_tokens(out_items, item_offsets, query_starts, owner, covered):
    """Rows of work items ``[max_items, block_q, ...]`` back in token order ``[num_tokens,
    ...]`` (zeros for padding tokens): row ``offset`` of sequence ``owner``'s run is in
    item ``item_offsets[owner] + offset // block_q``, row ``offset % block_q``."""
    max_items, block_q = out_items.shape[:2]
    offset = jnp.arange(owner.shape[0]) - query_starts[owner]
    item = jnp.clip(item_offsets[owner] + offset // block_q, 0, max_items - 1)
    gathered = out_items[item, offset % block_q]
    return jnp.where(covered.reshape(-1, *[1] * (gathered.ndim - 1)), gathered, 0)

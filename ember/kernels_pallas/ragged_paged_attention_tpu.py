"""TPU (Mosaic TPU) kernel of :func:`ember.kernels_pallas.ragged_paged_attention.ragged_paged_attention`.

Work: the GPU kernel's work list
(:func:`~ember.kernels_pallas.ragged_paged_attention_kernel.work_items`): each sequence's run
of new tokens in the flat token budget is cut into *items* of up to ``block_q`` rows of that
sequence only, padded to the static bound ``cdiv(num_tokens, block_q) + num_seqs`` items
(padding items have no rows and come last). Grid ``(items,)``: program ``w`` computes item
``w`` for every head, and one gather puts the rows back in token order.

Scalar prefetch (SMEM): the flattened page table and, per item, its sequence, the position
of its first row and its number of rows. The caches stay in HBM (``memory_space=pl.ANY``);
the kernel copies whole pages ``[page_size, kv_heads, head_dim]`` (contiguous in HBM) with
``pltpu.make_async_copy`` into VMEM buffers ``[2, pages_per_block, page_size, kv_heads,
head_dim]``, double buffered: while block ``t`` of pages is computed, block ``t + 1`` is in
flight into the other slot. The chain of copies runs through the whole grid -- an item's
last step prefetches the next item's first block -- so the grid axis is ``"arbitrary"``
(sequential) and an SMEM scratch word carries the slot from one program to the next. Only
the pages some row of the item can see are copied (from the window start, or 0, up to its
last row, plus the ``global_tokens`` prefix with a window); the buffer entries of the pages
not copied hold stale data, and so do the positions of a copied page past the item's last
row (a reused page's unwritten tail), so their values are zeroed before the ``p @ v``
product.

Layout for the MXU: queries travel heads-major per item, ``[items, kv_heads, block_q *
group, head_dim]`` with row ``r`` = (query row ``r // group``, head ``r % group`` of the
group), so the query heads that share key head ``g`` form one ``[block_q * group,
head_dim]`` tile against that head's keys ``[pages_per_block * page_size, head_dim]``, read
from the page buffer with a sublane-strided load (stride ``kv_heads``). The online softmax
state per key head is f32 VMEM scratch: running max and sum as lane-broadcast columns
``[block_q * group, 128]`` and the accumulator ``[block_q * group, head_dim]``. ``head_dim``
is the cache's own (a block dim equal to the array's): padding it to 128 lanes would copy
the whole cache every call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ember.kernels_pallas.attention_math import soft_cap
from ember.kernels_pallas.block_mask import BlockMask, CausalMask, LocalGlobalMask, combine_masks
from ember.kernels_pallas.online_softmax import online_softmax_result, online_softmax_step, per_row, set_per_row
from ember.kernels_pallas.ragged_paged_attention_kernel import items_to_tokens, pages_per_step, work_items

NUM_LANES = 128
TPU_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call."""

    block_q: int
    group: int  # query heads per key head
    kv_heads: int
    head_dim: int
    page_size: int
    pages_per_block: int
    max_pages: int  # page-table columns
    sm_scale: float
    logits_soft_cap: float | None
    window: tuple[int, int] | None
    global_tokens: int
    score: str
    sigmoid_bias: float | None

    @property
    def rows(self) -> int:
        """Rows of a query tile: ``block_q`` queries times the ``group`` heads of a key head."""
        return self.block_q * self.group

    @property
    def tokens_per_block(self) -> int:
        return self.pages_per_block * self.page_size

    @property
    def global_pages(self) -> int:
        """Pages holding the global prefix that every query sees beside its window."""
        return pl.cdiv(self.global_tokens, self.page_size) if self.window is not None else 0

    @functools.cached_property
    def mask(self) -> BlockMask:
        local = None if self.window is None else LocalGlobalMask(self.window[0], 0, self.global_tokens)
        return combine_masks(CausalMask(), local)


class _Refs(NamedTuple):
    """The SMEM tables, the HBM caches and the VMEM page buffers with their semaphores."""

    page_table: Any  # [num_seqs * max_pages] int32
    item_seq: Any  # [items] int32
    item_first_pos: Any  # [items] int32
    item_rows: Any  # [items] int32
    k_hbm: Any  # [num_pages, page_size, kv_heads, head_dim]
    v_hbm: Any
    k_buf: Any  # [2, pages_per_block, page_size, kv_heads, head_dim]
    v_buf: Any
    sems: Any  # DMA semaphores [2], one per buffer slot


class _Item(NamedTuple):
    """One item's scalars and its KV steps: ``num_steps`` blocks of ``pages_per_block``
    pages, first the global prefix's ``global_steps`` blocks ``0, 1, ..``, then the window's
    from ``first_block``. Its rows see the pages ``[low_page, high_page)`` and the global
    prefix's."""

    seq: Any
    first_pos: Any
    rows: Any
    global_steps: Any
    first_block: Any
    num_steps: Any
    low_page: Any
    high_page: Any

    def block(self, step):
        """The KV block (in units of ``pages_per_block`` pages) of step ``step``."""
        return jnp.where(step < self.global_steps, step, self.first_block + step - self.global_steps)


def _item(config: _Config, refs: _Refs, w) -> _Item:
    """Item ``w``'s steps, from its SMEM scalars (an item without rows has none)."""
    seq, first_pos, rows = refs.item_seq[w], refs.item_first_pos[w], refs.item_rows[w]
    tokens = config.tokens_per_block
    first_visible = 0 if config.window is None else jnp.maximum(first_pos - config.window[0], 0)
    first_block = lax.div(first_visible, tokens)
    end_pos = first_pos + rows
    end_block = jnp.where(rows > 0, pl.cdiv(end_pos, tokens), first_block)
    global_steps = 0
    if config.global_pages:
        # The global prefix's blocks before the window's first one (that one and the later
        # ones are the window's steps), so no block is visited twice.
        global_steps = jnp.where(rows > 0, jnp.minimum(pl.cdiv(config.global_tokens, tokens), first_block), 0)
    num_steps = global_steps + end_block - first_block
    low_page, high_page = lax.div(first_visible, config.page_size), pl.cdiv(end_pos, config.page_size)
    return _Item(seq, first_pos, rows, global_steps, first_block, num_steps, low_page, high_page)


def _page_seen(config: _Config, item: _Item, page_index):
    """Whether some row of ``item`` sees a position in its page ``page_index`` (scalar or array)."""
    from_window_start = page_index >= item.low_page
    if config.global_pages:
        from_window_start = from_window_start | (page_index < config.global_pages)
    return from_window_start & (page_index < item.high_page)


def _page_copies(config: _Config, refs: _Refs, item: _Item, step, slot):
    """``[(run, copy)]``: the DMAs of step ``step``'s K and V pages into buffer ``slot``;
    ``run`` says whether the page is seen (unseen pages are not copied)."""
    copies = []
    for i in range(config.pages_per_block):
        page_index = item.block(step) * config.pages_per_block + i
        row = item.seq * config.max_pages + jnp.minimum(page_index, config.max_pages - 1)
        page = refs.page_table[row]
        for hbm, buf in ((refs.k_hbm, refs.k_buf), (refs.v_hbm, refs.v_buf)):
            copy = pltpu.make_async_copy(hbm.at[page], buf.at[slot, i], refs.sems.at[slot])
            copies.append((_page_seen(config, item, page_index), copy))
    return copies


def _start(copies) -> None:
    for run, copy in copies:
        pl.when(run)(copy.start)


def _wait(copies) -> None:
    for run, copy in copies:
        pl.when(run)(copy.wait)


def _head_tile(buf, slot, kv_head: int, config: _Config):
    """Key head ``kv_head``'s rows ``[pages_per_block * page_size, head_dim]`` of slot
    ``slot`` of a page buffer ``[2, pages_per_block, page_size, kv_heads, head_dim]``: a
    sublane-strided read (every ``kv_heads``-th row of the slot)."""
    return buf[slot, :, :, kv_head, :].reshape(config.tokens_per_block, config.head_dim)


def _fold_block(config: _Config, refs: _Refs, q_ref, item: _Item, step, slot, max_ref, sum_ref, acc_ref) -> None:
    """Folds the KV block of ``step`` (in buffer ``slot``) into every key head's running
    softmax (or sigmoid sum)."""
    tokens = config.tokens_per_block
    kv_start = item.block(step) * tokens
    shape = (config.rows, tokens)
    query_row = lax.div(lax.broadcasted_iota(jnp.int32, shape, 0), config.group)
    kv_pos = kv_start + lax.broadcasted_iota(jnp.int32, shape, 1)
    visible = config.mask.visible(item.first_pos + query_row, kv_pos) & (query_row < item.rows)
    # Slots of pages that were not copied hold stale data, and so do the cache positions
    # past the item's last row (a reused page's unwritten tail), maybe NaN: 0 * NaN would
    # reach the output through p @ v even with p = 0.
    value_pos = kv_start + lax.broadcasted_iota(jnp.int32, (tokens, config.head_dim), 0)
    value_read = _page_seen(config, item, lax.div(value_pos, config.page_size))
    value_read = value_read & (value_pos < item.first_pos + item.rows)
    for g in range(config.kv_heads):
        k = _head_tile(refs.k_buf, slot, g, config)
        v = jnp.where(value_read, _head_tile(refs.v_buf, slot, g, config), 0)
        logits = lax.dot_general(q_ref[g], k, _NT_DIMS, preferred_element_type=jnp.float32) * config.sm_scale
        logits = soft_cap(logits, config.logits_soft_cap)
        if config.score == "sigmoid":
            weights = jnp.where(visible, jax.nn.sigmoid(logits + config.sigmoid_bias), 0.0)
            acc_ref[g] += jnp.dot(weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        else:
            carry = (per_row(max_ref.at[g]), per_row(sum_ref.at[g]), acc_ref[g])
            row_max, row_sum, acc = online_softmax_step(carry, logits, visible, v)
            set_per_row(max_ref.at[g], row_max)
            set_per_row(sum_ref.at[g], row_sum)
            acc_ref[g] = acc


def _kernel(
    page_table_ref,
    seq_ref,
    first_pos_ref,
    rows_ref,
    q_ref,
    k_hbm,
    v_hbm,
    o_ref,
    k_buf,
    v_buf,
    sems,
    slot_ref,
    max_ref,
    sum_ref,
    acc_ref,
    *,
    config: _Config,
):
    """Program ``w``: item ``w``'s queries ``q_ref [kv_heads, rows, head_dim]`` against its
    KV steps, writing ``o_ref`` like ``q_ref``. ``slot_ref`` (SMEM ``[1]``) holds the buffer
    slot its first step's pages were prefetched into."""
    refs = _Refs(page_table_ref, seq_ref, first_pos_ref, rows_ref, k_hbm, v_hbm, k_buf, v_buf, sems)
    w, num_items = pl.program_id(0), pl.num_programs(0)
    item = _item(config, refs, w)
    next_item = _item(config, refs, jnp.minimum(w + 1, num_items - 1))

    @pl.when(w == 0)
    def _prime():
        slot_ref[0] = 0
        _start(_page_copies(config, refs, item, 0, 0))

    max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
    sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    first_slot = slot_ref[0]

    def visit(step, carry):
        slot = lax.rem(first_slot + step, 2)

        @pl.when(step + 1 < item.num_steps)
        def _prefetch_next_step():
            _start(_page_copies(config, refs, item, step + 1, 1 - slot))

        @pl.when((step + 1 == item.num_steps) & (w + 1 < num_items))
        def _prefetch_next_item():
            _start(_page_copies(config, refs, next_item, 0, 1 - slot))

        _wait(_page_copies(config, refs, item, step, slot))
        _fold_block(config, refs, q_ref, item, step, slot, max_ref, sum_ref, acc_ref)
        return carry

    lax.fori_loop(0, item.num_steps, visit, 0)
    slot_ref[0] = lax.rem(first_slot + item.num_steps, 2)
    for g in range(config.kv_heads):
        if config.score == "sigmoid":
            out = acc_ref[g]
        else:
            out = online_softmax_result((per_row(max_ref.at[g]), per_row(sum_ref.at[g]), acc_ref[g]))
        o_ref[g] = out.astype(o_ref.dtype)


def _to_heads_major(x, config: _Config):
    """``[items, block_q, heads, head_dim]`` -> ``[items, kv_heads, block_q * group, head_dim]``."""
    items = x.shape[0]
    x = x.reshape(items, config.block_q, config.kv_heads, config.group, config.head_dim)
    return jnp.swapaxes(x, 1, 2).reshape(items, config.kv_heads, config.rows, config.head_dim)


def _from_heads_major(x, config: _Config):
    """The inverse of :func:`_to_heads_major`."""
    items = x.shape[0]
    x = x.reshape(items, config.kv_heads, config.block_q, config.group, config.head_dim)
    return jnp.swapaxes(x, 1, 2).reshape(items, config.block_q, config.kv_heads * config.group, config.head_dim)


def ragged_paged_attention_tpu(
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
    """The TPU path of ``ragged_paged_attention`` (arguments already validated, as for
    :func:`~ember.kernels_pallas.ragged_paged_attention_kernel.ragged_paged_attention_kernel`;
    ``interpret`` is ``pallas_call``'s argument). Queries are cast to the cache's dtype for
    the MXU; the result is ``[num_tokens, heads, head_dim]`` in ``q.dtype``.

    Raises:
      ValueError: for caches that are not both float32 or both bfloat16, or a bad
        ``pages_per_block``.
    """
    if k_pages.dtype not in TPU_DTYPES or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            "k_pages, v_pages: the TPU kernel takes float32 or bfloat16 caches of one dtype, "
            f"got {k_pages.dtype} and {v_pages.dtype}"
        )
    pages_per_block = pages_per_step(pages_per_block, cache)
    num_tokens, heads, head_dim = q.shape
    config = _Config(
        block_q=block_q,
        group=heads // cache.kv_heads,
        kv_heads=cache.kv_heads,
        head_dim=head_dim,
        page_size=cache.page_size,
        pages_per_block=pages_per_block,
        max_pages=cache.max_pages_per_seq,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        window=window,
        score=score,
        sigmoid_bias=sigmoid_bias,
        global_tokens=global_tokens,
    )
    query_starts, query_lens, kv_lens = (x.astype(jnp.int32) for x in (query_starts, query_lens, kv_lens))
    table, offsets = work_items(query_starts, query_lens, kv_lens, num_tokens=num_tokens, block_q=block_q)
    seq, token_start, rows, first_pos = (table[:, column] for column in range(4))
    num_items = table.shape[0]
    # block_q spare rows so the last item's gather stays in bounds.
    q_rows = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))[token_start[:, None] + jnp.arange(block_q)]
    q_items = _to_heads_major(q_rows.astype(k_pages.dtype), config)
    item_tile = pl.BlockSpec((None, config.kv_heads, config.rows, head_dim), lambda w, *_: (w, 0, 0, 0))
    page_buffer = pltpu.VMEM((2, config.pages_per_block, config.page_size, config.kv_heads, head_dim), k_pages.dtype)
    per_row_column = pltpu.VMEM((config.kv_heads, config.rows, NUM_LANES), jnp.float32)
    out_items = pl.pallas_call(
        functools.partial(_kernel, config=config),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_items,),
            in_specs=[item_tile, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=item_tile,
            scratch_shapes=[
                page_buffer,  # K pages, two slots
                page_buffer,  # V pages, two slots
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((1,), jnp.int32),  # the slot the next item's first pages go to
                per_row_column,  # running row max
                per_row_column,  # running row sum
                pltpu.VMEM((config.kv_heads, config.rows, head_dim), jnp.float32),  # output accumulator
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_items.shape, q_items.dtype),
        # The page copies chain across programs, which must therefore run in order on one core.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(page_table.astype(jnp.int32).reshape(-1), seq, first_pos, rows, q_items, k_pages, v_pages)
    out_items = _from_heads_major(out_items, config)
    return items_to_tokens(out_items, offsets, query_starts, owner, covered).astype(q.dtype)

"""ragged_paged_attention's TPU (Mosaic TPU) kernel in JAX's TPU interpret mode: the GPU
tests' mixed serving step (prefill chunks, decodes, an unused slot, partial pages, padding
rows) and a decode-only step, in float32 and bfloat16, with every option (GQA/MQA, soft cap,
window, global tokens, sigmoid), against the reference with NaN in every page no query may
read; JAX's own TPU op on a shared step (its reference function: JAX 0.10.2's TPU interpret
mode cannot run its kernel, failing on reshaped VMEM refs); and the Mosaic TPU lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jax_ragged

from ember.kernels_pallas.ragged_paged_attention import (
    check_paged_cache,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    token_owners,
)
from ember.kernels_pallas.ragged_paged_attention_tpu import ragged_paged_attention_tpu
from tests.kernels_pallas.paged_checks import random_normal, random_paged_cache
from tests.kernels_pallas.test_ragged_paged_attention import (
    KV_LENS,
    NUM_TOKENS,
    PADDING_ROWS,
    PAGE_SIZE,
    QUERY_LENS,
    QUERY_STARTS,
)
from tests.tolerances import assert_allclose

MIXED_STEP = (QUERY_STARTS, QUERY_LENS, KV_LENS)
# A step of decodes only, runs out of order in a budget of 8 (rows 4, 5 and 7 are padding):
# positions 39 and 32 (a window of 4 skips pages between the global prefix and the window),
# 8 (the first token of a page), 0, 16, and an unused slot.
DECODE_STEP = tuple(jnp.array(x, jnp.int32) for x in ([3, 0, 6, 1, 2, 5], [1, 1, 1, 1, 1, 0], [40, 33, 9, 1, 17, 0]))
# Softmax over a window plus soft cap, shared with the comparison against JAX's op.
WINDOW_SOFT_CAP = dict(window=(5, 0), logits_soft_cap=3.0)


def _inputs(rng, dtype, step, *, heads, kv_heads, head_dim, num_tokens, max_pages_per_seq):
    k_cache, k_query = jax.random.split(rng)
    k_pages, v_pages, page_table = random_paged_cache(
        k_cache,
        num_pages=40,
        page_size=PAGE_SIZE,
        kv_heads=kv_heads,
        head_dim=head_dim,
        num_seqs=step[0].shape[0],
        max_pages_per_seq=max_pages_per_seq,
        dtype=dtype,
    )
    return random_normal(k_query, (num_tokens, heads, head_dim), dtype), k_pages, v_pages, page_table


def _unread_pages_poisoned(pages, page_table, step, *, window=None, global_tokens=0, **_):
    """``pages`` with NaN in every page of the table that holds no position a query of its
    sequence sees (unused table slots, and with a window the pages between the global prefix
    and the window): a page the kernel used anyway would put NaN in the output."""
    poisoned = np.array(pages)
    for seq, (_, query_len, kv_len) in enumerate(zip(*(np.asarray(m) for m in step))):
        seen = set()
        for position in range(kv_len - query_len, kv_len):
            first = 0 if window is None else max(position - window[0], 0)
            visible = [*range(first, position + 1), *range(min(global_tokens, position + 1))]
            seen.update(t // PAGE_SIZE for t in visible)
        for slot, page in enumerate(np.asarray(page_table)[seq]):
            if slot not in seen:
                poisoned[page] = np.nan
    return jnp.asarray(poisoned)


def _check_against_reference(rng, dtype, step, *, block_q, pages_per_block, shape, options):
    """Runs the TPU kernel on a cache with NaN in its unread pages; asserts it equals the
    reference on the clean cache (zeros on padding rows). Returns ``(out, inputs)``."""
    q, k_pages, v_pages, page_table = inputs = _inputs(rng, dtype, step, **shape)
    poisoned = (_unread_pages_poisoned(x, page_table, step, **options) for x in (k_pages, v_pages))
    out = ragged_paged_attention(
        q,
        *poisoned,
        page_table,
        *step,
        block_q=block_q,
        pages_per_block=pages_per_block,
        impl="interpret_tpu",
        **options,
    )
    as_f32 = [x.astype(jnp.float32) for x in (q, k_pages, v_pages)]
    expected = jax.jit(lambda *a: ragged_paged_attention_reference(*a, **options))(*as_f32, page_table, *step)
    assert out.dtype == dtype
    assert_allclose(out, expected, dtype=dtype)
    _, _, covered = token_owners(*step, q.shape[0])
    assert np.all(np.asarray(out)[~np.asarray(covered)] == 0.0)
    return out, inputs


MIXED_SHAPE = dict(heads=8, kv_heads=2, head_dim=64, num_tokens=NUM_TOKENS, max_pages_per_seq=4)


@pytest.mark.parametrize(
    "dtype, block_q, pages_per_block, shape, options",
    [
        (jnp.float32, 8, 1, MIXED_SHAPE, {}),
        (jnp.float32, 8, 2, MIXED_SHAPE, WINDOW_SOFT_CAP),
        # Global prefix over two pages (positions 0..10); seq 3's window starts past it.
        (jnp.bfloat16, 16, 2, MIXED_SHAPE, dict(window=(5, 0), global_tokens=11, logits_soft_cap=3.0)),
        # MQA, sigmoid scores; a block of 4 pages is the whole table row.
        (
            jnp.bfloat16,
            16,
            4,
            dict(MIXED_SHAPE, heads=4, kv_heads=1),
            dict(score="sigmoid", sigmoid_bias=-2.0, window=(3, 0), global_tokens=9),
        ),
    ],
)
def test_tpu_kernel_matches_reference_on_a_mixed_step(rng, dtype, block_q, pages_per_block, shape, options):
    out, _ = _check_against_reference(
        rng, dtype, MIXED_STEP, block_q=block_q, pages_per_block=pages_per_block, shape=shape, options=options
    )
    assert np.all(np.asarray(out[PADDING_ROWS]) == 0.0)


def _stale_positions_poisoned(pages, page_table, kv_lens):
    """``pages`` with NaN at every cache position ``>= kv_lens[s]`` of each sequence's table
    slots: the unwritten tail of its last page (a reused page keeps its previous owner's
    keys and values there) and the slots past it."""
    poisoned = np.array(pages)
    page_size = poisoned.shape[1]
    for seq, kv_len in enumerate(np.asarray(kv_lens)):
        for slot, page in enumerate(np.asarray(page_table)[seq]):
            poisoned[page, max(kv_len - slot * page_size, 0) :] = np.nan
    return jnp.asarray(poisoned)


@pytest.mark.parametrize("impl", ["interpret_tpu", "interpret", "xla"])
def test_stale_cache_positions_past_kv_lens_do_not_reach_the_output(rng, impl):
    """Positions no query may see (past ``kv_lens``, partial last pages included) hold NaN:
    every path gives the reference's values on the clean cache. (They gave NaN: the last
    page's masked positions still entered ``p @ v`` as 0 * NaN.)"""
    q, k_pages, v_pages, page_table = _inputs(rng, jnp.float32, MIXED_STEP, **MIXED_SHAPE)
    poisoned = (_stale_positions_poisoned(x, page_table, MIXED_STEP[2]) for x in (k_pages, v_pages))
    out = ragged_paged_attention(q, *poisoned, page_table, *MIXED_STEP, block_q=8, pages_per_block=2, impl=impl)
    expected = jax.jit(ragged_paged_attention_reference)(q, k_pages, v_pages, page_table, *MIXED_STEP)
    assert_allclose(out, expected)


def test_tpu_kernel_matches_reference_on_a_decode_step(rng):
    """Decodes only, out of order, odd lengths; the kernel reads the global prefix's page
    and the window's pages, never the unused table slots or the pages between."""
    shape = dict(heads=4, kv_heads=2, head_dim=32, num_tokens=8, max_pages_per_seq=5)
    options = dict(window=(4, 0), global_tokens=8, logits_soft_cap=5.0)
    _check_against_reference(rng, jnp.float32, DECODE_STEP, block_q=8, pages_per_block=2, shape=shape, options=options)


def _jax_layout(q, k_pages, v_pages, page_table, query_starts, query_lens, kv_lens):
    """Our step in the arguments of JAX's op (runs packed in order from row 0): K and V
    heads interleaved in one cache ``[num_pages, page_size, 2 * kv_heads, head_dim]``, and
    cumulative query lengths."""
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    kv_pages = jnp.stack([k_pages, v_pages], axis=3).reshape(num_pages, page_size, 2 * kv_heads, head_dim)
    cu_q_lens = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    np.testing.assert_array_equal(cu_q_lens[:-1], query_starts)
    num_seqs = np.array([page_table.shape[0]], np.int32)
    return q, kv_pages, np.asarray(kv_lens), np.asarray(page_table), cu_q_lens, num_seqs


def _jax_options(head_dim, window, logits_soft_cap):
    # JAX's window counts the query itself: it sees keys p - sliding_window + 1 .. p.
    return dict(sm_scale=head_dim**-0.5, sliding_window=window[0] + 1, soft_cap=logits_soft_cap)


def test_tpu_kernel_matches_jax_ragged_paged_attention(rng):
    """The mixed step against the reference of JAX's TPU ``ragged_paged_attention``
    (metadata concrete, as its per-sequence loop needs)."""
    out, inputs = _check_against_reference(
        rng, jnp.float32, MIXED_STEP, block_q=8, pages_per_block=2, shape=MIXED_SHAPE, options=WINDOW_SOFT_CAP
    )
    q, kv_pages, *metadata = _jax_layout(*inputs, *MIXED_STEP)
    jax_options = _jax_options(q.shape[-1], **WINDOW_SOFT_CAP)
    expected = jax.jit(lambda q, kv: jax_ragged.ref_ragged_paged_attention(q, kv, *metadata, **jax_options))(
        q, kv_pages
    )
    covered = int(np.sum(QUERY_LENS))
    assert_allclose(out[:covered], expected)


def test_tpu_kernel_matches_jax_paged_attention_kernel_on_a_decode_step(rng):
    """A decode step (one token per sequence, odd lengths, soft cap) against JAX's TPU
    ``paged_attention`` kernel, both run in TPU interpret mode on a bf16 cache. (JAX 0.10.2's
    TPU interpret mode cannot run its ``ragged_paged_attention`` kernel: it fails on reshaped
    VMEM refs; its reference is compared above.)"""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    num_seqs, head_dim = 3, 128
    kv_lens = jnp.array([29, 9, 32], jnp.int32)  # of at most 4 pages of 8
    step = (jnp.arange(num_seqs, dtype=jnp.int32), jnp.ones((num_seqs,), jnp.int32), kv_lens)
    q, k_pages, v_pages, page_table = _inputs(
        rng, jnp.bfloat16, step, heads=4, kv_heads=2, head_dim=head_dim, num_tokens=num_seqs, max_pages_per_seq=4
    )
    ours = ragged_paged_attention(q, k_pages, v_pages, page_table, *step, logits_soft_cap=3.0, impl="interpret_tpu")
    heads_first = (jnp.moveaxis(pages, 2, 0) for pages in (k_pages, v_pages))  # [kv_heads, pages, page, dim]
    with pltpu.force_tpu_interpret_mode():
        theirs = paged_attention(
            (q * head_dim**-0.5).astype(q.dtype),
            *heads_first,
            kv_lens,
            page_table,
            attn_logits_soft_cap=3.0,
            pages_per_compute_block=2,
        )
    assert_allclose(ours, theirs)


@pytest.mark.parametrize(
    "dtype, heads, kv_heads, options",
    [
        (jnp.float32, 8, 2, dict(window=(5, 0), global_tokens=11, logits_soft_cap=3.0)),
        (jnp.bfloat16, 4, 1, dict(score="sigmoid", sigmoid_bias=-2.0)),
    ],
)
def test_tpu_kernel_lowers_for_mosaic_tpu(dtype, heads, kv_heads, options):
    """Compiled (not interpreted), the kernel passes Pallas's Mosaic TPU lowering (block
    shapes, scalar prefetch, DMAs, semaphores); and ``impl="interpret_tpu"`` runs it."""
    q = jax.ShapeDtypeStruct((NUM_TOKENS, heads, 64), dtype)
    pages = jax.ShapeDtypeStruct((40, PAGE_SIZE, kv_heads, 64), dtype)
    page_table = jax.ShapeDtypeStruct((QUERY_LENS.shape[0], 4), jnp.int32)
    metadata = [jax.ShapeDtypeStruct(m.shape, jnp.int32) for m in MIXED_STEP]
    score = options.get("score", "softmax")

    def compiled(q, k_pages, v_pages, page_table, *step):
        owner, _, covered = token_owners(*step, q.shape[0])
        cache = check_paged_cache(k_pages, v_pages, page_table, num_seqs=page_table.shape[0], heads=heads, head_dim=64)
        return ragged_paged_attention_tpu(
            q,
            k_pages,
            v_pages,
            page_table,
            *step,
            owner=owner,
            covered=covered,
            cache=cache,
            sm_scale=0.125,
            logits_soft_cap=options.get("logits_soft_cap"),
            window=options.get("window"),
            score=score,
            sigmoid_bias=options.get("sigmoid_bias"),
            global_tokens=options.get("global_tokens", 0),
            block_q=16,
            pages_per_block=2,
            interpret=False,
        )

    lowered = jax.jit(compiled).trace(q, pages, pages, page_table, *metadata).lower(lowering_platforms=("tpu",))
    assert lowered.as_text().count("tpu_custom_call") == 1
    interpreted = jax.make_jaxpr(lambda *a: ragged_paged_attention(*a, impl="interpret_tpu", **options))
    assert "ragged_paged_attention_tpu" in str(interpreted(q, pages, pages, page_table, *metadata))


def test_tpu_kernel_refuses_float16_and_mixed_caches(rng):
    q, k_pages, v_pages, page_table = _inputs(rng, jnp.float16, MIXED_STEP, **MIXED_SHAPE)
    message = "k_pages, v_pages: the TPU kernel takes float32 or bfloat16 caches of one dtype, got"
    with pytest.raises(ValueError, match=f"{message} float16 and float16"):
        ragged_paged_attention(q, k_pages, v_pages, page_table, *MIXED_STEP, impl="interpret_tpu")
    k_pages, v_pages = k_pages.astype(jnp.bfloat16), v_pages.astype(jnp.float32)
    with pytest.raises(ValueError, match=f"{message} bfloat16 and float32"):
        ragged_paged_attention(q, k_pages, v_pages, page_table, *MIXED_STEP, impl="interpret_tpu")

"""ragged_paged_attention: mixed prefill chunks and decodes in one call, the Pallas kernel
(interpret mode) and the XLA path against the reference; the reference against
hand-computed causal, windowed, local + global and sigmoid attention per sequence (decode
rows included); the kernel skips the pages no query sees; split KV (``kv_splits``) gives
the unsplit kernel's values."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.kernels_pallas.block_mask import CausalMask, LocalGlobalMask, combine_masks
from ember.kernels_pallas.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from ember.kernels_pallas.ragged_paged_attention_kernel import MAX_ROWS, gpu_block_q, gpu_kv_splits, work_items
from tests.kernels_pallas.flash_checks import FAST_COMPILE
from tests.kernels_pallas.paged_checks import contiguous_cache, random_normal, random_paged_cache
from tests.tolerances import assert_allclose

PAGE_SIZE = 8
NUM_TOKENS = 48
# One step of a serving loop (page size 8, token budget 48):
#   seq 0: prefill of a fresh prompt, 5 tokens             (cache 5)
#   seq 1: decode                                          (cache 17: one past two pages)
#   seq 2: unused slot                                     (no tokens)
#   seq 3: prefill chunk continuing a prompt across pages  (tokens 12..29 of 30)
#   seq 4: decode with exactly one page cached             (cache 8)
#   seq 5: decode of the first token                       (cache 1)
#   seq 6: prefill chunk filling the table exactly         (tokens 17..31 of 32)
# Rows 41..47 of the budget are padding.
QUERY_STARTS = jnp.array([0, 5, 6, 6, 24, 25, 26], jnp.int32)
QUERY_LENS = jnp.array([5, 1, 0, 18, 1, 1, 15], jnp.int32)
KV_LENS = jnp.array([5, 17, 0, 30, 8, 1, 32], jnp.int32)
PADDING_ROWS = slice(41, None)


def _setup(rng, dtype, heads=8, kv_heads=2, head_dim=64):
    k_cache, k_query = jax.random.split(rng)
    k_pages, v_pages, page_table = random_paged_cache(
        k_cache,
        num_pages=40,
        page_size=PAGE_SIZE,
        kv_heads=kv_heads,
        head_dim=head_dim,
        num_seqs=QUERY_LENS.shape[0],
        max_pages_per_seq=4,
        dtype=dtype,
    )
    q = random_normal(k_query, (NUM_TOKENS, heads, head_dim), dtype)
    return q, k_pages, v_pages, page_table


def _metadata():
    return QUERY_STARTS, QUERY_LENS, KV_LENS


@pytest.mark.parametrize(
    "dtype, block_q, pages_per_block, options",
    [
        (jnp.float32, 8, 1, {}),
        (jnp.bfloat16, 16, 2, {}),
        (jnp.float32, 16, 1, dict(window=(6, 0), logits_soft_cap=3.0)),
        (jnp.float32, 8, 1, dict(score="sigmoid", sigmoid_bias=-math.log(32))),
        (jnp.bfloat16, 16, 2, dict(score="sigmoid", sigmoid_bias=-2.0, logits_soft_cap=3.0)),
        # Global prefix over two pages (positions 0..10); seq 3's window starts past it
        # (up to position 24), seqs 0, 4 and 5 have queries inside it.
        (jnp.float32, 8, 1, dict(window=(5, 0), global_tokens=11)),
        (jnp.bfloat16, 16, 2, dict(window=(3, 0), global_tokens=9, score="sigmoid", sigmoid_bias=-3.0)),
    ],
)
def test_kernel_matches_reference(rng, dtype, block_q, pages_per_block, options):
    q, k_pages, v_pages, page_table = _setup(rng, dtype)
    kernel = jax.jit(
        lambda *a: ragged_paged_attention(
            *a, block_q=block_q, pages_per_block=pages_per_block, impl="interpret", **options
        ),
        compiler_options=FAST_COMPILE,
    )
    out = kernel(q, k_pages, v_pages, page_table, *_metadata())
    as_f32 = [x.astype(jnp.float32) for x in (q, k_pages, v_pages)]
    expected = jax.jit(lambda *a: ragged_paged_attention_reference(*a, **options))(*as_f32, page_table, *_metadata())
    assert out.dtype == dtype
    assert_allclose(out, expected, dtype=dtype)
    assert np.all(np.asarray(out[PADDING_ROWS]) == 0.0)


@pytest.mark.parametrize(
    "heads, kv_heads, block_q, programs_per_item",
    [
        (6, 2, 8, 2),  # a group of 3 padded to 4 in the tile: one program per key head
        (8, 1, 8, 1),  # MQA: one program per item
        (3, 3, 8, 3),  # MHA: group 1
        (8, 1, MAX_ROWS // 4, 2),  # MAX_ROWS / 4 positions x 8 heads: the group in two shares of 4
    ],
)
def test_kernel_reads_each_key_head_once_for_its_query_group(rng, heads, kv_heads, block_q, programs_per_item):
    """A program serves the query heads of one key head (up to MAX_ROWS rows), so a page is
    read once per key head, not once per query head."""
    q, k_pages, v_pages, page_table = _setup(rng, jnp.float32, heads=heads, kv_heads=kv_heads, head_dim=16)
    attend = lambda *a: ragged_paged_attention(*a, block_q=block_q, impl="interpret")  # noqa: E731
    out = jax.jit(attend, compiler_options=FAST_COMPILE)(q, k_pages, v_pages, page_table, *_metadata())
    expected = jax.jit(ragged_paged_attention_reference)(q, k_pages, v_pages, page_table, *_metadata())
    assert_allclose(out, expected)
    assert np.all(np.asarray(out[PADDING_ROWS]) == 0.0)
    jaxpr = str(jax.make_jaxpr(attend)(q, k_pages, v_pages, page_table, *_metadata()))
    assert re.search(rf"grid=\(\d+, {programs_per_item}\)", jaxpr), "programs per work item"


def test_the_work_list_is_computed_without_a_loop():
    """Sequence ``s`` owns items ``offsets[s]..``; the list is one fused comparison, not a loop
    of small kernels (a GPU runs those one at a time, in every serving step)."""
    lens = jnp.asarray([3, 0, 5, 1], jnp.int32)
    arguments = (jnp.asarray([0, 3, 3, 8], jnp.int32), lens, lens + 2)
    table, offsets = work_items(*arguments, num_tokens=9, block_q=2)
    np.testing.assert_array_equal(np.asarray(offsets), [0, 2, 2, 5])
    np.testing.assert_array_equal(np.asarray(table[:6, 0]), [0, 0, 2, 2, 2, 3])  # each item's sequence
    jaxpr = str(jax.make_jaxpr(lambda *a: work_items(*a, num_tokens=9, block_q=2))(*arguments))
    assert "scan[" not in jaxpr and "while[" not in jaxpr


def test_gpu_kernel_sizes_its_blocks_to_the_runs_when_left_to_choose(rng):
    """block_q=None: a decode step (one token per sequence) gets just enough positions for 16
    rows, a mixed batch the mean run rounded up to a power of two, long runs 16; the kernel
    run that way still matches the reference."""
    assert gpu_block_q(num_tokens=64, num_seqs=64, heads=32, kv_heads=8) == 4  # 4 x group 4
    assert gpu_block_q(num_tokens=64, num_seqs=64, heads=6, kv_heads=2) == 4  # group 3 padded to 4
    assert gpu_block_q(num_tokens=64, num_seqs=64, heads=8, kv_heads=8) == 16  # MHA: 16 x 1
    assert gpu_block_q(num_tokens=64, num_seqs=64, heads=32, kv_heads=1) == 1  # MQA: 32 rows
    assert gpu_block_q(num_tokens=48, num_seqs=7, heads=8, kv_heads=2) == 8  # mean run 6
    assert gpu_block_q(num_tokens=4096, num_seqs=4, heads=8, kv_heads=2) == 16
    num_seqs = 6
    q, k_pages, v_pages, page_table = _setup(rng, jnp.float32, heads=8, kv_heads=2, head_dim=16)
    decode = (jnp.arange(num_seqs, dtype=jnp.int32), jnp.ones(num_seqs, jnp.int32), KV_LENS[:num_seqs] + 1)
    q, page_table = q[:num_seqs], page_table[:num_seqs]
    attend = lambda *a: ragged_paged_attention(*a, impl="interpret")  # noqa: E731
    out = jax.jit(attend, compiler_options=FAST_COMPILE)(q, k_pages, v_pages, page_table, *decode)
    assert_allclose(out, jax.jit(ragged_paged_attention_reference)(q, k_pages, v_pages, page_table, *decode))
    jaxpr = str(jax.make_jaxpr(attend)(q, k_pages, v_pages, page_table, *decode))
    assert re.search(r"float32\[\d+,2,16,16\]", jaxpr), "[items, kv_heads, 16 rows, head_dim] outputs"


# A decode step of sequences of very different lengths (page size 8, 4 pages a sequence): one
# or four blocks of one page, so 2, 3 and 6 splits leave some splits of each without blocks.
DECODE_KV_LENS = jnp.array([1, 5, 9, 17, 26, 32], jnp.int32)


@pytest.mark.parametrize(
    "batch, options",
    [
        ("decode", {}),
        ("mixed", {}),
        # Global prefix of one page; the window's blocks start past the next one for seq 6's
        # last item (positions 25..31), so its visible blocks are 0, 2, 3.
        ("mixed", dict(window=(3, 0), global_tokens=8)),
        ("mixed", dict(score="sigmoid", sigmoid_bias=-2.0)),
    ],
)
def test_split_kv_matches_the_unsplit_kernel_and_the_reference(rng, batch, options):
    """kv_splits 1, 2, 3 and more than a sequence's 4 blocks: each split reads its share of
    the visible blocks (global prefix, then window) and the merged partials give the
    reference's values, and the unsplit kernel's to float tolerance; splits with no blocks
    (short sequences, padding items) add nothing, and padding rows stay zero."""
    q, k_pages, v_pages, page_table = _setup(rng, jnp.float32, heads=4, kv_heads=2, head_dim=16)
    if batch == "decode":
        num_seqs = DECODE_KV_LENS.shape[0]
        q, page_table = q[: num_seqs + 2], page_table[:num_seqs]  # two padding rows
        metadata = (jnp.arange(num_seqs, dtype=jnp.int32), jnp.ones(num_seqs, jnp.int32), DECODE_KV_LENS)
        padding = slice(num_seqs, None)
    else:
        metadata, padding = _metadata(), PADDING_ROWS
    expected = jax.jit(lambda *a: ragged_paged_attention_reference(*a, **options))(
        q, k_pages, v_pages, page_table, *metadata
    )
    outs = {}
    for kv_splits in (1, 2, 3, 6):
        attend = lambda *a, s=kv_splits: ragged_paged_attention(  # noqa: E731
            *a, block_q=8, pages_per_block=1, kv_splits=s, impl="interpret", **options
        )
        outs[kv_splits] = jax.jit(attend, compiler_options=FAST_COMPILE)(q, k_pages, v_pages, page_table, *metadata)
        assert_allclose(outs[kv_splits], expected, err_msg=f"kv_splits={kv_splits}")
        assert_allclose(outs[kv_splits], outs[1], err_msg=f"kv_splits={kv_splits} vs 1")
        assert np.all(np.asarray(outs[kv_splits][padding]) == 0.0)
    jaxpr = str(jax.make_jaxpr(attend)(q, k_pages, v_pages, page_table, *metadata))
    assert re.search(r"grid=\(\d+, 2, 6\)", jaxpr), "[items, kv_heads, kv_splits] programs"


def test_gpu_kernel_splits_kv_when_the_work_items_are_few():
    """kv_splits=None: splits until about 4 programs per SM of a 132-SM GPU, no more than the
    blocks a sequence can have, none when the work items alone are enough."""
    # The benchmark's decode step: 64 items x 8 key heads = 512 programs, 32 blocks of 128 tokens.
    assert gpu_kv_splits(num_tokens=64, num_seqs=64, heads=32, kv_heads=8, block_q=4, seq_blocks=32) == 2
    assert gpu_kv_splits(num_tokens=8, num_seqs=8, heads=32, kv_heads=8, block_q=4, seq_blocks=32) == 9
    assert gpu_kv_splits(num_tokens=8, num_seqs=8, heads=32, kv_heads=8, block_q=4, seq_blocks=4) == 4
    # A padded decode budget counts its sequences, not the grid's padding items.
    assert gpu_kv_splits(num_tokens=64, num_seqs=256, heads=32, kv_heads=8, block_q=4, seq_blocks=32) == 2
    # Prefill: 256 items of 16 tokens x 8 key heads, already 2,048 programs.
    assert gpu_kv_splits(num_tokens=4096, num_seqs=4, heads=32, kv_heads=8, block_q=16, seq_blocks=32) == 1
    # A group of 32 at block_q 16 is served by 4 programs per key head (MAX_ROWS 128).
    assert gpu_kv_splits(num_tokens=16, num_seqs=1, heads=32, kv_heads=1, block_q=16, seq_blocks=256) == 132


def _numpy_causal_run(q_run, keys, values, kv_len, *, window=None, global_tokens=0, sigmoid_bias=None):
    """Hand-computed attention of a run of new queries ``[n, heads, d]`` (the last ``n``
    positions of a ``kv_len``-token sequence) over its contiguous cache, float64: softmax,
    or sigmoid scores with ``sigmoid_bias``. The visible keys come from the block-mask
    descriptions (causal, and a local + global window if ``window``)."""
    n, heads, head_dim = q_run.shape
    group = heads // keys.shape[1]
    masks = [CausalMask()] if window is None else [CausalMask(), LocalGlobalMask(window[0], 0, global_tokens)]
    visible = combine_masks(*masks).dense(kv_len, kv_len)[kv_len - n :]
    out = np.zeros(q_run.shape)
    for i in range(n):
        for h in range(heads):
            logits = keys[:, h // group] @ q_run[i, h] / np.sqrt(head_dim)
            if sigmoid_bias is None:
                weights = np.exp(np.where(visible[i], logits, -np.inf) - logits[visible[i]].max())
                weights = weights / weights.sum()
            else:
                weights = np.where(visible[i], 1.0 / (1.0 + np.exp(-(logits + sigmoid_bias))), 0.0)
            out[i, h] = weights @ values[:, h // group]
    return out


@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(window=(4, 0)),
        dict(window=(4, 0), global_tokens=10),
        dict(score="sigmoid", sigmoid_bias=-2.5),
        dict(window=(2, 0), global_tokens=3, score="sigmoid", sigmoid_bias=-1.0),
        # The XLA path works in blocks of block_q queries of one sequence, as the kernel.
        dict(block_q=4, window=(4, 0), global_tokens=10),
        dict(block_q=1),
    ],
)
def test_xla_path_matches_hand_computed_attention(rng, options):
    q, k_pages, v_pages, page_table = _setup(rng, jnp.float32, heads=4, kv_heads=2, head_dim=16)
    run = jax.jit(lambda *a: ragged_paged_attention(*a, impl="xla", **options))
    out = np.asarray(run(q, k_pages, v_pages, page_table, *_metadata()))
    numpy_options = dict(
        window=options.get("window"),
        global_tokens=options.get("global_tokens", 0),
        sigmoid_bias=options.get("sigmoid_bias"),
    )
    covered = np.zeros(NUM_TOKENS, dtype=bool)
    for seq, (start, n, kv_len) in enumerate(zip(*(np.asarray(m) for m in _metadata()))):
        if n == 0:
            continue
        keys = contiguous_cache(k_pages, page_table, seq, kv_len).astype(np.float64)
        values = contiguous_cache(v_pages, page_table, seq, kv_len).astype(np.float64)
        q_run = np.asarray(q[start : start + n], np.float64)
        expected = _numpy_causal_run(q_run, keys, values, kv_len, **numpy_options)
        assert_allclose(out[start : start + n], expected, dtype=jnp.float32, err_msg=f"sequence {seq}")
        covered[start : start + n] = True
    assert np.all(out[~covered] == 0.0)


@pytest.mark.parametrize(
    "score_options, kv_splits",
    [({}, 1), (dict(score="sigmoid", sigmoid_bias=-2.0), 1), ({}, 3), (dict(score="sigmoid", sigmoid_bias=-2.0), 3)],
)
def test_kernel_skips_pages_between_global_prefix_and_window(rng, score_options, kv_splits):
    """A decode at position 39 with window 4 and 8 global tokens (page size 8) sees pages
    0 and 4 only: NaN keys and values in pages 1..3 must not reach the output (a visited
    page poisons it even when fully masked, as 0 * NaN = NaN). In 3 splits: none, page 0,
    page 4."""
    q, k_pages, v_pages, _ = _setup(rng, jnp.float32, heads=4, kv_heads=2, head_dim=16)
    page_table = jnp.arange(5, dtype=jnp.int32)[None]
    metadata = jnp.array([0], jnp.int32), jnp.array([1], jnp.int32), jnp.array([40], jnp.int32)
    options = dict(window=(4, 0), global_tokens=8, **score_options)
    expected = jax.jit(lambda *a: ragged_paged_attention_reference(*a, **options))(
        q[:1], k_pages, v_pages, page_table, *metadata
    )
    k_poisoned, v_poisoned = (x.at[1:4].set(jnp.nan) for x in (k_pages, v_pages))
    kernel = jax.jit(
        lambda *a: ragged_paged_attention(
            *a, block_q=8, pages_per_block=1, kv_splits=kv_splits, impl="interpret", **options
        ),
        compiler_options=FAST_COMPILE,
    )
    out = kernel(q[:1], k_poisoned, v_poisoned, page_table, *metadata)
    assert_allclose(out, expected)


@pytest.mark.parametrize(
    "change, argument",
    [
        (lambda a: {**a, "q": a["q"][None]}, "q"),
        (lambda a: {**a, "q": a["q"][:, :3]}, "heads"),
        # Zero kv_heads: "integer modulo by zero".
        (
            lambda a: {**a, "k_pages": a["k_pages"][:, :, :0], "v_pages": a["v_pages"][:, :, :0]},
            "which must be positive",
        ),
        (lambda a: {**a, "page_table": a["page_table"][0]}, "page_table"),
        (lambda a: {**a, "query_starts": a["query_starts"][:-1]}, "query_starts"),
        (lambda a: {**a, "query_lens": a["query_lens"].astype(jnp.float32)}, "query_lens"),
        (lambda a: {**a, "kv_lens": a["kv_lens"][None]}, "kv_lens"),
        (lambda a: {**a, "block_q": 0}, "block_q"),
        (lambda a: {**a, "kv_splits": 0}, "kv_splits"),
        (lambda a: {**a, "kv_splits": True}, "kv_splits"),
        (lambda a: {**a, "kv_splits": 2.0}, "kv_splits"),
        # The XLA path ignores pages_per_block, and took any value; the kernels refused it.
        (lambda a: {**a, "pages_per_block": 0}, "pages_per_block must be a positive int or None"),
        (lambda a: {**a, "pages_per_block": 1.5}, "pages_per_block must be a positive int or None"),
        (lambda a: {**a, "score": "relu"}, "score"),
        (lambda a: {**a, "score": "sigmoid"}, "sigmoid_bias"),
        (lambda a: {**a, "score": "sigmoid", "sigmoid_bias": float("inf")}, "sigmoid_bias"),
        (lambda a: {**a, "sigmoid_bias": -1.0}, "sigmoid_bias"),
        (lambda a: {**a, "global_tokens": -1}, "global_tokens"),
        (lambda a: {**a, "logits_soft_cap": float("inf")}, "logits_soft_cap must be a positive finite"),
        # An infinite scale gave NaN outputs.
        (lambda a: {**a, "sm_scale": float("inf")}, "sm_scale must be a finite number"),
        (lambda a: {**a, "global_tokens": 2.0, "window": (4, 0)}, "global_tokens"),
        # An int8 cache (engine kv_dtype="int8") was read as unscaled integers; an int q gave
        # an int output.
        (lambda a: {**a, "k_pages": a["k_pages"].astype(jnp.int8)}, "k_pages and v_pages must be floating-point"),
        (lambda a: {**a, "v_pages": a["v_pages"].astype(jnp.int8)}, "k_pages and v_pages must be floating-point"),
        (lambda a: {**a, "q": a["q"].astype(jnp.int32)}, "q must be a floating-point array"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(rng, change, argument):
    q, k_pages, v_pages, page_table = _setup(rng, jnp.float32, heads=4, kv_heads=2, head_dim=16)
    args = dict(
        q=q,
        k_pages=k_pages,
        v_pages=v_pages,
        page_table=page_table,
        query_starts=QUERY_STARTS,
        query_lens=QUERY_LENS,
        kv_lens=KV_LENS,
    )
    with pytest.raises(ValueError, match=argument):
        ragged_paged_attention(**change(args), impl="xla")

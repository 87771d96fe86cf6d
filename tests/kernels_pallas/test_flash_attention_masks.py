"""flash_attention masking and scores: segments, windows, soft cap, sigmoid, every block-mask
kind, fully masked rows, real block skipping, and a hypothesis sweep over small shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.kernels_pallas.block_mask import (
    CausalMask,
    ChunkedCausalMask,
    ExplicitBlockMask,
    LiveBlocks,
    LocalGlobalMask,
    LocalMask,
    document_live_bound,
    document_live_grid,
    live_block_grid,
)
from ember.kernels_pallas.flash_attention import (
    FlashBlockSizes,
    attention_problem,
    flash_attention,
    flash_attention_reference,
)
from ember.kernels_pallas.flash_attention_kernels import KernelConfig, flash_forward
from tests.kernels_pallas.flash_checks import FAST_COMPILE, assert_kernel_matches_reference, random_qkv

LENGTH = 50  # 4 blocks of 16, the last one partial
BLOCKS = FlashBlockSizes(16, 16)
PACKED = jnp.array([[0] * 13 + [1] * 30 + [2] * 7])  # three packed documents

OPTIONS = {
    "segments": dict(segment_ids=PACKED),
    "segments_causal": dict(segment_ids=PACKED, causal=True),
    "window": dict(window=(7, 3)),
    "causal_window": dict(causal=True, window=(5, 0)),
    "soft_cap": dict(logits_soft_cap=1.5, causal=True),
    "sigmoid": dict(score="sigmoid"),
    "sigmoid_causal_soft_cap": dict(score="sigmoid", causal=True, logits_soft_cap=2.0),
    "causal_mask": dict(block_mask=CausalMask()),
    "local_mask": dict(block_mask=LocalMask(10, 2)),
    "local_global_mask": dict(block_mask=LocalGlobalMask(4, 4, 3)),
    "chunked_causal_mask": dict(block_mask=ChunkedCausalMask(20)),
    "explicit_mask": dict(
        block_mask=ExplicitBlockMask.from_array([[1, 0, 0, 1], [1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 1]], 16, 16)
    ),
    "mask_and_segments": dict(block_mask=LocalGlobalMask(6, 0, 2), segment_ids=PACKED),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_kernel_values_and_grads_match_reference(rng, name):
    q, k, v, d_out = random_qkv(rng, batch=1, q_len=LENGTH, kv_len=LENGTH, heads=4, kv_heads=2, head_dim=32)
    assert_kernel_matches_reference(q, k, v, d_out, block_sizes=BLOCKS, **OPTIONS[name])


def test_sigmoid_uses_minus_log_kv_len_bias(rng):
    """Hand-computed FlashSigmoid: out_i = sum_j sigmoid(q_i.k_j / sqrt(d) - log(n)) v_j."""
    q, k, v, _ = random_qkv(rng, batch=1, q_len=9, kv_len=12, heads=1, kv_heads=1, head_dim=8)
    weights = jax.nn.sigmoid(jnp.einsum("qd,kd->qk", q[0, :, 0], k[0, :, 0]) / np.sqrt(8) - np.log(12))
    expected = (weights @ v[0, :, 0])[None, :, None]
    out = jax.jit(lambda q, k, v: flash_attention(q, k, v, score="sigmoid", impl="interpret"))(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "options",
    [
        # Queries of segment 9 have no key of their segment.
        dict(segment_ids=(jnp.array([[0] * 20 + [9] * 30]), jnp.array([[0] * 25 + [1] * 25]))),
        # The first query block sees no key block at all (its kernel loop runs zero times).
        dict(block_mask=ExplicitBlockMask.from_array([[0, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]], 16, 16)),
    ],
    ids=["segments", "dead_block_row"],
)
def test_fully_masked_rows_are_zero_with_finite_grads(rng, options):
    q, k, v, d_out = random_qkv(rng, batch=1, q_len=LENGTH, kv_len=LENGTH, heads=2, kv_heads=1, head_dim=16)
    out = assert_kernel_matches_reference(q, k, v, d_out, block_sizes=BLOCKS, **options)
    dead_rows = slice(20, None) if "segment_ids" in options else slice(0, 16)
    assert np.all(np.asarray(out[:, dead_rows]) == 0.0)


@pytest.mark.parametrize(
    "mask",
    [CausalMask(), LocalMask(20, 20), LocalGlobalMask(16, 16, 8), ChunkedCausalMask(48), None],
    ids=["causal", "local", "local_global", "chunked", "dense"],
)
def test_kernel_visits_exactly_the_live_blocks(rng, mask):
    length = 200  # 13 x 13 blocks of 16
    q, k, v, _ = random_qkv(rng, batch=1, q_len=length, kv_len=length, heads=2, kv_heads=1, head_dim=16)
    problem = attention_problem(q, k, v, block_mask=mask)
    config = KernelConfig(problem, 16, 16, interpret=True)
    run = jax.jit(
        lambda q, k, v: flash_forward(q, k, v, (None, None), config, count_visits=True), compiler_options=FAST_COMPILE
    )
    _, _, visits = run(q, k, v)
    live = live_block_grid(mask, length, length, 16, 16)
    np.testing.assert_array_equal(visits, np.broadcast_to(live.sum(axis=1), visits.shape))
    assert int(visits[0, 0].sum()) == LiveBlocks.from_grid(live).num_live
    if mask is None:
        assert live.all()
    else:
        assert live.sum() < live.size  # something was skipped
    if isinstance(mask, CausalMask):
        assert live.sum() == 13 * 14 // 2  # hand count: the lower triangle of 13 x 13


def packed_rows(document_lengths):
    """``(segment_ids, segment_positions)`` ``[batch, sum]`` int32 of rows of documents back to back."""
    segments = [np.concatenate([np.full(n, d) for d, n in enumerate(row)]) for row in document_lengths]
    positions = [np.concatenate([np.arange(n) for n in row]) for row in document_lengths]
    return jnp.asarray(np.stack(segments), jnp.int32), jnp.asarray(np.stack(positions), jnp.int32)


# Two rows of 50 tokens packed differently: document starts at 0, 13, 43 and at 0, 30.
DOCUMENTS = [[13, 30, 7], [30, 20]]
PER_DOCUMENT_GLOBALS = dict(block_mask=LocalGlobalMask(6, 0, 3), causal=True)


@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_per_document_global_tokens_values_and_grads_match_reference(rng, impl):
    segment_ids, positions = packed_rows(DOCUMENTS)
    q, k, v, d_out = random_qkv(rng, batch=2, q_len=LENGTH, kv_len=LENGTH, heads=4, kv_heads=2, head_dim=32)
    assert_kernel_matches_reference(
        q,
        k,
        v,
        d_out,
        block_sizes=BLOCKS,
        impl=impl,
        segment_ids=segment_ids,
        segment_positions=positions,
        **PER_DOCUMENT_GLOBALS,
    )


def test_per_document_global_tokens_are_each_documents_first_tokens(rng):
    """The reference on a packed row equals each document run alone; the hand-built token
    mask of one row agrees with the mask description."""
    segment_ids, positions = packed_rows(DOCUMENTS)
    q, k, v, _ = random_qkv(rng, batch=2, q_len=LENGTH, kv_len=LENGTH, heads=2, kv_heads=1, head_dim=16)
    reference = jax.jit(functools.partial(flash_attention_reference, **PER_DOCUMENT_GLOBALS))
    packed = reference(q, k, v, segment_ids=segment_ids, segment_positions=positions)
    # The documents after the first of each row: [13, 43) and [43, 50) of row 0, [30, 50) of row 1.
    for row, doc in ((0, slice(13, 43)), (0, slice(43, 50)), (1, slice(30, 50))):
        alone = reference(q[row : row + 1, doc], k[row : row + 1, doc], v[row : row + 1, doc])
        np.testing.assert_allclose(packed[row : row + 1, doc], alone, rtol=1e-5, atol=1e-5)
    i, j = np.arange(LENGTH)[:, None], np.arange(LENGTH)[None, :]
    seg, pos = np.asarray(segment_ids[0]), np.asarray(positions[0])
    by_hand = (seg[i] == seg[j]) & (j <= i) & ((i - j <= 6) | (pos[j] < 3))
    mask = PER_DOCUMENT_GLOBALS["block_mask"]
    described = mask.visible_at(i, j, pos[:, None], pos[None, :]) & (j <= i) & (seg[i] == seg[j])
    np.testing.assert_array_equal(described, by_hand)


def test_per_document_global_tokens_visit_the_blocks_of_document_starts(rng):
    """The kernel visits the per-row live grid: the local band plus, for each document, the
    column of the block holding its first tokens, down to the block holding its end. A row
    holding one document visits exactly the blocks of the index-based mask (no cost for
    unpacked rows); every visible pair lies in a visited block."""
    length = 100  # 7 x 7 blocks of 16
    mask = LocalGlobalMask(15, 0, 4)
    segment_ids, positions = packed_rows([[100], [40, 30, 30]])
    q, k, v, _ = random_qkv(rng, batch=2, q_len=length, kv_len=length, heads=1, kv_heads=1, head_dim=16)
    problem = attention_problem(
        q, k, v, causal=True, segment_ids=segment_ids, block_mask=mask, segment_positions=positions
    )
    config = KernelConfig(problem, 16, 16, interpret=True)
    rows = ((segment_ids, segment_ids), (positions, positions))
    forward = functools.partial(flash_forward, rows=rows, config=config, count_visits=True)
    run = jax.jit(forward, compiler_options=FAST_COMPILE)
    _, _, visits = run(q, k, v)
    live = np.asarray(document_live_grid(problem.mask, 16, 16, positions, positions, (segment_ids, segment_ids)))
    np.testing.assert_array_equal(visits[:, 0], live.sum(axis=2))
    np.testing.assert_array_equal(live[0], live_block_grid(problem.mask, length, length, 16, 16))
    # Row 1: documents [0, 40), [40, 70), [70, 100) start in blocks 0, 2, 4 and end in 2, 4, 6.
    expected = np.tril(live_block_grid(LocalMask(15, 0), length, length, 16, 16))  # the causal band
    expected[0:3, 0] = expected[2:5, 2] = expected[4:7, 4] = True
    np.testing.assert_array_equal(live[1], expected)
    assert (live <= document_live_bound(problem.mask, length, length, 16, 16)).all()
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    for row in range(2):
        seg, pos = np.asarray(segment_ids[row]), np.asarray(positions[row])
        token = problem.mask.visible_at(i, j, pos[:, None], pos[None, :]) & (seg[i] == seg[j])
        blocks = np.pad(token, ((0, 12), (0, 12))).reshape(7, 16, 7, 16).any(axis=(1, 3))
        assert (live[row] >= blocks).all()


@pytest.mark.slow
@settings(max_examples=4)
@given(
    batch=st.integers(1, 2),
    q_len=st.integers(1, 40),
    kv_len=st.integers(1, 40),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([8, 16]),
    causal=st.booleans(),
    score=st.sampled_from(["softmax", "sigmoid"]),
    window=st.one_of(st.none(), st.tuples(st.integers(0, 8), st.integers(0, 8))),
    block=st.sampled_from([8, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_hypothesis_sweep_small_shapes(
    batch, q_len, kv_len, kv_heads, group, head_dim, causal, score, window, block, seed
):
    q, k, v, d_out = random_qkv(
        jax.random.key(seed),
        batch=batch,
        q_len=q_len,
        kv_len=kv_len,
        heads=kv_heads * group,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )
    assert_kernel_matches_reference(
        q, k, v, d_out, block_sizes=FlashBlockSizes(block, block), causal=causal, score=score, window=window
    )


def test_explicit_mask_needs_dividing_block_sizes(rng):
    q, k, v, _ = random_qkv(rng, batch=1, q_len=48, kv_len=48, heads=1, kv_heads=1, head_dim=8)
    mask = ExplicitBlockMask.from_array(np.eye(2, dtype=bool), 24, 24)
    with pytest.raises(ValueError, match="block_sizes"):
        flash_attention(q, k, v, block_mask=mask, block_sizes=FlashBlockSizes(16, 16), impl="interpret")
    with pytest.raises(ValueError, match="cover"):
        flash_attention(q[:, :1], k, v, block_mask=ExplicitBlockMask.from_array([[True]], 8, 8), impl="xla")


def test_explicit_mask_blocks_no_gpu_tile_divides_say_what_is_allowed(rng):
    """Blocks of 12 fit no kernel tile (powers of two >= 8); with the default tiles the error
    used to name block_sizes (8, 8), which the caller never passed and cannot shrink."""
    q, k, v, _ = random_qkv(rng, batch=1, q_len=24, kv_len=24, heads=1, kv_heads=1, head_dim=8)
    mask = ExplicitBlockMask.from_array(np.eye(2, dtype=bool), 12, 12)
    with pytest.raises(ValueError, match=r"powers of two of at least 8.*impl='xla' takes any block"):
        flash_attention(q, k, v, block_mask=mask, impl="interpret")
    assert flash_attention(q, k, v, block_mask=mask, impl="xla").shape == q.shape

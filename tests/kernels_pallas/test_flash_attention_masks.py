"""flash_attention masking and scores: segments, windows, soft cap, sigmoid, every block-mask
kind, fully masked rows, real block skipping, and a hypothesis sweep over small shapes."""

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
    live_block_grid,
)
from ember.kernels_pallas.flash_attention import FlashBlockSizes, attention_problem, flash_attention
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
    problem = attention_problem(
        q, k, v, causal=False, sm_scale=None, segment_ids=None, window=None, logits_soft_cap=None,
        score="softmax", block_mask=mask,
    )
    config = KernelConfig(problem, 16, 16, interpret=True)
    run = jax.jit(lambda q, k, v: flash_forward(q, k, v, None, config, count_visits=True), compiler_options=FAST_COMPILE)
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
def test_hypothesis_sweep_small_shapes(batch, q_len, kv_len, kv_heads, group, head_dim, causal, score, window, block, seed):
    q, k, v, d_out = random_qkv(
        jax.random.key(seed), batch=batch, q_len=q_len, kv_len=kv_len, heads=kv_heads * group, kv_heads=kv_heads,
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

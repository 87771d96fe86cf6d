"""flash_attention's TPU (Mosaic TPU) kernels in JAX's TPU interpret mode: values and
gradients against the reference (f32 and bf16, GQA/MQA, odd lengths, segments, windows, soft
cap, sigmoid, per-document global tokens, an explicit block grid with dead blocks), the
blocks it visits, and equality with JAX's own splash attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from ember.kernels_pallas.block_mask import (
    ExplicitBlockMask,
    LocalGlobalMask,
    document_live_grid,
)
from ember.kernels_pallas.flash_attention import FlashBlockSizes, attention_problem, flash_attention
from ember.kernels_pallas.flash_attention_tpu import heads_major, tpu_forward, tpu_kernel_config
from tests.kernels_pallas.flash_checks import FAST_COMPILE, assert_kernel_matches_reference, random_qkv
from tests.kernels_pallas.test_flash_attention_masks import packed_rows
from tests.tolerances import assert_allclose

BLOCKS = FlashBlockSizes(128, 128)
# Rows of 300 tokens (3 blocks of 128, the last partial) packed two ways: 3 documents and 2.
DOCUMENTS = [[90, 170, 40], [150, 150]]
# Query block 0 sees nothing (zeros, zero gradient); the others skip dead key blocks.
DEAD_BLOCKS = ExplicitBlockMask.from_array([[0, 0, 0], [1, 1, 0], [1, 0, 1]], 128, 128)

CASES = {
    # name: (dtype, q_len, kv_len, heads, kv_heads, head_dim, options)
    "causal_gqa_odd_lengths": (jnp.float32, 200, 250, 4, 2, 64, dict(causal=True)),
    "sigmoid_causal_mqa_bf16": (jnp.bfloat16, 250, 250, 2, 1, 128, dict(score="sigmoid", causal=True)),
    "segments_window_soft_cap": (
        jnp.float32,
        300,
        300,
        2,
        1,
        64,
        dict(segment_ids=packed_rows(DOCUMENTS[:1])[0], window=(40, 10), logits_soft_cap=2.0),
    ),
    "explicit_dead_blocks_bf16": (jnp.bfloat16, 300, 300, 2, 1, 64, dict(block_mask=DEAD_BLOCKS)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tpu_kernel_values_and_grads_match_reference(rng, name):
    dtype, q_len, kv_len, heads, kv_heads, head_dim, options = CASES[name]
    q, k, v, d_out = random_qkv(
        rng, batch=1, q_len=q_len, kv_len=kv_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype
    )
    out = assert_kernel_matches_reference(q, k, v, d_out, block_sizes=BLOCKS, impl="interpret_tpu", **options)
    if name == "explicit_dead_blocks_bf16":
        assert np.all(np.asarray(out[:, :128]) == 0.0)


def test_tpu_kernel_needs_explicit_mask_cells_of_whole_tpu_blocks(rng):
    q, k, v, _ = random_qkv(rng, batch=1, q_len=256, kv_len=256, heads=1, kv_heads=1, head_dim=64)
    mask = ExplicitBlockMask.from_array(np.eye(4, dtype=bool), 64, 64)
    with pytest.raises(ValueError, match=r"block_sizes .* at least 128"):
        flash_attention(q, k, v, block_mask=mask, block_sizes=FlashBlockSizes(64, 64), impl="interpret_tpu")


# Per-document global tokens: a sliding window plus each document's first 4 tokens.
PER_DOCUMENT_GLOBALS = dict(block_mask=LocalGlobalMask(40, 0, 4), causal=True)


def test_tpu_kernel_per_document_global_tokens_match_reference_and_visit_the_live_blocks(rng):
    """Block tables built per batch row at run time: values and gradients equal the
    reference, and the forward computes exactly the live blocks of each row (row 0's
    documents start in blocks 0, 0, 2; row 1's in blocks 0 and 1)."""
    segment_ids, positions = packed_rows(DOCUMENTS)
    length = segment_ids.shape[1]
    q, k, v, d_out = random_qkv(rng, batch=2, q_len=length, kv_len=length, heads=2, kv_heads=1, head_dim=64)
    options = dict(segment_ids=segment_ids, segment_positions=positions, **PER_DOCUMENT_GLOBALS)
    assert_kernel_matches_reference(q, k, v, d_out, block_sizes=BLOCKS, impl="interpret_tpu", **options)

    problem = attention_problem(q, k, v, **options)
    config = tpu_kernel_config(problem, BLOCKS, pltpu.InterpretParams())
    rows = ((segment_ids, segment_ids), (positions, positions))
    padded = [heads_major(x, 128) for x in (q, k, v)]
    forward = jax.jit(functools.partial(tpu_forward, rows=rows, config=config, count_visits=True))
    _, _, visits = forward(*padded)
    live = np.asarray(document_live_grid(problem.mask, 128, 128, positions, positions, (segment_ids, segment_ids)))
    np.testing.assert_array_equal(visits, np.broadcast_to(live.sum(axis=2)[:, None], visits.shape))
    # The causal band of the window, plus the blocks of each document's global tokens:
    # row 0's second document (tokens 90-259) reaches query block 2, row 1's first does not.
    np.testing.assert_array_equal(live[0], [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(live[1], [[1, 0, 0], [1, 1, 0], [0, 1, 1]])


def _splash_causal_window(q, k, v, sm_scale):
    """JAX's splash attention (TPU interpret mode) on ``[batch, seq, heads, head_dim]``,
    each query seeing itself and the 64 keys before it."""
    _, length, heads, _ = q.shape
    mask = splash_mask.LocalMask((length, length), (64, 0), 0)
    kernel = splash.make_splash_mha(
        splash_mask.MultiHeadMask([mask] * heads),
        block_sizes=splash.BlockSizes(
            block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, block_q_dq=128, block_kv_dq=128
        ),
        head_shards=1,
        q_seq_shards=1,
        interpret=pltpu.InterpretParams(),
    )
    per_head = [jnp.swapaxes(x, 1, 2) for x in (q * sm_scale, k, v)]
    return jnp.swapaxes(jax.vmap(kernel)(*per_head), 1, 2)


def test_tpu_kernel_matches_jax_splash_attention(rng):
    """Causal sliding-window MHA (2 x 2 blocks, one dead): values and gradients equal JAX's
    splash attention, both in TPU interpret mode."""
    q, k, v, d_out = random_qkv(rng, batch=1, q_len=256, kv_len=256, heads=2, kv_heads=2, head_dim=128)
    ours = functools.partial(flash_attention, causal=True, window=(64, 0), block_sizes=BLOCKS, impl="interpret_tpu")
    theirs = functools.partial(_splash_causal_window, sm_scale=128**-0.5)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def both(q, k, v, d_out):
        results = []
        for fn in (ours, theirs):
            out, vjp = jax.vjp(fn, q, k, v)
            results.append((out, vjp(d_out)))
        return results

    (out, grads), (expected, expected_grads) = both(q, k, v, d_out)
    assert_allclose(out, expected, err_msg="output")
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert_allclose(got, want, err_msg=name)

"""Cached decoding equals the full forward pass, for every attention kind: prefill in random
chunk sizes (different per row, padded to one chunk shape), then single-token decode, gives
the logits of one uncached pass."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.models.cache import init_cache, layer_state_shapes
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from tests.tolerances import assert_allclose

BASE = ModelConfig(
    vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128, max_seq_len=48,
    sliding_window=6, global_tokens=3, page_size=4, attention_impl="xla",
)
KINDS = {
    "global": dict(qk_norm=True, attn_soft_cap=20.0, final_soft_cap=30.0),
    "block_sparse": dict(),
    "sigmoid": dict(score="sigmoid", block_pattern=("global", "local")),
    "cca": dict(block_pattern=("cca",), cca_compression=2, cca_heads=2, cca_kv_heads=1, cca_conv_width=3),
    "linear_hedgehog": dict(block_pattern=("linear",), linear_feature_map="hedgehog", linear_feature_dim=8),
    # Softmax local and elu linear layers are covered here, next to the others.
    "mixed_unscanned": dict(block_pattern=("global", "local", "cca", "linear"), num_layers=5, scan_layers=False),
}
SEQ, PROMPT, CHUNK = 28, 17, 6


def make(name):
    overrides = dict(KINDS[name])
    overrides.setdefault("block_pattern", (name,))
    return dataclasses.replace(BASE, **overrides)


def random_chunks(generator, total, largest):
    sizes, left = [], total
    while left:
        sizes.append(int(generator.integers(1, min(largest, left) + 1)))
        left -= sizes[-1]
    return sizes


@pytest.mark.parametrize("name", sorted(KINDS))
def test_chunked_prefill_then_decode_equals_full_pass(name, rng):
    config = make(name)
    model = DecoderLM(config)
    init_rng, token_rng, chunk_rng = jax.random.split(rng, 3)
    tokens = jax.random.randint(token_rng, (2, SEQ), 0, config.vocab_size)
    params = jax.jit(model.init)(init_rng, tokens)["params"]
    expected, none = jax.jit(model.apply)({"params": params}, tokens)
    assert none is None

    apply = jax.jit(model.apply)
    cache = init_cache(config, batch=2, max_len=SEQ)
    generator = np.random.default_rng(int(jax.random.randint(chunk_rng, (), 0, 2**31 - 1)))
    sizes = [random_chunks(generator, PROMPT, CHUNK) for _ in range(2)]
    steps = max(len(row) for row in sizes)
    sizes = [row + [0] * (steps - len(row)) for row in sizes]  # a row may sit out a step
    padded = jnp.pad(tokens, ((0, 0), (0, CHUNK)))
    pieces, offsets = [[], []], [0, 0]
    for step in range(steps):
        chunk = jnp.stack([padded[b, offsets[b] : offsets[b] + CHUNK] for b in range(2)])
        valid = jnp.array([[int(i < sizes[b][step]) for i in range(CHUNK)] for b in range(2)])
        logits, cache = apply({"params": params}, chunk, cache=cache, segment_ids=valid)
        for b in range(2):
            pieces[b].append(logits[b, : sizes[b][step]])
            offsets[b] += sizes[b][step]
    np.testing.assert_array_equal(cache["lengths"], [PROMPT, PROMPT])
    for start in range(PROMPT, SEQ):
        logits, cache = apply({"params": params}, tokens[:, start : start + 1], cache=cache)
        for b in range(2):
            pieces[b].append(logits[b])
    np.testing.assert_array_equal(cache["lengths"], [SEQ, SEQ])
    got = jnp.stack([jnp.concatenate(row, axis=0) for row in pieces])
    # Chunked attention sums in a different order than the full pass.
    assert_allclose(got, expected, scale=10)


def test_cache_layout_matches_the_paged_kernels(rng):
    config = make("mixed_unscanned")
    cache = init_cache(config, batch=3, max_len=10)
    assert cache["page_table"].shape == (3, 3)  # ceil(10 / page_size 4)
    assert sorted(np.asarray(cache["page_table"]).ravel().tolist()) == list(range(9))
    pages = cache["layers"]["block_0"]["k_pages"]
    assert pages.shape == (2, 9, config.page_size, config.kv_heads, config.head_size)  # [groups, pages, ...]
    assert cache["layers"]["block_3"]["state"].shape == (2, 3, config.num_heads, config.head_size, config.head_size + 1)
    # CCGQA: 1 latent kv head of d_model / compression / cca_heads = 16 channels.
    assert layer_state_shapes(make("cca"), "cca", 3, 9)["k_pages"] == (9, 4, 1, 16)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="batch and max_len"):
        init_cache(BASE, batch=0, max_len=4)
    config = make("block_sparse")
    model = DecoderLM(config)
    tokens = jnp.ones((1, 8), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    with pytest.raises(ValueError, match="at most sliding_window"):
        model.apply({"params": params}, tokens, cache=init_cache(config, 1, 16))

"""The cache layout: one config per layer kind (shared with the ragged-cache tests), the
shapes ``init_cache_layers`` gives, and the errors it names."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.models.cache import init_cache_layers, layer_state_shapes
from ember.models.config import ModelConfig, SSMConfig

BASE = ModelConfig(
    vocab_size=128,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_dim=128,
    max_seq_len=48,
    sliding_window=6,
    global_tokens=3,
    page_size=4,
    attention_impl="xla",
)
KINDS = {
    "global": dict(qk_norm=True, attn_soft_cap=20.0, final_soft_cap=30.0, attn_scale=0.15),
    # Gemma's: scaled embeddings, post-sublayer norms, the local layers' own rotary base.
    "local": dict(embed_scale=2.0, post_norms=True, local_rope_theta=500.0),
    "block_sparse": dict(),
    "sigmoid": dict(score="sigmoid", block_pattern=("global", "local")),
    "cca": dict(block_pattern=("cca",), cca_compression=2, cca_heads=2, cca_kv_heads=1, cca_conv_width=3),
    "linear_hedgehog": dict(block_pattern=("linear",), linear_feature_map="hedgehog", linear_feature_dim=8),
    # Linearised softmax layers (LoLCATs): a 6-token window, so sequences of 20 reach the linear part.
    "window_linear": dict(
        linear_feature_map="hedgehog", linear_feature_dim=4, qk_norm=True, attn_soft_cap=20.0, attn_scale=0.2
    ),
    # Two groups, a sequence (20) and prompt chunks that are not multiples of the SSD chunk.
    "mamba2": dict(
        mlp_pattern=("none",), ssm=SSMConfig(state_size=8, n_groups=2, head_dim=16, conv_kernel=4, chunk_size=8)
    ),
    # Three SSM blocks without an MLP per attention block with one (a Jamba/Zamba-style ratio).
    "hybrid": dict(
        block_pattern=("mamba2", "mamba2", "mamba2", "global"),
        mlp_pattern=("none", "none", "none", "dense"),
        num_layers=4,
        ssm=SSMConfig(state_size=8, head_dim=32, conv_kernel=3, chunk_size=8),
    ),
    # Width-1 convolutions keep no inputs in their slots (empty q_tail/k_tail, conv_state).
    "width_one": dict(
        block_pattern=("cca", "mamba2"),
        mlp_pattern=("dense", "none"),
        cca_heads=2,
        cca_conv_width=1,
        ssm=SSMConfig(state_size=8, head_dim=32, conv_kernel=1, chunk_size=8),
    ),
    # Elu linear layers and a partial last group are covered here, next to the others.
    "mixed_unscanned": dict(block_pattern=("global", "local", "cca", "linear"), num_layers=5, scan_layers=False),
}


def make(name):
    overrides = dict(KINDS[name])
    overrides.setdefault("block_pattern", (name,))
    return dataclasses.replace(BASE, **overrides)


def test_cache_layout_matches_the_paged_kernel_and_the_state_slots():
    config = make("mixed_unscanned")
    layers = init_cache_layers(config, num_slots=3, num_pages=9)
    pages = layers["block_0"]["k_pages"]
    assert pages.shape == (2, 9, config.page_size, config.kv_heads, config.head_size)  # [groups, pages, ...]
    assert pages.dtype == config.policy.compute_dtype
    state = layers["block_3"]["state"]
    assert state.shape == (2, 3, config.num_heads, config.head_size, config.head_size + 1)  # [groups, slots, ...]
    assert state.dtype == jnp.float32
    # CCGQA: 1 latent kv head of d_model / compression / cca_heads = 16 channels, tails of 2 * (3 - 1).
    shapes = layer_state_shapes(make("cca"), "cca", 3, 9)
    assert shapes["k_pages"] == (9, 4, 1, 16)
    assert shapes["q_tail"] == (3, 4, 32) and shapes["k_tail"] == (3, 4, 16) and shapes["v_prev"] == (3, 16)
    assert all(np.all(np.asarray(leaf) == 0) for leaf in jax.tree.leaves(layers))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_slots and num_pages"):
        init_cache_layers(BASE, num_slots=0, num_pages=4)
    with pytest.raises(ValueError, match="no cache layout"):
        layer_state_shapes(BASE, "mamba", 1, 1)
    # An int8 cache was allocated and attended as unscaled integers (Engine.from_model(kv_dtype=...)).
    for dtype in (jnp.int8, "int32", "not-a-dtype"):
        with pytest.raises(ValueError, match="kv_dtype must be a floating dtype"):
            init_cache_layers(BASE, num_slots=1, num_pages=2, dtype=dtype)
    assert (
        init_cache_layers(BASE, num_slots=1, num_pages=2, dtype="bfloat16")["block_0"]["k_pages"].dtype == jnp.bfloat16
    )

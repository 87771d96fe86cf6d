"""DecoderLM assembly: scanned and unrolled layouts compute the same function, remat
policies do not change gradients, packed documents do not see each other."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.models.config import LAYER_KINDS, ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.layer_layout import layers_from_list, layers_to_list
from tests.host_random import perturbed
from tests.tolerances import assert_allclose

CONFIG = ModelConfig(
    vocab_size=64,
    d_model=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=1,
    mlp_dim=96,
    mlp="geglu",
    norm="layernorm",
    block_pattern=("local", "global"),
    sliding_window=5,
    tie_embeddings=False,
    attention_impl="xla",
    max_seq_len=32,
)


def test_scanned_and_unrolled_layouts_agree(rng):
    tokens = jax.random.randint(rng, (2, 12), 0, 64)
    scanned = DecoderLM(CONFIG)
    params = jax.jit(scanned.init)(jax.random.key(0), tokens)["params"]
    unrolled_config = dataclasses.replace(CONFIG, scan_layers=False)
    layers = layers_to_list(CONFIG, params)
    unrolled_params = {k: v for k, v in params.items() if k != "layers"} | layers_from_list(unrolled_config, layers)
    expected, _ = jax.jit(scanned.apply)({"params": params}, tokens)
    got, _ = jax.jit(DecoderLM(unrolled_config).apply)({"params": unrolled_params}, tokens)
    assert_allclose(got, expected)
    again = layers_from_list(CONFIG, layers_to_list(unrolled_config, unrolled_params))["layers"]
    jax.tree.map(np.testing.assert_array_equal, again, params["layers"])


def test_remat_keeps_gradients(rng):
    config = dataclasses.replace(CONFIG, num_layers=2)
    tokens = jax.random.randint(rng, (2, 10), 0, 64)
    params = jax.jit(DecoderLM(config).init)(jax.random.key(0), tokens)["params"]

    def grads(config):
        loss = lambda p: DecoderLM(config).apply({"params": p}, tokens)[0].std()  # noqa: E731
        return jax.jit(jax.grad(loss))(params)

    expected = grads(config)
    for remat in ("full", "dots_no_batch"):
        jax.tree.map(lambda a, b: assert_allclose(a, b), grads(dataclasses.replace(config, remat=remat)), expected)


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_packed_documents_are_independent(rng, kind):
    """A document packed after another (segment ids, positions restarting) gets the logits it
    gets alone, in every layer kind, with parameters moved off their initial values (CCA's
    identity convolutions would hide a convolution reaching across the boundary). The
    second document outlasts the sliding window, so block_sparse layers must still see its
    own first tokens as global ones."""
    config = dataclasses.replace(
        CONFIG,
        num_layers=2,
        block_pattern=(kind,),
        sliding_window=3,
        global_tokens=2,
        cca_conv_width=3,
        cca_heads=2,
        cca_kv_heads=1,
    )
    model = DecoderLM(config)
    first = jax.random.randint(rng, (1, 7), 0, 64)
    second = jax.random.randint(jax.random.fold_in(rng, 1), (1, 6), 0, 64)
    params = jax.jit(model.init)(jax.random.key(0), first)["params"]
    params = perturbed(params, jax.random.fold_in(rng, 2))
    packed = jnp.concatenate([first, second], axis=1)
    segment_ids = jnp.array([[1] * 7 + [2] * 6])
    positions = jnp.array([list(range(7)) + list(range(6))])
    apply = jax.jit(model.apply)
    logits, _ = apply({"params": params}, packed, positions=positions, segment_ids=segment_ids)
    alone_first, _ = apply({"params": params}, first)
    alone_second, _ = apply({"params": params}, second)
    assert_allclose(logits[:, :7], alone_first, err_msg="first document")
    assert_allclose(logits[:, 7:], alone_second, err_msg="second document")

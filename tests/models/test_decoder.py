"""DecoderLM assembly: scanned and unrolled layouts compute the same function, remat
policies do not change gradients, packed documents do not see each other."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM, layers_from_list, layers_to_list
from tests.tolerances import assert_allclose

CONFIG = ModelConfig(
    vocab_size=64, d_model=64, num_layers=4, num_heads=4, num_kv_heads=1, mlp_dim=96, mlp="geglu",
    norm="layernorm", block_pattern=("local", "global"), sliding_window=5, tie_embeddings=False,
    attention_impl="xla", max_seq_len=32,
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


def test_packed_documents_are_independent(rng):
    """Two documents packed in one row (segment ids, positions restarting) give the logits
    of each document run alone."""
    model = DecoderLM(CONFIG)
    first, second = jax.random.randint(rng, (1, 7), 0, 64), jax.random.randint(jax.random.fold_in(rng, 1), (1, 5), 0, 64)
    params = jax.jit(model.init)(jax.random.key(0), first)["params"]
    packed = jnp.concatenate([first, second], axis=1)
    segment_ids = jnp.array([[1] * 7 + [2] * 5])
    positions = jnp.array([list(range(7)) + list(range(5))])
    apply = jax.jit(model.apply)
    logits, _ = apply({"params": params}, packed, positions=positions, segment_ids=segment_ids)
    alone_first, _ = apply({"params": params}, first)
    alone_second, _ = apply({"params": params}, second)
    assert_allclose(logits[:, :7], alone_first)
    assert_allclose(logits[:, 7:], alone_second)

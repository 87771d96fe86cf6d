"""CCA / CCGQA: parameters and KV-cache bytes shrink by the compression factor, the layer
is causal, and a CCA model trains on a small synthetic task."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ember.core.tree import param_bytes, param_count
from ember.models.cache import init_cache_layers
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from tests.tolerances import assert_allclose

MHA = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, mlp_dim=128, attention_impl="xla", max_seq_len=64)
COMPRESSION = 4


def cca(kv_heads=0):
    return dataclasses.replace(MHA, block_pattern=("cca",), cca_compression=COMPRESSION, cca_heads=2, cca_kv_heads=kv_heads)


def attention_params(config):
    shapes = jax.eval_shape(DecoderLM(config).init, jax.random.key(0), jnp.ones((1, 8), jnp.int32))
    return jax.tree.map(lambda box: box.value if hasattr(box, "value") else box, shapes["params"]["layers"]["block_0"]["attn"],
                        is_leaf=lambda x: hasattr(x, "value"))


def test_projection_parameters_shrink_by_the_compression_factor():
    mha, compressed = attention_params(MHA), attention_params(cca())
    projections = lambda tree: param_count({name: tree[name] for name in ("q", "k", "v", "o")})  # noqa: E731
    assert projections(mha) * 1 == projections(compressed) * COMPRESSION
    # On top: per layer, two convolutions each for q (2 heads) and k (2 heads here) of width 2
    # (depthwise [2, 16] and per-head [2, 2, 8, 8]) and the two QK-norm scales [8].
    extra_per_layer = 2 * (2 * 16 + 2 * 2 * 8 * 8) + 2 * 8
    assert param_count(compressed) == projections(compressed) + MHA.num_layers * extra_per_layer


def test_kv_cache_bytes_shrink_by_the_compression_factor():
    def page_bytes(config):
        layers = init_cache_layers(config, num_slots=2, num_pages=4)
        return param_bytes({name: {k: v for k, v in state.items() if k.endswith("_pages")} for name, state in layers.items()})

    assert page_bytes(MHA) == COMPRESSION * page_bytes(cca())
    assert page_bytes(MHA) == 2 * COMPRESSION * page_bytes(cca(kv_heads=1))  # CCGQA: heads shared too


def test_cca_is_causal(rng):
    model = DecoderLM(cca(kv_heads=1))
    tokens = jax.random.randint(rng, (1, 16), 0, 64)
    params = jax.jit(model.init)(jax.random.key(1), tokens)["params"]
    changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % 64)
    apply = jax.jit(model.apply)
    before, _ = apply({"params": params}, tokens)
    after, _ = apply({"params": params}, changed)
    assert_allclose(after[:, :10], before[:, :10])
    assert np.abs(np.asarray(after[:, 10:] - before[:, 10:])).max() > 1e-3


def test_cca_model_learns_a_synthetic_task(rng):
    """Next token = token two steps back + 1 (mod vocab): needs attention through the latent
    space (two positions back) to solve."""
    config = dataclasses.replace(cca(kv_heads=1), vocab_size=16)
    model = DecoderLM(config)
    start = jax.random.randint(rng, (32, 2), 0, 16)
    steps = jnp.arange(24) // 2
    tokens = (start[:, jnp.arange(24) % 2] + steps[None, :]) % 16
    params = jax.jit(model.init)(jax.random.key(2), tokens)["params"]
    optimizer = optax.adam(1e-2)

    def loss_fn(params):
        logits, _ = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, 2:], tokens[:, 3:]).mean()

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state = optimizer.init(params)
    losses = []
    for _ in range(60):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[0] > 2.0  # ~log(16) at initialisation
    assert losses[-1] < 0.25 * losses[0], losses[::10]

"""Every parameter carries logical axes; the sharded forward on 8 CPU devices (FSDP and
tensor-parallel meshes) equals the single-device forward; the model wraps for Flax NNX."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ember.core.sharding import LOGICAL_AXES, MeshConfig, make_mesh, named_sharding, shard_variables, use_sharding
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from tests.tolerances import assert_allclose

# One of each parameter kind: attention with biases and QK-norm, CCGQA, Hedgehog linear
# attention, an untied head.
CONFIG = ModelConfig(
    vocab_size=128,
    d_model=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    mlp_dim=128,
    qkv_bias=True,
    qk_norm=True,
    tie_embeddings=False,
    block_pattern=("global", "cca", "linear"),
    cca_heads=2,
    cca_kv_heads=1,
    linear_feature_map="hedgehog",
    attention_impl="xla",
    max_seq_len=64,
)


@pytest.fixture(scope="module")
def variables():
    return jax.jit(DecoderLM(CONFIG).init)(jax.random.key(0), jnp.ones((2, 16), jnp.int32))


def test_every_parameter_has_logical_axes_from_the_vocabulary(variables):
    leaves = jax.tree.leaves(variables, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert leaves and all(isinstance(leaf, nn.LogicallyPartitioned) for leaf in leaves)
    for leaf in leaves:
        assert len(leaf.names) == leaf.value.ndim
        assert set(leaf.names) - {None} <= set(LOGICAL_AXES)
        assert leaf.names[0] == "layers" or leaf.value.ndim <= 2  # scanned leaves lead with layers


@pytest.mark.parametrize(
    "mesh_config", [MeshConfig(data=2, fsdp=4), MeshConfig(data=2, tensor=4)], ids=["fsdp", "tensor"]
)
def test_sharded_forward_equals_single_device(mesh_config, variables, rng):
    model = DecoderLM(CONFIG)
    tokens = jax.random.randint(rng, (8, 16), 0, CONFIG.vocab_size)
    expected, _ = jax.jit(model.apply)(nn.meta.unbox(variables), tokens)
    mesh = make_mesh(mesh_config)
    sharded = shard_variables(variables, mesh)
    split = [leaf for leaf in jax.tree.leaves(sharded) if not leaf.sharding.is_fully_replicated]
    assert split, "no parameter was actually sharded"
    with use_sharding(mesh):
        tokens = jax.device_put(tokens, named_sharding(mesh, ("batch", "seq"), shape=tokens.shape))
        logits, _ = jax.jit(model.apply)(sharded, tokens)
    assert not logits.sharding.is_fully_replicated
    assert_allclose(logits, expected, scale=10)  # sharded matmuls reduce in another order


def test_wraps_for_flax_nnx(rng):
    config = dataclasses.replace(CONFIG, block_pattern=("global",), num_layers=2, tie_embeddings=True)
    tokens = jax.random.randint(rng, (2, 12), 0, config.vocab_size)
    with use_sharding(make_mesh(MeshConfig(data=-1))):  # NNX shards variables eagerly: needs a mesh
        model = nnx.bridge.ToNNX(DecoderLM(config), rngs=nnx.Rngs(0))
        # nnx.jit: one program each, where op by op they compiled ~140 programs
        nnx.jit(nnx.bridge.lazy_init)(model, tokens)
        logits, cache = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert cache is None
    expected, _ = jax.jit(DecoderLM(config).apply)({"params": params}, tokens)
    assert_allclose(logits, expected)
    assert np.asarray(params["layers"]["block_0"]["attn"]["q"]["kernel"]).shape == (2, 64, 4, 16)

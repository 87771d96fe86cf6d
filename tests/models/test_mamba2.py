"""The ``mamba2`` layer kind: its Pallas (interpret) and XLA scan paths give one model, its
FLOPs count agrees with its parameter tree, and bad ``ssm`` settings are ConfigErrors that
name the key. (Values against ``transformers``: tests/models/test_hf_mamba2.py; ragged cache
and packed documents: test_ragged_cache.py and test_decoder.py, which cover every kind.)"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from ember.core.errors import ConfigError
from ember.core.tree import param_count
from ember.models.config import ModelConfig, SSMConfig
from ember.models.decoder import DecoderLM
from ember.models.flops import flops_per_token
from ember.models.layer_layout import layers_to_list
from tests.host_random import perturbed
from tests.tolerances import assert_allclose

CONFIG = ModelConfig(
    vocab_size=64,
    d_model=32,
    num_layers=2,
    num_heads=2,
    mlp_dim=64,
    block_pattern=("mamba2", "global"),
    mlp_pattern=("none", "dense"),
    ssm=SSMConfig(state_size=8, n_groups=2, head_dim=16, conv_kernel=3, chunk_size=8),
    max_seq_len=32,
)


def test_interpret_and_xla_paths_agree(rng):
    """The whole model with the SSD scan as Pallas kernels (the GPU kernels in interpret
    mode, the TPU kernels in TPU interpret mode) and as XLA einsums, over a length that is
    not a multiple of the chunk (one SSM layer: interpret mode is slow)."""
    init_rng, token_rng, noise_rng = jax.random.split(rng, 3)
    tokens = jax.random.randint(token_rng, (2, 13), 0, CONFIG.vocab_size)
    config = dataclasses.replace(CONFIG, num_layers=1, block_pattern=("mamba2",), mlp_pattern=("none",))
    xla = dataclasses.replace(config, attention_impl="xla")
    params = perturbed(jax.jit(DecoderLM(xla).init)(init_rng, tokens)["params"], noise_rng)
    expected, _ = jax.jit(DecoderLM(xla).apply)({"params": params}, tokens)
    for impl in ("interpret", "interpret_tpu"):
        interpret = dataclasses.replace(config, attention_impl=impl)
        got, _ = jax.jit(DecoderLM(interpret).apply)({"params": params}, tokens)
        assert_allclose(got, expected, err_msg=impl)


def test_flops_match_the_parameter_tree_plus_the_scan():
    config = dataclasses.replace(
        CONFIG, block_pattern=("mamba2",), mlp_pattern=("none",), tie_embeddings=False, scan_layers=False
    )
    params = jax.eval_shape(DecoderLM(config).init, jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
    # Matrices (projections, the head) and the convolution taps are used once per token;
    # the per-head scalars, biases and norm scales are not matmul weights.
    vectors = ("attn_norm", "conv_bias", "dt_bias", "A_log", "D", "norm_scale")
    weights = param_count(params) - param_count(params["embed"]) - param_count(params["final_norm"])
    weights -= sum(
        param_count({k: v for k, v in {**layer, **layer["attn"]}.items() if k in vectors})
        for layer in layers_to_list(config, params)
    )
    ssm = config.ssm
    heads = ssm.heads(config.d_model)  # 4 heads of 16 channels, state 8, chunk 8
    scan = 4 * heads * 16 * 8 + heads * 8 * (8 + 16)
    assert flops_per_token(config, 128, training=False) == 2 * weights + config.num_layers * scan


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(ssm=SSMConfig(head_dim=24)), "ssm.head_dim"),  # 2 * 32 = 64 channels do not split into 24s
        (dict(ssm=SSMConfig(head_dim=16, n_groups=3)), "ssm.n_groups"),  # 4 heads
    ],
)
def test_ssm_shapes_that_do_not_fit_the_model_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key) as error:
        dataclasses.replace(CONFIG, **overrides)
    assert error.value.key == key


@pytest.mark.parametrize(
    "field, value",
    [("chunk_size", 12), ("chunk_size", 4), ("state_size", 0), ("conv_kernel", 0), ("time_step_limit", (0.5, 0.1))],
)
def test_bad_ssm_settings_name_the_key(field, value):
    with pytest.raises(ConfigError, match=f"ssm.{field}") as error:
        SSMConfig(**{field: value})
    assert error.value.key == f"ssm.{field}"

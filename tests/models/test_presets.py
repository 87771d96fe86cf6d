"""Presets have the parameter counts their names promise; FLOPs per token agree with the
parameter tree (2 FLOPs per weight per token, plus attention over the visible keys)."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from ember.core.config import load_config
from ember.core.tree import param_count
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.flops import flops_per_token, mean_visible_keys
from ember.models.layer_layout import layers_to_list

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "models"


def abstract_params(config):
    return jax.eval_shape(DecoderLM(config).init, jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]


@pytest.mark.parametrize("name, millions", [("125m", 125), ("350m", 350), ("1b", 1000), ("mamba2_130m", 130)])
def test_preset_sizes(name, millions):
    config = load_config(ModelConfig, PRESETS / f"{name}.yaml")
    assert abs(param_count(abstract_params(config)) / 1e6 - millions) < 0.05 * millions


def test_flops_match_the_parameter_tree_plus_attention():
    config = load_config(ModelConfig, PRESETS / "tiny.yaml")
    config = dataclasses.replace(config, tie_embeddings=False)
    params = abstract_params(config)
    # Every matrix is used once per token; the embedding table is a lookup (no FLOPs); norms are not counted.
    matmul_weights = param_count(params) - param_count(params["embed"]) - param_count(params["final_norm"])
    matmul_weights -= sum(
        param_count({k: v for k, v in layer.items() if k.endswith("norm")}) for layer in layers_to_list(config, params)
    )
    seq = 128
    attention = config.num_layers * 4 * config.num_heads * config.head_size * (seq + 1) / 2
    assert flops_per_token(config, seq, training=False) == 2 * matmul_weights + attention
    assert flops_per_token(config, seq) == 3 * flops_per_token(config, seq, training=False)


def test_mean_visible_keys_by_hand():
    config = ModelConfig(sliding_window=3, global_tokens=2)
    assert mean_visible_keys(config, "global", 4) == 2.5  # (1 + 2 + 3 + 4) / 4
    assert mean_visible_keys(config, "local", 5) == (1 + 2 + 3 + 3 + 3) / 5
    # Query 3 sees 1..3 plus global 0; query 4 sees 2..4 plus globals 0, 1.
    assert mean_visible_keys(config, "block_sparse", 5) == (1 + 2 + 3 + 4 + 5) / 5
    assert mean_visible_keys(config, "block_sparse", 6) == (1 + 2 + 3 + 4 + 5 + 5) / 6

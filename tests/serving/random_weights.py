"""Random weights for a ``DecoderLM`` of any layer kinds, drawn on the host into its parameter
shapes: initialising a model of every kind eagerly costs more than the tests that serve it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM


def random_weights(config: ModelConfig, seed: int, spread: float):
    """Unboxed parameters of ``DecoderLM(config)``: norm scales (the Mamba-2 gated norm's
    ``norm_scale`` too) around 1, everything else around 0, each ``spread`` times a standard
    normal away."""
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    shapes = nn.meta.unbox(jax.eval_shape(DecoderLM(config).init, jax.random.key(0), tokens)["params"])
    generator = np.random.default_rng(seed)

    def draw(path, leaf):
        centre = 1.0 if jax.tree_util.keystr(path).endswith(("['scale']", "['norm_scale']")) else 0.0
        return jnp.asarray(centre + spread * generator.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)

"""Ember LM run directories as the trainer leaves them, for the command-line tests."""

import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.checkpoint import CheckpointManager
from ember.core.config import to_yaml
from ember.models.decoder import DecoderLM


def write_run_dir(path, config, *, seed=7, step=3):
    """``config.yaml`` and ``checkpoints/`` holding ``DecoderLM(config)``'s initial weights (seeded)
    at ``step`` in ``path``; returns the weights."""
    boxed = DecoderLM(config).init(jax.random.PRNGKey(seed), jnp.zeros((1, 4), jnp.int32))["params"]
    params = nn.meta.unbox(boxed)  # the trainer checkpoints plain arrays
    (path / "config.yaml").write_text("model:\n" + textwrap.indent(to_yaml(config), "  "))
    with CheckpointManager(path / "checkpoints", async_save=False) as manager:
        manager.save(step, {"params": params, "step": jnp.int32(step)})
    return params

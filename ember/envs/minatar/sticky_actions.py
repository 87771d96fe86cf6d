"""MinAtar's sticky actions, shared by its five games."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ember.envs import noise as noise_lib


def sticky_action(word: jax.Array, last_action: jax.Array, action: jax.Array, prob) -> jax.Array:
    """The action taken (int32): ``last_action`` with probability ``prob`` (one noise word),
    else ``action`` -- MinAtar's ``sticky_action_prob``."""
    return jnp.where(noise_lib.bernoulli(word, prob), last_action, action).astype(jnp.int32)

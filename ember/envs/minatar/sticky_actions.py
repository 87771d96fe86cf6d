"""MinAtar's sticky actions, shared by its five games."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ember.envs import noise as noise_lib
from ember.envs.environment import Environment, EnvState


def sticky_action(word: jax.Array, last_action: jax.Array, action: jax.Array, prob) -> jax.Array:
    """The action taken (int32): ``last_action`` with probability ``prob`` (one noise word),
    else ``action`` -- MinAtar's ``sticky_action_prob``."""
    return jnp.where(noise_lib.bernoulli(word, prob), last_action, action).astype(jnp.int32)


class StickyActionEnvironment(Environment):
    """Base of the MinAtar games (their states hold ``last_action``). MinAtar's ``Environment``
    keeps its last action across ``reset()``, so the first step of an episode may repeat the
    previous episode's last action: an auto-reset in ``step`` carries it over likewise, while
    ``reset`` starts from action 0 (no-op), as a new MinAtar environment does."""

    def carry_over(self, state: EnvState, reset_state: EnvState) -> EnvState:
        """``reset_state`` with the ended episode's ``last_action``."""
        return reset_state.replace(last_action=state.last_action)

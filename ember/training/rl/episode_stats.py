"""Episode statistics of a rollout, from the ``info`` entries ``ember.envs.wrappers.LogWrapper``
adds (``returned_episode``, ``returned_episode_returns``, ``returned_episode_lengths``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def episode_statistics(
    episode_done: jax.Array, episode_return: jax.Array, episode_length: jax.Array
) -> dict[str, jax.Array]:
    """Mean return and length of the episodes that ended in a rollout (``nan`` when none did),
    and their count. All three arguments share one shape (``[steps, envs]``, say):
    ``episode_done`` marks the steps that ended an episode, whose return and length the
    other two hold."""
    count = episode_done.sum()
    denominator = jnp.maximum(count, 1)
    mean_or_nan = lambda x: jnp.where(count > 0, (x * episode_done).sum() / denominator, jnp.nan)  # noqa: E731
    return {
        "episode_return": mean_or_nan(episode_return.astype(jnp.float32)),
        "episode_length": mean_or_nan(episode_length.astype(jnp.float32)),
        "episodes": count,
    }


__all__ = ["episode_statistics"]

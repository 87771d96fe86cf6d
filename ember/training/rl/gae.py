"""Generalised advantage estimation (Schulman et al., 2016) over auto-resetting rollouts.

A rollout of ``T`` steps from auto-resetting environments (the gymnax 1.0 contract) holds,
for every step ``t``: the value ``V(s_t)`` of the observation the action was taken in, and
the value ``V(s'_t)`` of ``info["final_observation"]``, the observation the step reached
*before* any reset. With those two arrays the episode boundaries are handled exactly:

- **terminated** (a true end state): nothing follows, so ``s'_t`` is not bootstrapped;
- **truncated** (time limit): the episode was cut, not ended, so ``V(s'_t)`` is
  bootstrapped as for any other step;
- in both cases the advantage recursion stops: step ``t+1`` belongs to a new episode.

    delta_t = r_t + gamma * (1 - terminated_t) * V(s'_t) - V(s_t)
    A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1},   done = terminated | truncated
    R_t     = A_t + V(s_t)                                          (the value target)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gae_advantages(
    rewards: jax.Array,
    values: jax.Array,
    next_values: jax.Array,
    terminated: jax.Array,
    truncated: jax.Array,
    *,
    gamma: float,
    gae_lambda: float,
) -> tuple[jax.Array, jax.Array]:
    """Advantages and value targets of a rollout, time-major.

    Args:
      rewards: ``[T, ...]`` reward of each step (any trailing batch/agent axes).
      values: ``[T, ...]`` ``V(s_t)``, the value of the observation the action was taken in.
      next_values: ``[T, ...]`` ``V(s'_t)``, the value of ``info["final_observation"]`` (the
        observation reached before any auto-reset).
      terminated: ``[T, ...]`` bool, the step ended the episode in a terminal state.
      truncated: ``[T, ...]`` bool, the step ended the episode by a time limit.
      gamma: discount factor in [0, 1].
      gae_lambda: GAE trace parameter in [0, 1].

    Returns:
      ``(advantages, returns)``, both ``[T, ...]`` in the dtype of ``values``;
      ``returns = advantages + values``.
    """
    for name, value in (("gamma", gamma), ("gae_lambda", gae_lambda)):
        if isinstance(value, (int, float)) and not 0.0 <= value <= 1.0:  # traced values pass through
            raise ValueError(f"{name} must lie in [0, 1], got {value}")
    shapes = {a.shape for a in (rewards, values, next_values, terminated, truncated)}
    if len(shapes) != 1:
        raise ValueError(
            "rewards, values, next_values, terminated and truncated must share one shape [T, ...], got "
            f"{[a.shape for a in (rewards, values, next_values, terminated, truncated)]}"
        )
    dtype = values.dtype
    not_terminal = 1.0 - terminated.astype(dtype)
    continues = 1.0 - jnp.logical_or(terminated, truncated).astype(dtype)
    deltas = rewards.astype(dtype) + gamma * not_terminal * next_values - values

    def backward(next_advantage, step):
        delta, cont = step
        advantage = delta + gamma * gae_lambda * cont * next_advantage
        return advantage, advantage

    _, advantages = jax.lax.scan(backward, jnp.zeros_like(values[0]), (deltas, continues), reverse=True)
    return advantages, advantages + values

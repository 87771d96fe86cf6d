"""Loss functions of the PPO family and DQN, as pure functions of arrays.

PPO (Schulman et al., 2017) with the usual implementation details: the clipped surrogate,
a clipped value loss, an entropy bonus and per-minibatch advantage normalisation. All
arguments are arrays of one shape (``[batch]`` or ``[batch, agents]``); means run over
every element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def normalize_advantages(advantages: jax.Array, eps: float = 1e-8) -> jax.Array:
    """``(A - mean(A)) / (std(A) + eps)`` over all elements."""
    return (advantages - advantages.mean()) / (advantages.std() + eps)


def clipped_surrogate_loss(
    log_prob: jax.Array, old_log_prob: jax.Array, advantages: jax.Array, clip_eps: float
) -> tuple[jax.Array, jax.Array]:
    """PPO's policy loss ``-mean(min(rho * A, clip(rho, 1 - eps, 1 + eps) * A))``,
    ``rho = exp(log_prob - old_log_prob)``.

    Returns:
      ``(loss, clip_fraction)``: the scalar loss and the fraction of elements whose ratio
      lies outside ``[1 - eps, 1 + eps]``.
    """
    ratio = jnp.exp(log_prob - old_log_prob)
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    loss = -jnp.minimum(unclipped, clipped).mean()
    clip_fraction = (jnp.abs(ratio - 1.0) > clip_eps).mean()
    return loss, clip_fraction


def clipped_value_loss(
    values: jax.Array, old_values: jax.Array, returns: jax.Array, clip_eps: float | None
) -> jax.Array:
    """``0.5 * mean(max((V - R)^2, (V_clipped - R)^2))`` with
    ``V_clipped = old_V + clip(V - old_V, -eps, eps)``; ``clip_eps=None`` gives the plain
    ``0.5 * mean((V - R)^2)``."""
    unclipped = jnp.square(values - returns)
    if clip_eps is None:
        return 0.5 * unclipped.mean()
    clipped_values = old_values + jnp.clip(values - old_values, -clip_eps, clip_eps)
    return 0.5 * jnp.maximum(unclipped, jnp.square(clipped_values - returns)).mean()


def ppo_loss(
    log_prob: jax.Array,
    old_log_prob: jax.Array,
    advantages: jax.Array,
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    entropy: jax.Array,
    *,
    clip_eps: float,
    value_clip_eps: float | None,
    value_coef: float,
    entropy_coef: float,
    normalize_advantage: bool = True,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The total PPO loss ``policy + value_coef * value - entropy_coef * mean(entropy)``.

    Args:
      log_prob, old_log_prob: log-probabilities of the taken actions under the current
        policy and under the policy that collected the data.
      advantages, returns: GAE advantages and value targets (see :mod:`.gae`).
      values, old_values: current value predictions and those at collection time.
      entropy: the current policy's entropy at each element.
      clip_eps: the surrogate's ratio clip.
      value_clip_eps: the value clip, or ``None`` for an unclipped value loss.
      value_coef, entropy_coef: weights of the value loss and of the entropy bonus.
      normalize_advantage: normalise ``advantages`` over this (mini)batch first.

    Returns:
      ``(loss, aux)``; ``aux`` holds ``policy_loss``, ``value_loss``, ``entropy``,
      ``clip_fraction`` and ``approx_kl`` (the ``(rho - 1) - log rho`` estimator).
    """
    if normalize_advantage:
        advantages = normalize_advantages(advantages)
    policy_loss, clip_fraction = clipped_surrogate_loss(log_prob, old_log_prob, advantages, clip_eps)
    value_loss = clipped_value_loss(values, old_values, returns, value_clip_eps)
    mean_entropy = entropy.mean()
    loss = policy_loss + value_coef * value_loss - entropy_coef * mean_entropy
    log_ratio = log_prob - old_log_prob
    approx_kl = (jnp.exp(log_ratio) - 1.0 - log_ratio).mean()
    aux = {
        "policy_loss": policy_loss,
        "value_loss": value_loss,
        "entropy": mean_entropy,
        "clip_fraction": clip_fraction,
        "approx_kl": approx_kl,
    }
    return loss, aux


def q_learning_targets(
    rewards: jax.Array,
    next_q_values: jax.Array,
    terminated: jax.Array,
    *,
    gamma: float,
    double_q_next: jax.Array | None = None,
) -> jax.Array:
    """One-step Q-learning targets ``r + gamma * (1 - terminated) * max_a Q_target(s', a)``.

    Args:
      rewards, terminated: ``[batch]``.
      next_q_values: ``[batch, actions]`` target-network values of ``s'`` (the pre-reset
        observation; truncated steps are bootstrapped, terminated ones are not).
      gamma: discount factor.
      double_q_next: optional ``[batch, actions]`` online-network values of ``s'``; when
        given, the action is chosen by them and valued by the target network (double DQN).

    Returns:
      ``[batch]`` targets (to be treated as constants).
    """
    if double_q_next is None:
        next_value = next_q_values.max(axis=-1)
    else:
        chosen = double_q_next.argmax(axis=-1)
        next_value = jnp.take_along_axis(next_q_values, chosen[..., None], axis=-1)[..., 0]
    return rewards + gamma * (1.0 - terminated.astype(next_value.dtype)) * next_value


def q_learning_loss(
    q_values: jax.Array, actions: jax.Array, targets: jax.Array, *, huber_delta: float | None = None
) -> jax.Array:
    """Mean regression loss of ``Q(s, a)`` to ``targets``.

    Args:
      q_values: ``[batch, actions]`` online-network values of ``s``.
      actions: ``[batch]`` integer actions taken.
      targets: ``[batch]`` targets from :func:`q_learning_targets`; gradients are stopped.
      huber_delta: Huber loss with this delta, or ``None`` for ``0.5 * squared error``.
    """
    chosen = jnp.take_along_axis(q_values, actions[..., None].astype(jnp.int32), axis=-1)[..., 0]
    targets = jax.lax.stop_gradient(targets)
    if huber_delta is None:
        return optax.l2_loss(chosen, targets).mean()
    return optax.huber_loss(chosen, targets, delta=huber_delta).mean()

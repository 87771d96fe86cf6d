"""PPO and Q-learning losses against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np

from ember.training.rl.losses import (
    clipped_surrogate_loss,
    clipped_value_loss,
    normalize_advantages,
    ppo_loss,
    q_learning_loss,
    q_learning_targets,
)
from tests.tolerances import assert_allclose

RATIOS = np.array([1.5, 0.5, 1.1])
LOG_PROB = jnp.log(jnp.asarray(RATIOS, jnp.float32))
OLD_LOG_PROB = jnp.zeros(3)
ADVANTAGES = jnp.array([1.0, 1.0, -2.0])
VALUES = jnp.array([1.0, 2.0, 0.0])
OLD_VALUES = jnp.array([0.5, 2.5, 0.0])
RETURNS = jnp.array([2.0, 2.0, 1.0])
ENTROPY = jnp.array([0.6, 0.3, 0.9])


def test_clipped_surrogate_value_and_gradient():
    loss, clip_fraction = clipped_surrogate_loss(LOG_PROB, OLD_LOG_PROB, ADVANTAGES, 0.2)
    # min(rho A, clip(rho) A) = [min(1.5, 1.2), min(.5, .8), min(-2.2, -2.2)] = [1.2, .5, -2.2]
    assert_allclose(loss, -(1.2 + 0.5 - 2.2) / 3)
    assert_allclose(clip_fraction, 2 / 3)
    grad = jax.grad(lambda lp: clipped_surrogate_loss(lp, OLD_LOG_PROB, ADVANTAGES, 0.2)[0])(LOG_PROB)
    # clipped element: no gradient; others: d(-rho A / 3)/d log rho = -rho A / 3
    assert_allclose(grad, [0.0, -0.5 / 3, 2.2 / 3])


def test_clipped_value_loss():
    # unclipped errors^2 [1, 0, 1]; clipped values [0.7, 2.3, 0] -> errors^2 [1.69, .09, 1]
    assert_allclose(clipped_value_loss(VALUES, OLD_VALUES, RETURNS, 0.2), 0.5 * (1.69 + 0.09 + 1.0) / 3)
    assert_allclose(clipped_value_loss(VALUES, OLD_VALUES, RETURNS, None), 0.5 * 2.0 / 3)


def test_ppo_loss_total_and_diagnostics():
    loss, aux = ppo_loss(
        LOG_PROB,
        OLD_LOG_PROB,
        ADVANTAGES,
        VALUES,
        OLD_VALUES,
        RETURNS,
        ENTROPY,
        clip_eps=0.2,
        value_clip_eps=0.2,
        value_coef=0.5,
        entropy_coef=0.01,
        normalize_advantage=False,
    )
    policy, value = 0.5 / 3, 0.5 * 2.78 / 3
    assert_allclose(aux["policy_loss"], policy)
    assert_allclose(aux["value_loss"], value)
    assert_allclose(aux["entropy"], 0.6)
    assert_allclose(loss, policy + 0.5 * value - 0.01 * 0.6)
    assert_allclose(aux["approx_kl"], np.mean(RATIOS - 1 - np.log(RATIOS)))


def test_advantage_normalisation_is_applied(rng):
    advantages = jax.random.normal(rng, (64,)) * 3.0 + 1.0
    normalized = normalize_advantages(advantages)
    assert_allclose(normalized, (np.asarray(advantages) - np.mean(advantages)) / (np.std(advantages) + 1e-8), scale=10)
    log_prob = jax.random.normal(jax.random.fold_in(rng, 1), (64,)) * 0.1
    zeros = jnp.zeros(64)
    _, aux = ppo_loss(
        log_prob,
        zeros,
        advantages,
        zeros,
        zeros,
        zeros,
        zeros,
        clip_eps=0.2,
        value_clip_eps=None,
        value_coef=0.0,
        entropy_coef=0.0,
    )
    expected, _ = clipped_surrogate_loss(log_prob, zeros, normalized, 0.2)
    assert_allclose(aux["policy_loss"], expected)


def test_q_learning_targets_and_loss():
    rewards = jnp.array([1.0, 0.5])
    terminated = jnp.array([False, True])
    next_q = jnp.array([[2.0, 3.0], [4.0, 1.0]])
    assert_allclose(q_learning_targets(rewards, next_q, terminated, gamma=0.9), [1.0 + 0.9 * 3.0, 0.5])
    online_next = jnp.array([[5.0, 0.0], [0.0, 5.0]])  # double DQN picks action 0 for row 0
    assert_allclose(q_learning_targets(rewards, next_q, terminated, gamma=0.9, double_q_next=online_next), [2.8, 0.5])
    q = jnp.array([[1.0, 2.0], [0.0, -1.0]])
    actions = jnp.array([1, 0])
    targets = jnp.array([4.5, 0.5])
    assert_allclose(q_learning_loss(q, actions, targets), 0.5 * (2.5**2 + 0.5**2) / 2)
    # Huber(delta=1): |2.5| -> 2.5 - .5 = 2;  |.5| -> .125
    assert_allclose(q_learning_loss(q, actions, targets, huber_delta=1.0), (2.0 + 0.125) / 2)

"""GAE against hand-computed values and an independent sum-of-deltas reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.training.rl.gae import gae_advantages
from tests.tolerances import assert_allclose

REWARDS = jnp.array([1.0, 2.0, 3.0, 4.0])
VALUES = jnp.array([0.5, 1.0, 1.5, 2.0])
# V(final_observation): at t=1 the episode is cut, the pre-reset observation is worth 7.
NEXT_VALUES = jnp.array([1.0, 7.0, 2.0, 3.0])


def test_truncation_bootstraps_from_the_final_observation():
    terminated = jnp.array([False, False, False, True])
    truncated = jnp.array([False, True, False, False])
    advantages, returns = gae_advantages(REWARDS, VALUES, NEXT_VALUES, terminated, truncated, gamma=0.9, gae_lambda=0.5)
    # deltas: 1 + .9*1 - .5 = 1.4;  2 + .9*7 - 1 = 7.3 (bootstrapped);  3 + .9*2 - 1.5 = 3.3;  4 - 2 = 2 (terminal)
    # A3 = 2;  A2 = 3.3 + .45*2 = 4.2;  A1 = 7.3 (episode boundary);  A0 = 1.4 + .45*7.3 = 4.685
    assert_allclose(advantages, [4.685, 7.3, 4.2, 2.0])
    assert_allclose(returns, [5.185, 8.3, 5.7, 4.0])


def test_termination_does_not_bootstrap():
    terminated = jnp.array([False, True, False, True])
    truncated = jnp.zeros(4, bool)
    advantages, _ = gae_advantages(REWARDS, VALUES, NEXT_VALUES, terminated, truncated, gamma=0.9, gae_lambda=0.5)
    # A1 = 2 - 1 = 1 (no bootstrap from the value 7);  A0 = 1.4 + .45*1 = 1.85
    assert_allclose(advantages, [1.85, 1.0, 4.2, 2.0])


def test_no_boundary_lambda_one_is_the_discounted_return_minus_value():
    never = jnp.zeros(4, bool)
    next_values = jnp.array([1.0, 1.5, 2.0, 3.0])  # without boundaries V(s'_t) = V(s_{t+1})
    _, returns = gae_advantages(REWARDS, VALUES, next_values, never, never, gamma=0.9, gae_lambda=1.0)
    # lambda = 1 telescopes: R_0 = 1 + .9*2 + .81*3 + .729*4 + .6561*V(s'_3)=3
    assert_allclose(returns[0], 1 + 0.9 * 2 + 0.81 * 3 + 0.729 * 4 + 0.6561 * 3.0)


def reference_gae(rewards, values, next_values, terminated, truncated, gamma, lam):
    """A_t = sum_k (gamma lam)^k delta_{t+k}, summed until the first episode end."""
    deltas = rewards + gamma * (1 - terminated) * next_values - values
    done = np.logical_or(terminated, truncated)
    out = np.zeros_like(values)
    for t in range(len(rewards)):
        weight = 1.0
        for k in range(t, len(rewards)):
            out[t] += weight * deltas[k]
            if done[k]:
                break
            weight *= gamma * lam
    return out


def test_matches_reference_on_random_batched_rollouts(rng):
    keys = jax.random.split(rng, 5)
    shape = (32, 3)  # [T, envs]
    rewards = jax.random.normal(keys[0], shape)
    values = jax.random.normal(keys[1], shape)
    next_values = jax.random.normal(keys[2], shape)
    terminated = jax.random.bernoulli(keys[3], 0.1, shape)
    truncated = jax.random.bernoulli(keys[4], 0.1, shape) & ~terminated
    advantages, returns = jax.jit(gae_advantages, static_argnames=("gamma", "gae_lambda"))(
        rewards, values, next_values, terminated, truncated, gamma=0.97, gae_lambda=0.9
    )
    arrays = [np.asarray(a, np.float64) for a in (rewards, values, next_values, terminated, truncated)]
    expected = np.stack([reference_gae(*(a[:, i] for a in arrays), 0.97, 0.9) for i in range(shape[1])], axis=1)
    assert_allclose(advantages, expected, scale=10)  # float32 sums of up to 32 terms
    assert_allclose(returns - values, expected, scale=10)


def test_each_agent_stops_at_its_own_end(rng):
    """A multi-agent rollout ``[T, envs, agents]`` where agents end one by one (SMAX's dead
    units: ``terminated`` from an agent's death to the episode's end) and episodes are cut by a
    time limit for everyone: every agent's advantages are the reference's on its own flags."""
    keys = jax.random.split(rng, 3)
    shape = (24, 2, 3)
    rewards, values, next_values = (jax.random.normal(k, shape) for k in keys[:3])
    death = jnp.array([[3, 7, 20], [5, 12, 0]])  # the step of its episode each agent dies at (11+: never)
    steps = jnp.arange(24)[:, None, None]
    terminated = steps % 12 >= death  # dead until its episode ends
    truncated = jnp.broadcast_to(steps % 12 == 11, shape)  # a time limit every 12 steps
    advantages, _ = gae_advantages(rewards, values, next_values, terminated, truncated, gamma=0.97, gae_lambda=0.9)
    arrays = [np.asarray(a, np.float64) for a in (rewards, values, next_values, terminated, truncated)]
    for env in range(2):
        for agent in range(3):
            expected = reference_gae(*(a[:, env, agent] for a in arrays), 0.97, 0.9)
            assert_allclose(advantages[:, env, agent], expected, scale=10)
    assert not np.array_equal(np.asarray(terminated[..., 0]), np.asarray(terminated[..., 1])), "agents end apart"


def test_rejects_bad_arguments():
    never = jnp.zeros(4, bool)
    with pytest.raises(ValueError, match="gae_lambda must lie in"):
        gae_advantages(REWARDS, VALUES, NEXT_VALUES, never, never, gamma=0.9, gae_lambda=1.5)
    with pytest.raises(ValueError, match="share one shape"):
        gae_advantages(REWARDS, VALUES[:3], NEXT_VALUES, never, never, gamma=0.9, gae_lambda=0.5)

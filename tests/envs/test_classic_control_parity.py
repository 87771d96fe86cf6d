"""Classic control against gymnasium: from identical states and actions, 200 steps of next
states, rewards, terminated and truncated flags (float64 and float32).

Each step starts ours from gymnasium's current state (so chaotic divergence of two float
implementations is not mistaken for an error) and compares the transition; episodes end
and restart in both together, the time limit is shortened so truncation is exercised.
"""

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ember.envs
from tests.tolerances import assert_allclose

STEPS = 200
TIME_LIMIT = 60


def cartpole_state(state):
    return np.array([state.x, state.x_dot, state.theta, state.theta_dot])


def cartpole_from(gym_state, state):
    x, x_dot, theta, theta_dot = (jnp.asarray(v, state.x.dtype) for v in gym_state)
    return state.replace(x=x, x_dot=x_dot, theta=theta, theta_dot=theta_dot)


def discrete(n):
    return lambda rng: np.asarray(rng.integers(n))


# id -> (our state as gymnasium's state vector, gymnasium's state vector into our state,
#        gymnasium's observation in float64 (its own is cast to float32), random action)
CASES = {
    "CartPole-v1": (cartpole_state, cartpole_from, lambda gym: np.asarray(gym.state), discrete(2)),
}


def run_parity(env_id, dtype):
    to_gym, from_gym, gym_observation, random_action = CASES[env_id]
    env, params = ember.envs.make(env_id, max_steps_in_episode=TIME_LIMIT)
    gym_env = gymnasium.make(env_id, max_episode_steps=TIME_LIMIT)
    step = jax.jit(env.step)
    rng = np.random.default_rng(abs(hash(env_id)) % 2**32)
    key = jax.random.key(int(rng.integers(2**31)))
    _, state = env.reset(key, params)
    gym_env.reset(seed=int(rng.integers(2**31)))
    gym_env.unwrapped.state = to_gym(state).astype(np.float64)
    episodes_ended = 0
    for t in range(STEPS):
        action = random_action(rng)
        state = from_gym(gym_env.unwrapped.state, state)
        key, step_key = jax.random.split(key)
        obs, next_state, reward, terminated, truncated, info = step(step_key, state, jnp.asarray(action), params)
        _, gym_reward, gym_terminated, gym_truncated, _ = gym_env.step(action)
        message = f"{env_id} step {t}"
        assert_allclose(info["final_observation"], gym_observation(gym_env.unwrapped), dtype=dtype, err_msg=message)
        assert_allclose(reward, gym_reward, dtype=dtype, err_msg=message)
        assert bool(terminated) == gym_terminated, message
        assert bool(truncated) == gym_truncated, message
        if gym_terminated or gym_truncated:
            episodes_ended += 1
            gym_env.reset(seed=int(rng.integers(2**31)))
            gym_env.unwrapped.state = to_gym(next_state).astype(np.float64)
            assert int(next_state.time) == 0
        state = next_state
    assert episodes_ended >= 2, "the scenario should cross episode boundaries"


@pytest.mark.parametrize("env_id", sorted(CASES))
def test_matches_gymnasium_float64(env_id):
    with jax.enable_x64(True):
        run_parity(env_id, np.float64)


@pytest.mark.parametrize("env_id", sorted(CASES))
def test_matches_gymnasium_float32(env_id):
    run_parity(env_id, np.float32)

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
from tests.host_random import numpy_rng
from tests.tolerances import assert_allclose

STEPS = 200
TIME_LIMIT = 60


def cartpole_state(state):
    return np.array([state.x, state.x_dot, state.theta, state.theta_dot])


def cartpole_from(gym_state, state):
    x, x_dot, theta, theta_dot = (jnp.asarray(v, state.x.dtype) for v in gym_state)
    return state.replace(x=x, x_dot=x_dot, theta=theta, theta_dot=theta_dot)


def fields_state(*names):
    """(to_gym, from_gym) for a state whose gymnasium vector lists the fields ``names``."""

    def to_gym(state):
        return np.array([getattr(state, name) for name in names])

    def from_gym(gym_state, state):
        dtype = getattr(state, names[0]).dtype
        return state.replace(**{name: jnp.asarray(v, dtype) for name, v in zip(names, np.asarray(gym_state))})

    return to_gym, from_gym


def pendulum_observation(gym):
    theta, theta_dot = gym.state
    return np.array([np.cos(theta), np.sin(theta), theta_dot])


def acrobot_observation(gym):
    t1, t2, v1, v2 = gym.state
    return np.array([np.cos(t1), np.sin(t1), np.cos(t2), np.sin(t2), v1, v2])


def continuous(low, high):
    return lambda rng: rng.uniform(low, high, size=(1,)).astype(np.float32)


def discrete(n):
    return lambda rng: np.asarray(rng.integers(n))


# id -> (our state as gymnasium's state vector, gymnasium's state vector into our state,
#        gymnasium's observation in float64 (its own is cast to float32), random action)
CASES = {
    "CartPole-v1": (cartpole_state, cartpole_from, lambda gym: np.asarray(gym.state), discrete(2)),
    "Pendulum-v1": (*fields_state("theta", "theta_dot"), pendulum_observation, continuous(-2.0, 2.0)),
    "MountainCar-v0": (
        *fields_state("position", "velocity"),
        lambda gym: np.asarray(gym.state, np.float64),
        discrete(3),
    ),
    "MountainCarContinuous-v0": (
        *fields_state("position", "velocity"),
        lambda gym: np.asarray(gym.state, np.float64),
        continuous(-1.0, 1.0),
    ),
    "Acrobot-v1": (
        *fields_state("joint_angle1", "joint_angle2", "velocity1", "velocity2"),
        acrobot_observation,
        discrete(3),
    ),
}


# gymnasium computes part of these steps in float32 (MountainCarContinuous keeps its state in
# float32; Pendulum multiplies the float32 torque in float32), so its float64 reference is
# only float32-accurate there: compare at atol/rtol 1e-5 instead of 1e-9.
FLOAT32_REFERENCE_SCALE = {"MountainCarContinuous-v0": 1e4, "Pendulum-v1": 1e4}


def run_parity(env_id, dtype, key):
    to_gym, from_gym, gym_observation, random_action = CASES[env_id]
    env, params = ember.envs.make(env_id, max_steps_in_episode=TIME_LIMIT)
    gym_env = gymnasium.make(env_id, max_episode_steps=TIME_LIMIT)
    step = jax.jit(env.step)
    rng = numpy_rng(key)  # the test's own seed (hash() of a str varies with PYTHONHASHSEED)
    key = jax.random.key(int(rng.integers(2**31)))
    _, state = env.reset(key, params)
    gym_env.reset(seed=int(rng.integers(2**31)))
    gym_env.unwrapped.state = to_gym(state).astype(np.float64)
    scale = FLOAT32_REFERENCE_SCALE.get(env_id, 1.0) if dtype == np.float64 else 1.0
    episodes_ended = 0
    for t in range(STEPS):
        action = random_action(rng)
        state = from_gym(gym_env.unwrapped.state, state)
        key, step_key = jax.random.split(key)
        _obs, next_state, reward, terminated, truncated, info = step(step_key, state, jnp.asarray(action), params)
        _, gym_reward, gym_terminated, gym_truncated, _ = gym_env.step(action)
        message = f"{env_id} step {t}"
        assert_allclose(
            info["final_observation"], gym_observation(gym_env.unwrapped), dtype=dtype, scale=scale, err_msg=message
        )
        assert_allclose(reward, gym_reward, dtype=dtype, scale=scale, err_msg=message)
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
def test_matches_gymnasium_float64(env_id, rng):
    with jax.enable_x64(True):
        run_parity(env_id, np.float64, rng)


@pytest.mark.parametrize("env_id", sorted(CASES))
def test_matches_gymnasium_float32(env_id, rng):
    run_parity(env_id, np.float32, rng)

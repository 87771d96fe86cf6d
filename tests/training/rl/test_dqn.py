"""DQN: replay buffer semantics, epsilon-greedy, and learning CartPole."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ember.envs
from ember.core.config import load_config
from ember.core.errors import ConfigError
from ember.training.rl.config import RLConfig
from ember.training.rl.dqn import DQNConfig, epsilon_greedy, make_act, make_q_network, make_train
from ember.training.rl.evaluate import evaluate
from ember.training.rl.replay_buffer import replay_buffer_add, replay_buffer_init, replay_buffer_sample

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "rl"


def test_replay_buffer_wraps_around_and_samples_stored_items(rng):
    # Jitted, as training uses them (eager, every op compiles on its own); the capacity check
    # runs at trace time either way.
    add, sample = jax.jit(replay_buffer_add), jax.jit(replay_buffer_sample, static_argnums=2)
    buffer = replay_buffer_init({"x": np.zeros(2, np.float32), "a": np.int32(0)}, capacity=5)
    values = np.asarray(jax.random.normal(rng, (7, 2)))
    buffer = add(buffer, {"x": values[:3], "a": np.arange(3, dtype=np.int32)})
    assert int(buffer.size) == 3 and int(buffer.position) == 3
    buffer = add(buffer, {"x": values[3:], "a": np.arange(3, 7, dtype=np.int32)})
    assert int(buffer.size) == 5 and int(buffer.position) == 2
    # items 5 and 6 overwrote slots 0 and 1; slots 2..4 still hold items 2..4
    np.testing.assert_array_equal(buffer.data["a"], [5, 6, 2, 3, 4])
    np.testing.assert_array_equal(buffer.data["x"], np.asarray(values)[[5, 6, 2, 3, 4]])
    batch = sample(buffer, rng, 200)
    assert set(np.asarray(batch["a"]).tolist()) == {2, 3, 4, 5, 6}  # all stored, nothing else
    np.testing.assert_array_equal(batch["x"], np.asarray(values)[np.asarray(batch["a"])])  # rows stay together
    with pytest.raises(ValueError, match="capacity"):
        add(buffer, {"x": np.ones((6, 2), np.float32), "a": np.arange(6, dtype=np.int32)})


def test_epsilon_greedy_explores_at_the_given_rate(rng):
    q_values = jax.random.normal(rng, (20000, 4))
    greedy = np.asarray(q_values).argmax(-1)
    np.testing.assert_array_equal(epsilon_greedy(rng, q_values, 0.0), greedy)
    actions = np.asarray(epsilon_greedy(rng, q_values, 0.4))
    # a random action differs from the greedy one with probability 3/4
    np.testing.assert_allclose((actions != greedy).mean(), 0.4 * 0.75, atol=0.015)  # ~4 sampling std devs


def test_config_validation():
    with pytest.raises(ValueError, match="learning_starts"):
        DQNConfig(buffer_size=100, learning_starts=500, num_envs=4)
    with pytest.raises(ValueError, match="total_timesteps"):
        DQNConfig(total_timesteps=10)
    # 2 records of 5 iterations of 4 envs: 40 env steps, 10 iterations
    short = dict(num_envs=4, log_every=5, total_timesteps=40, buffer_size=100)
    with pytest.raises(ValueError, match=r"learning_starts \(40\) must be below the run's 40 env steps"):
        DQNConfig(**short, learning_starts=40)
    with pytest.raises(ValueError, match=r"target_update_every \(11\) must be at most the run's 10 iterations"):
        DQNConfig(**short, learning_starts=0, target_update_every=11)
    DQNConfig(**short, learning_starts=36, target_update_every=10)
    for name in ("learning_rate", "max_grad_norm", "huber_delta"):
        with pytest.raises(ValueError, match=f"{name} must be positive"):
            DQNConfig(**{name: 0.0})
    # the greedy index 0 .. n - 1 would be clipped into Discrete(2, start=1): both actions 0 and 1 become 1
    env, env_params = ember.envs.make("CartPole-v1")
    shifted = ember.envs.wrappers.Wrapper(env)
    shifted.action_space = lambda params: ember.envs.spaces.Discrete(2, start=1)
    with pytest.raises(ConfigError, match=r"PQN needs discrete actions 0 \.\. n - 1 \(start 0\)") as error:
        make_q_network(DQNConfig(), shifted, env_params, algo="PQN")
    assert error.value.key == "algo"
    # tau 0 would leave the target network at its initialisation for the whole run
    with pytest.raises(ConfigError, match=r"tau must lie in \(0, 1\], got 0.0") as error:
        DQNConfig(tau=0.0)
    assert error.value.key == "tau"


@pytest.mark.slow
def test_shipped_dqn_config_learns_cartpole():
    config = load_config(RLConfig, CONFIGS / "dqn_cartpole.yaml")
    env, env_params = ember.envs.make(config.env.id)
    network = make_q_network(config.dqn, env, env_params)
    result = jax.jit(make_train(config.dqn, env, env_params))(jax.random.key(config.seed))
    returns, _ = evaluate(make_act(network, result["params"]), env, env_params, jax.random.key(1), num_episodes=100)
    untrained = network.init(jax.random.key(0), jnp.zeros((1, 4)))
    baseline, _ = evaluate(make_act(network, untrained), env, env_params, jax.random.key(1), num_episodes=100)
    # measured on CPU: ~350 after training; an untrained greedy network scores ~10
    assert float(returns.mean()) >= 150.0, f"DQN mean return {float(returns.mean())}"
    assert float(returns.mean()) >= 5 * float(baseline.mean())

"""SAC: its losses by hand, config validation, and solving Pendulum."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ember.envs
from ember.core.config import load_config
from ember.core.errors import ConfigError
from ember.training.rl.config import RLConfig
from ember.training.rl.evaluate import evaluate
from ember.training.rl.sac import (
    SACConfig,
    actor_loss,
    critic_loss,
    make_act,
    make_actor,
    make_train,
    soft_targets,
    temperature_loss,
)

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "rl"


def test_losses_by_hand():
    rewards, terminated = jnp.asarray([1.0, -0.5]), jnp.asarray([False, True])
    next_q1, next_q2, next_log_prob = jnp.asarray([2.0, 3.0]), jnp.asarray([1.5, 4.0]), jnp.asarray([-1.0, 0.5])
    targets = soft_targets(rewards, terminated, next_q1, next_q2, next_log_prob, jnp.float32(0.2), gamma=0.9)
    np.testing.assert_allclose(targets, [1.0 + 0.9 * (1.5 + 0.2), -0.5], rtol=1e-6)
    q1, q2 = jnp.asarray([1.0, 2.0]), jnp.asarray([0.0, 1.0])
    np.testing.assert_allclose(critic_loss(q1, q2, jnp.asarray([1.0, 1.0])), 0.5 + 0.5, rtol=1e-6)
    np.testing.assert_allclose(actor_loss(jnp.asarray([-1.0, 0.0]), q1, q2, jnp.float32(0.5)), (-0.5 - 0 + 0 - 1) / 2)
    # The temperature rises (log alpha's gradient is negative) while the entropy is below its target.
    low_entropy = jax.grad(temperature_loss)(jnp.float32(0.0), jnp.asarray([3.0, 3.0]), -1.0)
    high_entropy = jax.grad(temperature_loss)(jnp.float32(0.0), jnp.asarray([-3.0, -3.0]), -1.0)
    assert float(low_entropy) < 0 < float(high_entropy)


def test_config_validation():
    with pytest.raises(ConfigError, match="learning_starts"):
        SACConfig(buffer_size=100, learning_starts=500)
    with pytest.raises(ConfigError, match="total_timesteps"):
        SACConfig(total_timesteps=10)
    with pytest.raises(ConfigError, match="needs continuous actions"):
        load_config(RLConfig, CONFIGS / "sac_pendulum.yaml", ["env.id=CartPole-v1"])
    with pytest.raises(ConfigError) as error:
        load_config(RLConfig, CONFIGS / "sac_pendulum.yaml", ["ppo.learning_rate=0.123"])
    assert error.value.key == "ppo"


@pytest.mark.xla_optimized  # 15k environment and gradient steps: run time outweighs compile time
def test_shipped_sac_config_solves_pendulum():
    config = load_config(RLConfig, CONFIGS / "sac_pendulum.yaml")
    env, env_params = ember.envs.make(config.env.id)
    result = jax.jit(make_train(config.sac, env, env_params))(jax.random.key(config.seed))
    actor = make_actor(config.sac, env, env_params)
    returns, _ = evaluate(make_act(actor, result["params"]), env, env_params, jax.random.key(1), num_episodes=20)
    # Pendulum counts as solved above -200; measured about -145 for seeds 0-2 (a random policy: about -1200).
    assert float(returns.mean()) > -200.0, f"SAC mean greedy return {float(returns.mean())}"
    temperatures = np.asarray(result["metrics"]["temperature"])
    assert temperatures[-1] < temperatures[0]  # tuned down from 1 as the policy's entropy drops

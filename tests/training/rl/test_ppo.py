"""PPO: one jitted train(rng) that vmaps over seeds and hyperparameters, and solves CartPole."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ember.envs
from ember.core.config import load_config
from ember.models.policies import PolicyConfig
from ember.training.rl.config import RLConfig
from ember.training.rl.evaluate import evaluate
from ember.training.rl.ppo import PPOConfig, PPOHyperparams, make_act, make_policy, make_train
from tests.tolerances import assert_allclose

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "rl"
SMALL = PPOConfig(
    num_envs=4, num_steps=16, total_timesteps=4 * 16 * 5, update_epochs=2, num_minibatches=2,
    learning_rate=1e-3, policy=PolicyConfig(hidden_sizes=(16, 16)),
)


def test_vmap_over_seeds_and_hyperparameters_equals_separate_runs(rng):
    env, env_params = ember.envs.make("CartPole-v1")
    train = make_train(SMALL, env, env_params)
    seeds = jax.random.split(rng, 4)
    base = PPOHyperparams.from_config(SMALL)
    learning_rates = jnp.array([1e-3, 3e-4, 1e-3, 2e-3])
    sweep = jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (4,)), base).replace(learning_rate=learning_rates)

    batched = jax.jit(jax.vmap(train))(seeds, sweep)
    single = jax.jit(train)
    for i in range(4):
        alone = single(seeds[i], base.replace(learning_rate=learning_rates[i]))
        take = lambda tree: jax.tree.map(lambda leaf: leaf[i], tree)  # noqa: E731
        # The rollouts (sampled actions, episode ends) are the same ...
        np.testing.assert_array_equal(batched["metrics"]["episodes"][i], alone["metrics"]["episodes"])
        np.testing.assert_array_equal(batched["metrics"]["episode_return"][i], alone["metrics"]["episode_return"])
        # ... and the parameters agree up to Adam's amplification of rounding: batched and
        # unbatched matmuls round differently, and Adam turns a rounding-level gradient on a
        # near-zero component into a step of up to lr. Bound: 5 updates * 2 epochs * 2
        # minibatches * lr 2e-3 = 0.04, tolerance scale 2000 (atol = rtol = 0.02) is below it.
        jax.tree.map(lambda a, b: assert_allclose(a, b, scale=2000), take(batched["params"]), alone["params"])
    # the runs differ from each other (a vmap that broadcast one run would pass the above)
    kernel = batched["params"]["params"]["actor"]["torso"]["Dense_0"]["kernel"]
    assert not np.allclose(kernel[0], kernel[2])
    assert np.isfinite(np.asarray(batched["metrics"]["loss"])).all()


def test_one_update_changes_only_with_nonzero_learning_rate(rng):
    env, env_params = ember.envs.make("CartPole-v1")
    config = PPOConfig(num_envs=2, num_steps=8, total_timesteps=16, update_epochs=1, num_minibatches=1,
                       policy=PolicyConfig(hidden_sizes=(8,)))
    train = jax.jit(make_train(config, env, env_params))
    hp = PPOHyperparams.from_config(config)
    frozen = train(rng, hp.replace(learning_rate=jnp.float32(0.0)))
    init = make_policy(config, env, env_params).init(jax.random.split(rng, 3)[1], jnp.zeros((2, 4)))
    for leaf, init_leaf in zip(jax.tree.leaves(frozen["params"]), jax.tree.leaves(init)):
        assert_allclose(leaf, init_leaf)
    moved = train(rng, hp)
    assert not np.allclose(moved["params"]["params"]["actor"]["logits"]["kernel"], init["params"]["actor"]["logits"]["kernel"])


def test_config_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match="num_minibatches"):
        PPOConfig(num_envs=3, num_steps=5, num_minibatches=4)
    with pytest.raises(ValueError, match="total_timesteps"):
        PPOConfig(num_envs=4, num_steps=128, total_timesteps=100)


@pytest.mark.slow
def test_shipped_cartpole_config_solves_cartpole():
    config = load_config(RLConfig, CONFIGS / "ppo_cartpole.yaml")
    env, env_params = ember.envs.make(config.env.id)
    result = jax.jit(make_train(config.ppo, env, env_params))(jax.random.key(config.seed))
    act = make_act(make_policy(config.ppo, env, env_params), result["params"])
    returns, lengths = evaluate(act, env, env_params, jax.random.key(1), num_episodes=100)
    assert float(returns.mean()) >= 475.0, f"mean return {float(returns.mean())} over 100 episodes"
    assert_allclose(returns, lengths.astype(np.float32))  # CartPole pays 1 per step


@pytest.mark.slow
def test_shipped_pendulum_config_improves_past_threshold():
    config = load_config(RLConfig, CONFIGS / "ppo_pendulum.yaml")
    env, env_params = ember.envs.make(config.env.id)
    policy = make_policy(config.ppo, env, env_params)
    result = jax.jit(make_train(config.ppo, env, env_params))(jax.random.key(config.seed))
    trained, _ = evaluate(make_act(policy, result["params"]), env, env_params, jax.random.key(1), num_episodes=100)
    untrained_params = policy.init(jax.random.key(0), jnp.zeros((1, 3)))
    untrained, _ = evaluate(make_act(policy, untrained_params), env, env_params, jax.random.key(1), num_episodes=100)
    # measured on CPU: untrained ~-1200, trained ~-170 (a swing-up-and-balance policy)
    assert float(untrained.mean()) < -800.0
    assert float(trained.mean()) > -400.0, f"Pendulum mean return {float(trained.mean())}"

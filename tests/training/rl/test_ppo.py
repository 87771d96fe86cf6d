"""PPO: one jitted train(rng) that vmaps over seeds and hyperparameters, and solves CartPole."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ember.envs
from ember.core.config import load_config
from ember.core.errors import ConfigError
from ember.envs.wrappers import Wrapper
from ember.models.policies import PolicyConfig
from ember.training.rl.config import RLConfig
from ember.training.rl.evaluate import evaluate
from ember.training.rl.ppo import PPOConfig, PPOHyperparams, make_act, make_policy, make_train
from tests import xla_settings
from tests.tolerances import assert_allclose

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "rl"
SMALL = PPOConfig(
    num_envs=4,
    num_steps=16,
    total_timesteps=4 * 16 * 5,
    update_epochs=2,
    num_minibatches=2,
    learning_rate=1e-3,
    policy=PolicyConfig(hidden_sizes=(16, 16)),
)


def test_vmap_over_seeds_and_hyperparameters_equals_separate_runs(rng):
    # with observation normalisation on: its running statistics travel in the vmapped state too
    env, env_params = ember.envs.make("CartPole-v1")
    train = make_train(dataclasses.replace(SMALL, normalize_observations=True), env, env_params)
    seeds = jax.random.split(rng, 4)
    base = PPOHyperparams.from_config(SMALL)
    learning_rates = jnp.array([1e-3, 3e-4, 1e-3, 2e-3])
    sweep = jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (4,)), base).replace(learning_rate=learning_rates)

    batched = jax.jit(jax.vmap(train))(seeds, sweep)
    single = jax.jit(train)
    for i in range(4):
        alone = single(seeds[i], base.replace(learning_rate=learning_rates[i]))
        take = lambda tree, i=i: jax.tree.map(lambda leaf: leaf[i], tree)  # noqa: E731
        # The rollouts (sampled actions, episode ends) are the same ...
        np.testing.assert_array_equal(batched["metrics"]["episodes"][i], alone["metrics"]["episodes"])
        np.testing.assert_array_equal(batched["metrics"]["episode_return"][i], alone["metrics"]["episode_return"])
        # ... and the parameters agree up to Adam's amplification of rounding: batched and
        # unbatched matmuls round differently, and Adam turns a rounding-level gradient on a
        # near-zero component into a step of up to lr. Bound: 5 updates * 2 epochs * 2
        # minibatches * lr 2e-3 = 0.04, tolerance scale 2000 (atol = rtol = 0.02) is below it.
        jax.tree.map(lambda a, b: assert_allclose(a, b, scale=2000), take(batched["params"]), alone["params"])
        # the same observations were seen, so the same statistics up to float rounding
        jax.tree.map(lambda a, b: assert_allclose(a, b, scale=10), take(batched["obs_stats"]), alone["obs_stats"])
    # the runs differ from each other (a vmap that broadcast one run would pass the above)
    kernel = batched["params"]["params"]["actor"]["torso"]["Dense_0"]["kernel"]
    assert not np.allclose(kernel[0], kernel[2])
    assert batched["obs_stats"].mean.shape == (4, 4) and not np.allclose(*batched["obs_stats"].mean[:2])
    assert np.isfinite(np.asarray(batched["metrics"]["loss"])).all()


def test_a_gamma_given_to_train_also_discounts_the_reward_normalisation(rng):
    """``train(rng, hyperparams)`` with gamma 0.9 runs as a config with gamma 0.9 does, reward
    normalisation included (its running return is discounted by the swept gamma too)."""
    env, env_params = ember.envs.make("CartPole-v1")
    config = dataclasses.replace(SMALL, normalize_rewards=True)
    swept = jax.jit(make_train(config, env, env_params))(rng, PPOHyperparams.from_config(config).replace(gamma=0.9))
    configured = jax.jit(make_train(dataclasses.replace(config, gamma=0.9), env, env_params))(rng)
    for name in ("episode_return", "value_loss", "loss"):
        assert_allclose(swept["metrics"][name], configured["metrics"][name], scale=100, err_msg=name)


def test_one_update_changes_only_with_nonzero_learning_rate(rng):
    env, env_params = ember.envs.make("CartPole-v1")
    config = PPOConfig(
        num_envs=2,
        num_steps=8,
        total_timesteps=16,
        update_epochs=1,
        num_minibatches=1,
        policy=PolicyConfig(hidden_sizes=(8,)),
    )
    train = jax.jit(make_train(config, env, env_params))
    hp = PPOHyperparams.from_config(config)
    frozen = train(rng, hp.replace(learning_rate=jnp.float32(0.0)))
    init = make_policy(config, env, env_params).init(jax.random.split(rng, 3)[1], jnp.zeros((2, 4)))
    for leaf, init_leaf in zip(jax.tree.leaves(frozen["params"]), jax.tree.leaves(init)):
        assert_allclose(leaf, init_leaf)
    moved = train(rng, hp)
    assert not np.allclose(
        moved["params"]["params"]["actor"]["logits"]["kernel"], init["params"]["actor"]["logits"]["kernel"]
    )


def test_config_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match="num_minibatches"):
        PPOConfig(num_envs=3, num_steps=5, num_minibatches=4)
    with pytest.raises(ValueError, match="total_timesteps"):
        PPOConfig(num_envs=4, num_steps=128, total_timesteps=100)
    # a sign slip would train silently: gradient ascent, no step at all (a zero gradient-norm
    # clip), or a clip range upside down
    for name in ("learning_rate", "max_grad_norm", "clip_eps", "value_clip_eps"):
        with pytest.raises(ConfigError, match=f"{name} must be positive") as error:
            PPOConfig(**{name: -0.1})
        assert error.value.key == name
    # a negative value weight made the total loss climb the value error: the critic diverged silently
    with pytest.raises(ConfigError, match=r"value_coef must be >= 0, got -0\.5") as error:
        PPOConfig(value_coef=-0.5)
    assert error.value.key == "value_coef"
    PPOConfig(value_clip_eps=None)  # an unclipped value loss


class RecordObservations(Wrapper):
    """Hands every observation the agent receives (reset, and after each step) to ``seen``."""

    def __init__(self, env, seen: list):
        super().__init__(env)
        self.seen = seen

    def _record(self, obs):
        jax.debug.callback(lambda o: self.seen.append(np.asarray(o)), obs)
        return obs

    def reset_from_noise(self, noise, params):
        obs, state = self.env.reset_from_noise(noise, params)
        return self._record(obs), state

    def step_from_noise(self, noise, state, action, params):
        obs, state, reward, terminated, truncated, info = self.env.step_from_noise(noise, state, action, params)
        return self._record(obs), state, reward, terminated, truncated, info


NORMALIZED = dataclasses.replace(SMALL, total_timesteps=4 * 16 * 2, normalize_observations=True)


def test_observation_statistics_are_the_moments_seen_and_act_applies_them_frozen(rng):
    env, env_params = ember.envs.make("Pendulum-v1")
    seen = []
    result = jax.jit(make_train(NORMALIZED, RecordObservations(env, seen), env_params))(rng)
    jax.effects_barrier()
    raw = np.stack(seen).reshape(-1, 3).astype(np.float64)
    stats = result["obs_stats"]
    # one statistic shared by the batch: every env's reset and every step of every env
    assert raw.shape[0] == 4 * (1 + 2 * 16)
    assert_allclose(stats.count, 1e-4 + raw.shape[0])
    # the prior (mean 0, var 1, weight 1e-4) and float32 streaming merges move them by ~1e-6
    assert_allclose(stats.mean, raw.mean(axis=0), scale=10)
    assert_allclose(stats.var, raw.var(axis=0), scale=10)
    assert float(stats.var[2]) > 0.1  # Pendulum's angular velocity does vary: not the prior

    # the trained policy sees (obs - mean) / sqrt(var + eps) with these statistics, never updated
    policy, params = make_policy(NORMALIZED, env, env_params), result["params"]
    raw_act = make_act(policy, params)
    mean, std = np.asarray(stats.mean), np.sqrt(np.asarray(stats.var) + 1e-8)
    by_hand = lambda obs, key: raw_act((obs - mean) / std, key)  # noqa: E731
    key = jax.random.fold_in(rng, 1)
    returns, lengths = evaluate(make_act(policy, params, obs_stats=stats), env, env_params, key, num_episodes=4)
    expected, expected_lengths = evaluate(by_hand, env, env_params, key, num_episodes=4)
    assert_allclose(returns, expected)
    np.testing.assert_array_equal(lengths, expected_lengths)
    unnormalised, _ = evaluate(raw_act, env, env_params, key, num_episodes=4)
    assert not np.allclose(returns, unnormalised)  # the statistics are really applied


@pytest.mark.slow
@pytest.mark.xla_optimized  # thousands of environment steps: run time outweighs compile time
def test_shipped_cartpole_config_solves_cartpole():
    config = load_config(RLConfig, CONFIGS / "ppo_cartpole.yaml")
    env, env_params = ember.envs.make(config.env.id)
    result = jax.jit(make_train(config.ppo, env, env_params))(jax.random.key(config.seed))
    act = make_act(make_policy(config.ppo, env, env_params), result["params"], obs_stats=result["obs_stats"])
    with xla_settings.fast_compiles():  # compiling the evaluation optimized cost seconds
        returns, lengths = evaluate(act, env, env_params, jax.random.key(1), num_episodes=100)
    assert float(returns.mean()) >= 475.0, f"mean return {float(returns.mean())} over 100 episodes"
    assert_allclose(returns, lengths.astype(np.float32))  # CartPole pays 1 per step


@pytest.mark.slow
@pytest.mark.xla_optimized
def test_shipped_pendulum_config_improves_past_threshold():
    config = load_config(RLConfig, CONFIGS / "ppo_pendulum.yaml")
    env, env_params = ember.envs.make(config.env.id)
    policy = make_policy(config.ppo, env, env_params)
    result = jax.jit(make_train(config.ppo, env, env_params))(jax.random.key(config.seed))
    act = make_act(policy, result["params"], obs_stats=result["obs_stats"])
    # compiling the evaluations optimized cost seconds, and so did the untrained initialisation's
    # eager ops (about 30 of them, each its own compiled program)
    with xla_settings.fast_compiles():
        trained, _ = evaluate(act, env, env_params, jax.random.key(1), num_episodes=100)
        untrained_params = policy.init(jax.random.key(0), jnp.zeros((1, 3)))
        untrained_act = make_act(policy, untrained_params)
        untrained, _ = evaluate(untrained_act, env, env_params, jax.random.key(1), num_episodes=100)
    # measured on CPU: untrained ~-1200, trained ~-170 (a swing-up-and-balance policy)
    assert float(untrained.mean()) < -800.0
    assert float(trained.mean()) > -400.0, f"Pendulum mean return {float(trained.mean())}"

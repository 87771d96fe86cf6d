"""PPO for single-agent environments: the whole run is one jittable ``train(rng)``.

    env, env_params = ember.envs.make("CartPole-v1")
    train = jax.jit(make_train(PPOConfig(), env, env_params))
    result = train(jax.random.key(0))                       # one run
    results = jax.jit(jax.vmap(make_train(...)))(keys)      # one run per seed, in parallel

``train(rng, hyperparams=None)`` takes the float hyperparameters (:class:`PPOHyperparams`)
as traced values, so ``jax.vmap`` runs a sweep over learning rates, clip ranges, ... in one
compiled program. Shapes (``num_envs``, ``num_steps``, minibatches, epochs) are static.

The math lives in :mod:`.gae` and :mod:`.losses`; this module only wires it together:
rollout of ``num_steps`` in ``num_envs`` auto-resetting environments -> values of the
observations and of ``info["final_observation"]`` -> GAE -> ``update_epochs`` passes of
``num_minibatches`` shuffled minibatches of the PPO loss (with a gradient-norm clip and an
optionally annealed Adam learning rate).

With ``normalize_observations`` the policy sees observations normalised by running
statistics shared over the ``num_envs`` environments (``NormalizeObservation``); ``train``
returns the final statistics as ``obs_stats`` and the trained policy is run with them frozen:
``make_act(policy, result["params"], obs_stats=result["obs_stats"])``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training.train_state import TrainState

from ember.envs.batched import BatchedEnv
from ember.envs.wrappers import LogWrapper, NormalizeObservation, NormalizeReward, RunningMeanVar
from ember.models.policies import ActorCritic, PolicyConfig, action_head
from ember.training.rl.gae import gae_advantages
from ember.training.rl.losses import ppo_loss


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """PPO settings (the ``ppo:`` section of an RL config). Defaults are PureJaxRL's CartPole."""

    num_envs: int = 4
    num_steps: int = 128
    total_timesteps: int = 500_000
    update_epochs: int = 4
    num_minibatches: int = 4
    learning_rate: float = 2.5e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    value_clip_eps: float | None = 0.2
    entropy_coef: float = 0.01
    value_coef: float = 0.5
    max_grad_norm: float = 0.5
    normalize_advantage: bool = True
    normalize_rewards: bool = False
    normalize_observations: bool = False
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)

    def __post_init__(self):
        for name in ("num_envs", "num_steps", "total_timesteps", "update_epochs", "num_minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"ppo.{name} must be a positive integer, got {getattr(self, name)}")
        if self.num_updates < 1:
            raise ValueError(
                f"ppo.total_timesteps ({self.total_timesteps}) must cover at least one rollout of "
                f"num_envs * num_steps = {self.num_envs * self.num_steps} steps"
            )
        if (self.num_envs * self.num_steps) % self.num_minibatches:
            raise ValueError(
                f"ppo.num_minibatches ({self.num_minibatches}) must divide num_envs * num_steps "
                f"= {self.num_envs * self.num_steps}"
            )
        for name in ("gamma", "gae_lambda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"ppo.{name} must lie in [0, 1], got {getattr(self, name)}")

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // (self.num_envs * self.num_steps)

    @property
    def anneal_steps(self) -> int | None:
        """Optimizer steps over which the learning rate decays to 0 (``None``: constant)."""
        return self.num_updates * self.update_epochs * self.num_minibatches if self.anneal_lr else None


@struct.dataclass
class PPOHyperparams:
    """The float hyperparameters of a run, as (traceable, vmappable) scalars."""

    learning_rate: jax.Array
    gamma: jax.Array
    gae_lambda: jax.Array
    clip_eps: jax.Array
    value_clip_eps: jax.Array | None
    entropy_coef: jax.Array
    value_coef: jax.Array
    max_grad_norm: jax.Array

    @classmethod
    def from_config(cls, config: PPOConfig) -> PPOHyperparams:
        def scalar(value):
            return None if value is None else jnp.asarray(value, jnp.float32)

        return cls(**{field.name: scalar(getattr(config, field.name)) for field in dataclasses.fields(cls)})


@struct.dataclass
class Transition:
    """One rollout step of ``num_envs`` environments (time-major once scanned: ``[T, N, ...]``)."""

    obs: Any
    raw_action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    final_obs: Any
    episode_done: jax.Array
    episode_return: jax.Array
    episode_length: jax.Array


def make_optimizer(learning_rate: jax.Array, max_grad_norm: jax.Array, *, anneal_steps: int | None) -> optax.GradientTransformation:
    """Adam after a global-norm clip; with ``anneal_steps``, the learning rate decays
    linearly to 0 over that many optimizer steps."""
    if anneal_steps is not None:
        learning_rate = optax.linear_schedule(learning_rate, 0.0, anneal_steps)
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(learning_rate, eps=1e-5))


def minibatch_epochs(
    train_state: TrainState,
    batch: Any,
    loss_fn: Callable[[Any, Any], tuple[jax.Array, dict[str, jax.Array]]],
    rng: jax.Array,
    *,
    num_epochs: int,
    num_minibatches: int,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """``num_epochs`` passes over ``batch`` (a pytree with a leading ``[batch]`` axis), each
    split into ``num_minibatches`` shuffled minibatches, one gradient step per minibatch.

    Returns:
      The updated train state and ``loss_fn``'s aux (plus ``loss``) averaged over all steps.
    """
    batch_size = jax.tree.leaves(batch)[0].shape[0]

    def epoch(state, key):
        permutation = jax.random.permutation(key, batch_size)
        shuffled = jax.tree.map(lambda x: x[permutation].reshape(num_minibatches, -1, *x.shape[1:]), batch)

        def step(state, minibatch):
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, minibatch)
            return state.apply_gradients(grads=grads), {"loss": loss, **aux}

        return jax.lax.scan(step, state, shuffled)

    train_state, stats = jax.lax.scan(epoch, train_state, jax.random.split(rng, num_epochs))
    return train_state, jax.tree.map(jnp.mean, stats)


def minibatch_loss(dist, value: jax.Array, minibatch: dict[str, jax.Array], hp: PPOHyperparams, *,
                   normalize_advantage: bool):
    """:func:`ppo_loss` of a policy's ``dist``/``value`` on a rollout ``minibatch`` (keys
    ``raw_action``, ``log_prob``, ``advantages``, ``value``, ``returns``)."""
    return ppo_loss(
        dist.log_prob(minibatch["raw_action"]),
        minibatch["log_prob"],
        minibatch["advantages"],
        value,
        minibatch["value"],
        minibatch["returns"],
        dist.entropy(),
        clip_eps=hp.clip_eps,
        value_clip_eps=hp.value_clip_eps,
        value_coef=hp.value_coef,
        entropy_coef=hp.entropy_coef,
        normalize_advantage=normalize_advantage,
    )


def episode_statistics(episode_done: jax.Array, episode_return: jax.Array, episode_length: jax.Array) -> dict[str, jax.Array]:
    """Mean return and length of the episodes that ended in a rollout (``nan`` when none did),
    and their count."""
    count = episode_done.sum()
    denominator = jnp.maximum(count, 1)
    mean_or_nan = lambda x: jnp.where(count > 0, (x * episode_done).sum() / denominator, jnp.nan)  # noqa: E731
    return {
        "episode_return": mean_or_nan(episode_return.astype(jnp.float32)),
        "episode_length": mean_or_nan(episode_length.astype(jnp.float32)),
        "episodes": count,
    }


def make_policy(config: PPOConfig, env, env_params) -> ActorCritic:
    """The actor-critic for ``env``'s action space with ``config.policy``'s shape."""
    return ActorCritic(action_head(env.action_space(env_params), config.policy), config.policy)


def make_train(
    config: PPOConfig,
    env,
    env_params,
    *,
    on_update: Callable[[Any], None] | None = None,
) -> Callable[..., dict[str, Any]]:
    """Wires PPO into one function ``train(rng, hyperparams=None) -> result``.

    Args:
      config: the run's settings; its float hyperparameters are the defaults of ``train``.
      env: an Ember environment (single agent); episode statistics come from wrapping it in
        ``LogWrapper`` here (so they report raw rewards), and ``config.normalize_rewards``
        scales the learner's rewards with ``ember.envs.wrappers.NormalizeReward``;
        ``config.normalize_observations`` normalises what the policy sees with
        ``NormalizeObservation`` (statistics shared over the batch of environments).
      env_params: its parameters.
      on_update: an optional host callback called after every update with that update's
        metrics (a dict of scalars, plus ``update``); used for progress bars. It runs through
        ``jax.debug.callback`` and does not change the computation.

    Returns:
      ``train(rng, hyperparams=None)`` returning ``{"params": ..., "obs_stats": ...,
      "metrics": {name: [num_updates]}}``: ``obs_stats`` is the final
      :class:`~ember.envs.wrappers.RunningMeanVar` of the observations (mean and var of shape
      ``obs_shape``) with ``normalize_observations``, otherwise ``None``; metrics are
      ``episode_return``, ``episode_length``, ``episodes`` (episodes finished in that
      update's rollout), ``loss``,
      ``policy_loss``, ``value_loss``, ``entropy``, ``clip_fraction``, ``approx_kl``.
      ``jax.jit``- and ``jax.vmap``-able (over ``rng`` and ``hyperparams``).
    """
    envs = BatchedEnv(LogWrapper(env), config.num_envs)  # episode statistics on raw rewards
    if config.normalize_rewards:
        envs = NormalizeReward(envs, gamma=config.gamma)
    if config.normalize_observations:  # outermost, so the statistics are env_state.stats
        envs = NormalizeObservation(envs)
    policy = make_policy(config, env, env_params)
    num_updates = config.num_updates

    def train(rng: jax.Array, hyperparams: PPOHyperparams | None = None) -> dict[str, Any]:
        hp = PPOHyperparams.from_config(config) if hyperparams is None else hyperparams
        rng, init_key, reset_key = jax.random.split(rng, 3)
        obs, env_state = envs.reset(reset_key, env_params)
        params = policy.init(init_key, obs)
        optimizer = make_optimizer(hp.learning_rate, hp.max_grad_norm, anneal_steps=config.anneal_steps)
        train_state = TrainState.create(apply_fn=policy.apply, params=params, tx=optimizer)

        def rollout_step(carry, key):
            params, env_state, obs = carry
            action_key, env_key = jax.random.split(key)
            dist, value = policy.apply(params, obs)
            raw_action = dist.sample(action_key)
            next_obs, env_state, reward, terminated, truncated, info = envs.step(
                env_key, env_state, dist.env_action(raw_action), env_params
            )
            transition = Transition(
                obs=obs,
                raw_action=raw_action,
                log_prob=dist.log_prob(raw_action),
                value=value,
                reward=reward.astype(jnp.float32),
                terminated=terminated,
                truncated=truncated,
                final_obs=info["final_observation"],
                episode_done=info["returned_episode"],
                episode_return=info["returned_episode_returns"],
                episode_length=info["returned_episode_lengths"],
            )
            return (params, env_state, next_obs), transition

        def loss_fn(params, minibatch):
            dist, value = policy.apply(params, minibatch["obs"])
            return minibatch_loss(dist, value, minibatch, hp, normalize_advantage=config.normalize_advantage)

        def update(carry, update_index):
            train_state, env_state, obs, rng = carry
            rng, rollout_key, epochs_key = jax.random.split(rng, 3)
            (_, env_state, obs), rollout = jax.lax.scan(
                rollout_step, (train_state.params, env_state, obs), jax.random.split(rollout_key, config.num_steps)
            )
            next_values = policy.apply(train_state.params, rollout.final_obs, method="value")
            advantages, returns = gae_advantages(
                rollout.reward,
                rollout.value,
                next_values,
                rollout.terminated,
                rollout.truncated,
                gamma=hp.gamma,
                gae_lambda=hp.gae_lambda,
            )
            batch = {
                "obs": rollout.obs,
                "raw_action": rollout.raw_action,
                "log_prob": rollout.log_prob,
                "value": rollout.value,
                "advantages": advantages,
                "returns": returns,
            }
            batch = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batch)  # [T * N, ...]
            train_state, losses = minibatch_epochs(
                train_state,
                batch,
                loss_fn,
                epochs_key,
                num_epochs=config.update_epochs,
                num_minibatches=config.num_minibatches,
            )
            metrics = {
                **episode_statistics(rollout.episode_done, rollout.episode_return, rollout.episode_length),
                **losses,
            }
            if on_update is not None:
                jax.debug.callback(on_update, {"update": update_index, **metrics})
            return (train_state, env_state, obs, rng), metrics

        (train_state, env_state, *_), metrics = jax.lax.scan(
            update, (train_state, env_state, obs, rng), jnp.arange(num_updates)
        )
        obs_stats = env_state.stats if config.normalize_observations else None
        return {"params": train_state.params, "obs_stats": obs_stats, "metrics": metrics}

    return train


def make_act(
    policy: ActorCritic, params: Any, *, deterministic: bool = True, obs_stats: RunningMeanVar | None = None
) -> Callable[[Any, jax.Array], jax.Array]:
    """``act(obs, key) -> env_action`` of a trained policy: the distribution's mode when
    ``deterministic``, otherwise a sample (for :func:`ember.training.rl.evaluate.evaluate`).
    A policy trained with ``normalize_observations`` needs the run's ``obs_stats``: raw
    observations ``[batch, *obs_shape]`` are normalised with them, frozen (never updated)."""

    def act(obs, key):
        if obs_stats is not None:
            obs = obs_stats.normalize(obs)
        dist = policy.apply(params, obs, method=lambda module, x: module.actor(x))
        raw = dist.mode() if deterministic else dist.sample(key)
        return dist.env_action(raw)

    return act


__all__ = [
    "PPOConfig",
    "PPOHyperparams",
    "Transition",
    "episode_statistics",
    "make_act",
    "make_optimizer",
    "make_policy",
    "make_train",
    "minibatch_epochs",
    "minibatch_loss",
]

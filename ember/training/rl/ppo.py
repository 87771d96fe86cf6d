"""PPO: the whole run is one jittable ``train(rng)``; :func:`make_train` for single-agent
environments, and the one loop (:func:`make_ppo_train`) that IPPO/MAPPO
(:mod:`.multi_agent_ppo`) run too, through an :class:`AgentView`.

    env, env_params = ember.envs.make("CartPole-v1")
    train = jax.jit(make_train(PPOConfig(), env, env_params))
    result = train(jax.random.key(0))                       # one run
    results = jax.jit(jax.vmap(make_train(...)))(keys)      # one run per seed, in parallel

``train(rng, hyperparams=None)`` takes the float hyperparameters (:class:`PPOHyperparams`)
as traced values, so ``jax.vmap`` runs a sweep over learning rates, clip ranges, ... in one
compiled program. Shapes (``num_envs``, ``num_steps``, minibatches, epochs) are static.

The math lives in :mod:`.gae`, :mod:`.losses` and :mod:`.optimization`; this module only
wires it together:
rollout of ``num_steps`` in ``num_envs`` auto-resetting environments -> values of the
observations and of ``info["final_observation"]`` -> GAE -> ``update_epochs`` passes of
``num_minibatches`` shuffled minibatches of the PPO loss (with a gradient-norm clip and an
optionally annealed Adam learning rate).

With ``normalize_observations`` the policy sees observations normalised by running
statistics shared over the ``num_envs`` environments (``NormalizeObservation``); ``train``
returns the final statistics as ``obs_stats`` and the trained policy is run with them frozen:
``make_act(policy, result["params"], obs_stats=result["obs_stats"])`` (IPPO/MAPPO: one set of
statistics for all agents and one for the global state, :mod:`.multi_agent_ppo`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from flax.training.train_state import TrainState

from ember.core.errors import ConfigError
from ember.envs.batched import BatchedEnv
from ember.envs.wrappers import LogWrapper, NormalizeObservation, NormalizeReward, RunningMeanVar
from ember.models.policies import ActorCritic, PolicyConfig, action_head
from ember.training.rl.agent_view import AgentView
from ember.training.rl.episode_stats import episode_statistics
from ember.training.rl.gae import gae_advantages
from ember.training.rl.losses import ppo_loss
from ember.training.rl.optimization import make_optimizer, minibatch_epochs
from ember.training.rl.policy_act import PolicyAct


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """PPO settings (the ``ppo:`` section of an RL config). Defaults are PureJaxRL's CartPole.
    Invalid values raise ``ConfigError`` keyed by the field (``num_envs``)."""

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
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}", key=name)
        if self.num_updates < 1:
            raise ConfigError(
                f"total_timesteps ({self.total_timesteps}) must cover at least one rollout of "
                f"num_envs * num_steps = {self.num_envs * self.num_steps} steps",
                key="total_timesteps",
            )
        if (self.num_envs * self.num_steps) % self.num_minibatches:
            raise ConfigError(
                f"num_minibatches ({self.num_minibatches}) must divide num_envs * num_steps "
                f"= {self.num_envs * self.num_steps}",
                key="num_minibatches",
            )
        for name in ("gamma", "gae_lambda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must lie in [0, 1], got {getattr(self, name)}", key=name)
        for name in ("learning_rate", "clip_eps", "value_clip_eps", "max_grad_norm"):  # value_clip_eps may be None
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be positive, got {value}", key=name)
        if not self.value_coef >= 0:  # a negative weight climbs the value error: the critic diverges
            raise ConfigError(f"value_coef must be >= 0, got {self.value_coef}", key="value_coef")

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
    """One rollout step of ``num_envs`` environments (time-major once scanned: ``[T, N, ...]``;
    a multi-agent rollout adds an agent axis after ``N`` to every field but the episode ones)."""

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
    legal_actions: jax.Array | None = None


def minibatch_loss(
    dist, value: jax.Array, minibatch: dict[str, jax.Array], hp: PPOHyperparams, *, normalize_advantage: bool
):
    """:func:`ppo_loss` of a policy's ``dist``/``value`` on a rollout ``minibatch`` (keys
    ``raw_action``, ``log_prob``, ``advantages``, ``value``, ``returns``, and
    ``legal_actions`` where the actions were taken under masks: the log-probabilities and
    the entropy are then those of the distribution restricted to the same legal actions)."""
    if "legal_actions" in minibatch:
        dist = dist.restricted(minibatch["legal_actions"])
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
    policy = make_policy(config, env, env_params)
    return make_ppo_train(config, env, env_params, policy, AgentView(), on_update=on_update)


def learner_envs(config: PPOConfig, env, gamma: jax.Array | float):
    """``env`` batched ``config.num_envs`` times as the learner sees it: ``LogWrapper`` inside
    (episode statistics on raw rewards), then ``NormalizeReward`` with the run's ``gamma`` (a
    traced hyperparameter: a swept gamma discounts the normalising return too) and, outermost,
    ``NormalizeObservation`` (so the statistics are ``env_state.stats``), as the config asks."""
    envs = BatchedEnv(LogWrapper(env), config.num_envs)
    if config.normalize_rewards:
        envs = NormalizeReward(envs, gamma=gamma)
    if config.normalize_observations:
        envs = NormalizeObservation(envs)
    return envs


def make_ppo_train(
    config: PPOConfig,
    env,
    env_params,
    policy: nn.Module,
    view: AgentView,
    *,
    on_update: Callable[[Any], None] | None = None,
) -> Callable[..., dict[str, Any]]:
    """PPO's loop for ``policy`` (``apply(params, *inputs) -> (dist, value)`` and a ``value``
    method) on ``env`` seen through ``view``: what :func:`make_train` returns for one agent and
    :func:`.multi_agent_ppo.make_train` for many. Each update: a rollout of ``num_steps`` in
    ``num_envs`` environments -> values of ``info["final_observation"]`` -> GAE ->
    ``update_epochs`` passes of ``num_minibatches`` minibatches of the PPO loss."""
    num_updates = config.num_updates

    def train(rng: jax.Array, hyperparams: PPOHyperparams | None = None) -> dict[str, Any]:
        hp = PPOHyperparams.from_config(config) if hyperparams is None else hyperparams
        envs = learner_envs(config, env, hp.gamma)
        rng, init_key, reset_key = jax.random.split(rng, 3)
        env_obs, env_state = envs.reset(reset_key, env_params)
        obs = view.observation(env_obs, envs, env_state, env_params)
        params = policy.init(init_key, *view.policy_inputs(obs))
        optimizer = make_optimizer(hp.learning_rate, hp.max_grad_norm, anneal_steps=config.anneal_steps)
        train_state = TrainState.create(apply_fn=policy.apply, params=params, tx=optimizer)

        def rollout_step(carry, key):
            params, env_state, obs = carry
            action_key, env_key = jax.random.split(key)
            dist, value = policy.apply(params, *view.policy_inputs(obs))
            legal_actions = None
            if view.legal_actions is not None:  # the masks of env_state, the state obs belongs to
                legal_actions = view.legal_actions(envs, env_state, env_params)
                dist = dist.restricted(legal_actions)
            raw_action = dist.sample(action_key)
            next_obs, env_state, reward, terminated, truncated, info = envs.step(
                env_key, env_state, view.env_action(dist.env_action(raw_action)), env_params
            )
            reward, terminated, truncated = view.step_arrays(reward, terminated, truncated)
            transition = Transition(
                obs=obs,
                raw_action=raw_action,
                log_prob=dist.log_prob(raw_action),
                value=value,
                reward=reward,
                terminated=terminated,
                truncated=truncated,
                final_obs=view.final_observation(info),
                episode_done=info["returned_episode"],
                episode_return=info["returned_episode_returns"],
                episode_length=info["returned_episode_lengths"],
                legal_actions=legal_actions,
            )
            return (params, env_state, view.observation(next_obs, envs, env_state, env_params)), transition

        def loss_fn(params, minibatch):
            dist, value = policy.apply(params, *minibatch["inputs"])
            return minibatch_loss(dist, value, minibatch, hp, normalize_advantage=config.normalize_advantage)

        def update(carry, update_index):
            train_state, env_state, obs, rng = carry
            rng, rollout_key, epochs_key = jax.random.split(rng, 3)
            (_, env_state, obs), rollout = jax.lax.scan(
                rollout_step, (train_state.params, env_state, obs), jax.random.split(rollout_key, config.num_steps)
            )
            next_values = policy.apply(train_state.params, *view.value_inputs(rollout.final_obs), method="value")
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
                "inputs": view.policy_inputs(rollout.obs),
                "raw_action": rollout.raw_action,
                "log_prob": rollout.log_prob,
                "value": rollout.value,
                "advantages": advantages,
                "returns": returns,
            }
            if view.legal_actions is not None:
                batch["legal_actions"] = rollout.legal_actions
            leading = rollout.reward.ndim  # [T, N] or [T, N, agents]: one sample per element
            batch = jax.tree.map(lambda x: x.reshape(-1, *x.shape[leading:]), batch)
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
) -> PolicyAct:
    """``act(obs, key) -> env_action`` of a trained policy: the distribution's mode when
    ``deterministic``, otherwise a sample (for :func:`ember.training.rl.evaluate.evaluate`,
    compiled once for all ``params`` of one ``policy``: a :class:`.PolicyAct`).
    A policy trained with ``normalize_observations`` needs the run's ``obs_stats``: raw
    observations ``[batch, *obs_shape]`` are normalised with them, frozen (never updated)."""
    return PolicyAct(policy, params, obs_stats, deterministic=deterministic)


__all__ = [
    "PPOConfig",
    "PPOHyperparams",
    "Transition",
    "make_act",
    "make_policy",
    "make_ppo_train",
    "make_train",
    "minibatch_loss",
]

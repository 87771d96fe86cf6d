"""PQN (Gallici et al., 2024, "Simplifying Deep Temporal Difference Learning"): Q-learning
over many vectorised environments with no replay buffer and no target network, stabilised
by LayerNorm in the Q-network and trained on Q(lambda) returns; one jittable ``train(rng)``,
vmappable over seeds and hyperparameters like PPO.

Each update steps ``num_envs`` auto-resetting environments ``num_steps`` times with an
epsilon-greedy policy (epsilon decays linearly over ``exploration_fraction`` of the run),
computes :func:`q_lambda_returns` with the Q-network of that moment, and takes ``num_epochs``
passes of ``num_minibatches`` gradient steps on the squared error between ``Q(s_t, a_t)`` and
the return (RAdam, clipped gradients, the learning rate annealed linearly to zero if asked).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from ember.core.errors import ConfigError
from ember.envs.batched import BatchedEnv
from ember.envs.wrappers import LogWrapper
from ember.models.policies import PolicyConfig
from ember.training.rl.dqn import epsilon_greedy, make_q_network
from ember.training.rl.episode_stats import episode_statistics


@dataclasses.dataclass(frozen=True)
class PQNConfig:
    """PQN settings (the ``pqn:`` section of an RL config).

    Attributes:
      num_envs, num_steps: environments and steps per rollout (one update each).
      total_timesteps: env steps in the run.
      gamma, lam: discount and the lambda of the Q(lambda) returns.
      reward_scale: rewards are multiplied by it for learning (not in the logged returns).
      num_epochs, num_minibatches: passes over a rollout, and minibatches per pass.
      epsilon_start, epsilon_end, exploration_fraction: the linear epsilon schedule.
      anneal_lr: decay the learning rate linearly to zero over the run.
      policy: the Q-network (LayerNorm on by default, as the paper's).
    """

    num_envs: int = 32
    num_steps: int = 64
    total_timesteps: int = 200_000
    learning_rate: float = 2.5e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    lam: float = 0.95
    reward_scale: float = 0.1
    num_epochs: int = 4
    num_minibatches: int = 16
    epsilon_start: float = 1.0
    epsilon_end: float = 0.05
    exploration_fraction: float = 0.2
    max_grad_norm: float = 10.0
    policy: PolicyConfig = dataclasses.field(
        default_factory=lambda: PolicyConfig(hidden_sizes=(128, 128), activation="relu", layer_norm=True)
    )

    def __post_init__(self):
        for name in ("num_envs", "num_steps", "num_epochs", "num_minibatches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}", key=name)
        if (self.num_envs * self.num_steps) % self.num_minibatches:
            raise ConfigError(
                f"num_minibatches ({self.num_minibatches}) must divide num_envs * num_steps "
                f"({self.num_envs * self.num_steps})",
                key="num_minibatches",
            )
        if self.num_updates < 1:
            raise ConfigError(
                f"total_timesteps ({self.total_timesteps}) must cover one rollout of num_envs * num_steps "
                f"= {self.num_envs * self.num_steps} env steps",
                key="total_timesteps",
            )
        for name in ("gamma", "lam", "epsilon_start", "epsilon_end", "exploration_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must lie in [0, 1], got {getattr(self, name)}", key=name)
        for name in ("learning_rate", "max_grad_norm", "reward_scale"):  # reward_scale <= 0 erases or flips rewards
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}", key=name)

    @property
    def num_updates(self) -> int:
        """Rollouts (and metrics records) in the run."""
        return self.total_timesteps // (self.num_envs * self.num_steps)


def q_lambda_returns(
    rewards: jax.Array,
    next_values: jax.Array,
    terminated: jax.Array,
    done: jax.Array,
    *,
    gamma: float,
    lam: float,
) -> jax.Array:
    """Q(lambda) returns ``[T, batch]`` of an auto-resetting rollout.

    ``next_values[t] = max_a Q(s'_t, a)`` for ``s'_t`` the observation step ``t`` reached
    before any reset (``info["final_observation"]``); ``terminated`` ends without a bootstrap,
    ``done = terminated | truncated`` stops the recursion (step ``t + 1`` starts a new episode)::

        G_t = r_t + gamma (1 - terminated_t) [ (1 - done_t) (lam G_{t+1} + (1 - lam) V'_t) + done_t V'_t ]

    and the last step bootstraps ``G_T = r_T + gamma (1 - terminated_T) V'_T``.
    """
    continuing = (1.0 - done.astype(jnp.float32)) * lam
    alive = 1.0 - terminated.astype(jnp.float32)

    def backward(next_return, inputs):
        reward, value, keep, live = inputs
        blended = keep * next_return + (1.0 - keep) * value
        g = reward + gamma * live * blended
        return g, g

    last = rewards[-1] + gamma * alive[-1] * next_values[-1]
    inputs = (rewards[:-1], next_values[:-1], continuing[:-1], alive[:-1])
    _, returns = jax.lax.scan(backward, last, inputs, reverse=True)
    return jnp.concatenate([returns, last[None]], axis=0)


def make_train(
    config: PQNConfig, env, env_params, *, on_update: Callable[[Any], None] | None = None
) -> Callable[[jax.Array], dict[str, Any]]:
    """``train(rng) -> {"params", "metrics": {name: [num_updates]}}`` (metrics:
    ``episode_return``, ``episode_length``, ``episodes``, ``loss``, ``q_mean``, ``epsilon``);
    ``on_update`` is a host callback after every update, as in :func:`.ppo.make_train`."""
    envs = BatchedEnv(LogWrapper(env), config.num_envs)
    network = make_q_network(config, env, env_params, algo="PQN")
    steps = config.num_updates * config.num_steps
    epsilon = optax.linear_schedule(
        config.epsilon_start, config.epsilon_end, max(1, int(config.exploration_fraction * steps))
    )
    gradient_steps = config.num_updates * config.num_epochs * config.num_minibatches
    lr = optax.linear_schedule(config.learning_rate, 0.0, gradient_steps) if config.anneal_lr else config.learning_rate
    batch = config.num_envs * config.num_steps

    def loss_fn(params, minibatch):
        q = network.apply(params, minibatch["obs"])
        chosen = jnp.take_along_axis(q, minibatch["action"][:, None], axis=-1)[:, 0]
        return 0.5 * jnp.mean(jnp.square(chosen - minibatch["target"])), jnp.mean(chosen)

    def train(rng: jax.Array) -> dict[str, Any]:
        rng, init_key, reset_key = jax.random.split(rng, 3)
        obs, env_state = envs.reset(reset_key, env_params)
        params = network.init(init_key, obs)
        optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.radam(lr))
        train_state = TrainState.create(apply_fn=network.apply, params=params, tx=optimizer)

        def rollout_step(carry, t):
            params, env_state, obs, rng = carry
            rng, act_key, env_key = jax.random.split(rng, 3)
            action = epsilon_greedy(act_key, network.apply(params, obs), epsilon(t))
            next_obs, env_state, reward, terminated, truncated, info = envs.step(env_key, env_state, action, env_params)
            transition = {
                "obs": obs,
                "action": action,
                "reward": reward.astype(jnp.float32) * config.reward_scale,
                "terminated": terminated,
                "done": terminated | truncated,
                "final_obs": info["final_observation"],
                "episode_done": info["returned_episode"],
                "episode_return": info["returned_episode_returns"],
                "episode_length": info["returned_episode_lengths"],
            }
            return (params, env_state, next_obs, rng), transition

        def minibatch_step(train_state, minibatch):
            (loss, q_mean), grads = jax.value_and_grad(loss_fn, has_aux=True)(train_state.params, minibatch)
            return train_state.apply_gradients(grads=grads), (loss, q_mean)

        def epoch(carry, _):
            train_state, data, rng = carry
            rng, key = jax.random.split(rng)
            order = jax.random.permutation(key, batch)
            shuffled = jax.tree.map(lambda x: x[order].reshape(config.num_minibatches, -1, *x.shape[1:]), data)
            train_state, (loss, q_mean) = jax.lax.scan(minibatch_step, train_state, shuffled)
            return (train_state, data, rng), (loss, q_mean)

        def update(carry, update_index):
            train_state, env_state, obs, rng = carry
            times = update_index * config.num_steps + jnp.arange(config.num_steps)
            (_, env_state, obs, rng), traj = jax.lax.scan(
                rollout_step, (train_state.params, env_state, obs, rng), times
            )
            next_values = jnp.max(network.apply(train_state.params, traj["final_obs"]), axis=-1)
            targets = q_lambda_returns(
                traj["reward"], next_values, traj["terminated"], traj["done"], gamma=config.gamma, lam=config.lam
            )
            data = {
                "obs": jax.tree.map(lambda x: x.reshape(batch, *x.shape[2:]), traj["obs"]),
                "action": traj["action"].reshape(batch),
                "target": jax.lax.stop_gradient(targets).reshape(batch),
            }
            (train_state, _, rng), (loss, q_mean) = jax.lax.scan(
                epoch, (train_state, data, rng), None, length=config.num_epochs
            )
            metrics = {
                **episode_statistics(traj["episode_done"], traj["episode_return"], traj["episode_length"]),
                "loss": jnp.mean(loss),
                "q_mean": jnp.mean(q_mean),
                "epsilon": epsilon(times[-1]),
            }
            if on_update is not None:
                jax.debug.callback(on_update, {"update": update_index, **metrics})
            return (train_state, env_state, obs, rng), metrics

        carry = (train_state, env_state, obs, rng)
        (train_state, *_), metrics = jax.lax.scan(update, carry, jnp.arange(config.num_updates))
        return {"params": train_state.params, "metrics": metrics}

    return train


__all__ = ["PQNConfig", "make_train", "q_lambda_returns"]

"""DQN (Mnih et al., 2015) with a target network and an on-device replay buffer: the whole
run is one jittable ``train(rng)``, vmappable over seeds.

Each iteration steps ``num_envs`` environments once with an epsilon-greedy policy (epsilon
decays linearly over ``exploration_fraction`` of the run), stores the transitions (the next
observation is ``info["final_observation"]``, so truncated steps bootstrap and terminated
ones do not), and, once ``learning_starts`` env steps are stored, takes one gradient step
on a uniformly sampled batch. The target network is refreshed every
``target_update_every`` iterations (Polyak-averaged when ``tau < 1``). Targets and loss are
:func:`.losses.q_learning_targets` and :func:`.losses.q_learning_loss`.
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

from ember.core.errors import ConfigError
from ember.envs.batched import BatchedEnv
from ember.envs.wrappers import LogWrapper
from ember.models.policies import PolicyConfig, QNetwork
from ember.training.rl.episode_stats import episode_statistics
from ember.training.rl.losses import q_learning_loss, q_learning_targets
from ember.training.rl.replay_buffer import replay_buffer_add, replay_buffer_init, replay_buffer_sample


@dataclasses.dataclass(frozen=True)
class DQNConfig:
    """DQN settings (the ``dqn:`` section of an RL config).

    Attributes:
      num_envs: environments stepped per iteration.
      total_timesteps: env steps in the run (``num_envs`` per iteration).
      buffer_size, batch_size: replay capacity (transitions) and sampled batch.
      learning_starts: env steps collected before the first gradient step.
      target_update_every: iterations between target-network updates; ``tau`` is the
        Polyak weight of the online network (1 copies it).
      epsilon_start, epsilon_end, exploration_fraction: the linear epsilon schedule.
      double_q: choose next actions with the online network (double DQN).
      huber_delta: Huber loss delta, or ``None`` for the squared error.
      log_every: iterations per metrics record.
    """

    num_envs: int = 8
    total_timesteps: int = 100_000
    buffer_size: int = 10_000
    batch_size: int = 64
    learning_rate: float = 2.5e-4
    gamma: float = 0.99
    learning_starts: int = 1_000
    target_update_every: int = 100
    tau: float = 1.0
    epsilon_start: float = 1.0
    epsilon_end: float = 0.05
    exploration_fraction: float = 0.5
    max_grad_norm: float = 10.0
    double_q: bool = True
    huber_delta: float | None = None
    log_every: int = 50
    policy: PolicyConfig = dataclasses.field(default_factory=lambda: PolicyConfig(activation="relu"))

    def __post_init__(self):
        for name in ("num_envs", "total_timesteps", "buffer_size", "batch_size", "target_update_every", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}", key=name)
        if self.num_envs > self.buffer_size:
            raise ConfigError(
                f"buffer_size ({self.buffer_size}) must hold at least num_envs ({self.num_envs}) transitions",
                key="buffer_size",
            )
        if not 0 <= self.learning_starts <= self.buffer_size:
            raise ConfigError(
                f"learning_starts ({self.learning_starts}) must lie in [0, buffer_size={self.buffer_size}]",
                key="learning_starts",
            )
        if self.num_updates < 1:
            raise ConfigError(
                f"total_timesteps ({self.total_timesteps}) must cover at least log_every * num_envs "
                f"= {self.log_every * self.num_envs} env steps",
                key="total_timesteps",
            )
        iterations = self.num_updates * self.log_every
        if self.learning_starts >= iterations * self.num_envs:
            raise ConfigError(
                f"learning_starts ({self.learning_starts}) must be below the run's {iterations * self.num_envs} env "
                "steps (total_timesteps rounded down to whole log_every * num_envs records): the run would take no "
                "gradient step",
                key="learning_starts",
            )
        if self.target_update_every > iterations:
            raise ConfigError(
                f"target_update_every ({self.target_update_every}) must be at most the run's {iterations} iterations: "
                "the target network would never be updated",
                key="target_update_every",
            )
        for name in ("gamma", "epsilon_start", "epsilon_end", "exploration_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must lie in [0, 1], got {getattr(self, name)}", key=name)
        if not 0.0 < self.tau <= 1.0:  # 0 would never move the target network off its initialisation
            raise ConfigError(f"tau must lie in (0, 1], got {self.tau}", key="tau")
        for name in ("learning_rate", "max_grad_norm", "huber_delta"):  # huber_delta may be None
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be positive, got {value}", key=name)

    @property
    def num_updates(self) -> int:
        """Metrics records in the run (each covers ``log_every`` iterations)."""
        return self.total_timesteps // (self.num_envs * self.log_every)


def epsilon_schedule(config: DQNConfig) -> optax.Schedule:
    """Epsilon as a function of the iteration: linear from start to end over
    ``exploration_fraction`` of the run, then constant."""
    iterations = config.num_updates * config.log_every
    return optax.linear_schedule(
        config.epsilon_start, config.epsilon_end, max(1, int(config.exploration_fraction * iterations))
    )


def epsilon_greedy(key: jax.Array, q_values: jax.Array, epsilon: jax.Array) -> jax.Array:
    """``[batch]`` actions: argmax of ``q_values [batch, actions]``, or a uniform action with
    probability ``epsilon``."""
    explore_key, action_key = jax.random.split(key)
    random_actions = jax.random.randint(action_key, q_values.shape[:-1], 0, q_values.shape[-1])
    explore = jax.random.uniform(explore_key, q_values.shape[:-1]) < epsilon
    return jnp.where(explore, random_actions, q_values.argmax(-1)).astype(jnp.int32)


def make_q_network(config: Any, env, env_params, *, algo: str = "DQN") -> QNetwork:
    """The Q-network ``config.policy`` describes for ``env``'s discrete actions (DQN, PQN)."""
    space = env.action_space(env_params)
    if not hasattr(space, "n"):
        raise ConfigError(f"{algo} needs a discrete action space, got {space!r}", key="algo")
    if getattr(space, "start", 0) != 0:  # the argmax is an index 0 .. n - 1, which the env would clip
        raise ConfigError(
            f"{algo} needs discrete actions 0 .. n - 1 (start 0), got {space!r}; wrap the environment to shift "
            "its actions to start at 0",
            key="algo",
        )
    return QNetwork(int(space.n), config.policy)


def make_train(
    config: DQNConfig, env, env_params, *, on_update: Callable[[Any], None] | None = None
) -> Callable[[jax.Array], dict[str, Any]]:
    """``train(rng) -> {"params", "metrics": {name: [num_updates]}}`` (metrics:
    ``episode_return``, ``episode_length``, ``episodes``, ``loss``, ``epsilon``). ``on_update``
    is a host callback after every metrics record, as in :func:`.ppo.make_train`."""
    envs = BatchedEnv(LogWrapper(env), config.num_envs)
    network = make_q_network(config, env, env_params)
    epsilon = epsilon_schedule(config)
    learning_starts = config.learning_starts

    def train(rng: jax.Array) -> dict[str, Any]:
        rng, init_key, reset_key = jax.random.split(rng, 3)
        obs, env_state = envs.reset(reset_key, env_params)
        params = network.init(init_key, obs)
        optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(config.learning_rate))
        train_state = TrainState.create(apply_fn=network.apply, params=params, tx=optimizer)
        one = jax.tree.map(lambda x: x[0], obs)
        example = {"obs": one, "action": jnp.int32(0), "reward": jnp.float32(0), "next_obs": one, "terminated": False}
        buffer = replay_buffer_init(example, config.buffer_size)

        def loss_fn(params, target_params, batch):
            next_target = network.apply(target_params, batch["next_obs"])
            next_online = network.apply(params, batch["next_obs"]) if config.double_q else None
            targets = q_learning_targets(
                batch["reward"], next_target, batch["terminated"], gamma=config.gamma, double_q_next=next_online
            )
            return q_learning_loss(
                network.apply(params, batch["obs"]), batch["action"], targets, huber_delta=config.huber_delta
            )

        def iteration(carry, index):
            train_state, target_params, buffer, env_state, obs, rng = carry
            rng, act_key, env_key, sample_key = jax.random.split(rng, 4)
            current_epsilon = epsilon(index)
            action = epsilon_greedy(act_key, network.apply(train_state.params, obs), current_epsilon)
            next_obs, env_state, reward, terminated, _, info = envs.step(env_key, env_state, action, env_params)
            buffer = replay_buffer_add(
                buffer,
                {
                    "obs": obs,
                    "action": action,
                    "reward": reward.astype(jnp.float32),
                    "next_obs": info["final_observation"],
                    "terminated": terminated,
                },
            )

            def learn(train_state):
                batch = replay_buffer_sample(buffer, sample_key, config.batch_size)
                loss, grads = jax.value_and_grad(loss_fn)(train_state.params, target_params, batch)
                return train_state.apply_gradients(grads=grads), loss

            ready = buffer.size >= learning_starts
            train_state, loss = jax.lax.cond(ready, learn, lambda s: (s, jnp.float32(jnp.nan)), train_state)
            refresh = ready & ((index + 1) % config.target_update_every == 0)
            target_params = jax.lax.cond(
                refresh,
                lambda: optax.incremental_update(train_state.params, target_params, config.tau),
                lambda: target_params,
            )
            stats = {
                "done": info["returned_episode"],
                "return": info["returned_episode_returns"],
                "length": info["returned_episode_lengths"],
                "loss": loss,
            }
            return (train_state, target_params, buffer, env_state, next_obs, rng), stats

        def update(carry, update_index):
            indices = update_index * config.log_every + jnp.arange(config.log_every)
            carry, stats = jax.lax.scan(iteration, carry, indices)
            metrics = {
                **episode_statistics(stats["done"], stats["return"], stats["length"]),
                "loss": jnp.nanmean(stats["loss"]),
                "epsilon": epsilon(indices[-1]),
            }
            if on_update is not None:
                jax.debug.callback(on_update, {"update": update_index, **metrics})
            return carry, metrics

        carry = (train_state, params, buffer, env_state, obs, rng)
        (train_state, *_), metrics = jax.lax.scan(update, carry, jnp.arange(config.num_updates))
        return {"params": train_state.params, "metrics": metrics}

    return train


@struct.dataclass
class EpsilonGreedyAct:
    """``act(obs, key) -> actions`` of a Q-network, a pytree for
    :func:`ember.training.rl.evaluate.evaluate` (``network`` static; ``params`` and
    ``epsilon``, a float32 scalar, its leaves: one compiled evaluation for every value of them).
    Observations ``[N, *obs_shape]`` -> int32 actions ``[N]`` (:func:`epsilon_greedy`)."""

    network: QNetwork = struct.field(pytree_node=False)
    params: Any
    epsilon: jax.Array

    def __call__(self, obs: jax.Array, key: jax.Array) -> jax.Array:
        """Int32 actions ``[N]`` for observations ``[N, *obs_shape]``."""
        return epsilon_greedy(key, self.network.apply(self.params, obs), self.epsilon)


def make_act(network: QNetwork, params: Any, *, epsilon: float = 0.0) -> EpsilonGreedyAct:
    """``act(obs, key) -> actions``: greedy, or epsilon-greedy with ``epsilon > 0``."""
    return EpsilonGreedyAct(network, params, jnp.float32(epsilon))


__all__ = [
    "DQNConfig",
    "EpsilonGreedyAct",
    "epsilon_greedy",
    "epsilon_schedule",
    "make_act",
    "make_q_network",
    "make_train",
]

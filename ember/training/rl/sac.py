"""SAC (Haarnoja et al., 2018, "Soft Actor-Critic Algorithms and Applications") for continuous
actions: a tanh-squashed Gaussian actor, twin Q-critics with Polyak-averaged targets, and the
entropy temperature tuned toward ``-action_dim``; an on-device replay buffer; the whole run is
one jittable ``train(rng)``, vmappable over seeds like PPO and DQN.

Each iteration steps ``num_envs`` environments once (uniform random actions until
``learning_starts`` env steps are stored, then the actor's samples), stores the transitions
(the next observation is ``info["final_observation"]``: truncated steps bootstrap, terminated
ones do not) and takes ``updates_per_step`` gradient steps of critic, actor and temperature
on uniformly sampled batches. The math is :func:`critic_loss`, :func:`actor_loss` and
:func:`temperature_loss`. The actor's samples may carry temporally correlated noise
(:func:`correlated_noise`); multi-agent environments train as ISAC, one actor and one pair of
critics shared by every agent (``make_train(..., agents=...)``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from ember.core.errors import ConfigError
from ember.envs.batched import BatchedEnv
from ember.envs.wrappers import LogWrapper
from ember.models.policies import ActionValue, Actor, BoxActions, PolicyConfig, action_head
from ember.training.rl.agent_view import AgentView, multi_agent_view, shared_action_head
from ember.training.rl.episode_stats import episode_statistics
from ember.training.rl.policy_act import PolicyAct
from ember.training.rl.replay_buffer import replay_buffer_add, replay_buffer_init, replay_buffer_sample


@dataclasses.dataclass(frozen=True)
class SACConfig:
    """SAC settings (the ``sac:`` section of an RL config).

    Attributes:
      num_envs: environments stepped per iteration.
      total_timesteps: env steps in the run (``num_envs`` per iteration).
      buffer_size, batch_size: replay capacity (transitions) and sampled batch.
      learning_starts: env steps of uniform random actions before learning starts.
      updates_per_step: gradient steps per iteration once learning.
      tau: Polyak weight of the online critics in the targets' update.
      init_temperature: the entropy temperature alpha at the start; ``target_entropy`` its goal
        (``None``: ``-action_dim``).
      reward_scale: rewards are multiplied by it for learning (not in the logged returns).
      noise_correlation: how much of each environment's exploration noise carries over to its
        next step, ``rho`` in ``eps_t = rho eps_{t-1} + sqrt(1 - rho^2) n_t`` (unit variance, so
        the policy's Gaussian is unchanged step by step). 0 is SAC's independent noise; near 1
        it drifts slowly, as temporally correlated (coloured) exploration noise does, which
        sparse-reward tasks such as MountainCarContinuous need (Eberhard et al., 2023).
      log_every: iterations per metrics record.
      policy: actor and critic networks (the actor's log-std is state-dependent, its actions
        tanh-squashed into the box, whatever ``policy.log_std`` / ``policy.squash`` say).
    """

    num_envs: int = 1
    total_timesteps: int = 20_000
    buffer_size: int = 100_000
    batch_size: int = 256
    learning_starts: int = 1_000
    updates_per_step: int = 1
    actor_lr: float = 3e-4
    critic_lr: float = 3e-4
    temperature_lr: float = 3e-4
    gamma: float = 0.99
    tau: float = 0.005
    init_temperature: float = 1.0
    target_entropy: float | None = None
    reward_scale: float = 1.0
    noise_correlation: float = 0.0
    log_every: int = 100
    policy: PolicyConfig = dataclasses.field(
        default_factory=lambda: PolicyConfig(hidden_sizes=(256, 256), activation="relu")
    )

    def __post_init__(self):
        for name in ("num_envs", "total_timesteps", "buffer_size", "batch_size", "updates_per_step", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}", key=name)
        if not self.num_envs <= self.learning_starts <= self.buffer_size:
            raise ConfigError(
                f"learning_starts ({self.learning_starts}) must lie in [num_envs={self.num_envs}, "
                f"buffer_size={self.buffer_size}]",
                key="learning_starts",
            )
        if self.num_updates < 1:
            raise ConfigError(
                f"total_timesteps ({self.total_timesteps}) must cover at least log_every * num_envs "
                f"= {self.log_every * self.num_envs} env steps",
                key="total_timesteps",
            )
        if not 0.0 <= self.gamma <= 1.0:
            raise ConfigError(f"gamma must lie in [0, 1], got {self.gamma}", key="gamma")
        if not 0.0 < self.tau <= 1.0:  # 0 would never move the target critics off their initialisation
            raise ConfigError(f"tau must lie in (0, 1], got {self.tau}", key="tau")
        if not 0.0 <= self.noise_correlation < 1.0:
            raise ConfigError(
                f"noise_correlation must lie in [0, 1), got {self.noise_correlation}", key="noise_correlation"
            )
        for name in ("actor_lr", "critic_lr", "temperature_lr", "init_temperature", "reward_scale"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}", key=name)

    @property
    def num_updates(self) -> int:
        """Metrics records in the run (each covers ``log_every`` iterations)."""
        return self.total_timesteps // (self.num_envs * self.log_every)


def critic_loss(q1: jax.Array, q2: jax.Array, targets: jax.Array) -> jax.Array:
    """Both critics' mean squared error against the soft targets ``[batch]``."""
    return jnp.mean(jnp.square(q1 - targets)) + jnp.mean(jnp.square(q2 - targets))


def soft_targets(
    rewards: jax.Array,
    terminated: jax.Array,
    next_q1: jax.Array,
    next_q2: jax.Array,
    next_log_prob: jax.Array,
    temperature: jax.Array,
    *,
    gamma: float,
) -> jax.Array:
    """``r + gamma (1 - terminated) (min(Q1', Q2') - alpha log pi(a'|s'))`` ``[batch]``, with
    ``a' ~ pi(s')`` and the target critics' values at it."""
    soft_value = jnp.minimum(next_q1, next_q2) - temperature * next_log_prob
    return rewards + gamma * (1.0 - terminated.astype(jnp.float32)) * soft_value


def actor_loss(log_prob: jax.Array, q1: jax.Array, q2: jax.Array, temperature: jax.Array) -> jax.Array:
    """``mean(alpha log pi(a|s) - min(Q1, Q2)(s, a))`` for reparameterised ``a ~ pi(s)``."""
    return jnp.mean(temperature * log_prob - jnp.minimum(q1, q2))


def temperature_loss(log_temperature: jax.Array, log_prob: jax.Array, target_entropy: float) -> jax.Array:
    """``-log(alpha) * mean(log pi + target_entropy)``: raises alpha while the policy's
    entropy is below the target, lowers it above."""
    return -log_temperature * jnp.mean(jax.lax.stop_gradient(log_prob) + target_entropy)


def correlated_noise(key: jax.Array, previous: jax.Array, rho: float) -> jax.Array:
    """The next draw of unit-variance AR(1) noise, ``rho * previous + sqrt(1 - rho^2) * n``
    with ``n ~ N(0, 1)`` of ``previous``'s shape ``[num_envs, action_dim]``. With ``rho = 0``
    it is ``jax.random.normal(key, ...)``, the draw ``Gaussian.sample(key)`` makes. A run
    starts from zeros, so the variance reaches 1 over the first ``~1 / (1 - rho)`` steps."""
    fresh = jax.random.normal(key, previous.shape, previous.dtype)
    return rho * previous + jnp.sqrt(1.0 - rho**2) * fresh


def make_actor(config: SACConfig, env, env_params, agents: list[str] | None = None) -> Actor:
    """The tanh-squashed Gaussian actor for ``env``'s Box actions; with ``agents``, one actor
    shared by all of them (which must have one observation shape and one action space)."""
    spaces = env.action_space(env_params)
    policy = dataclasses.replace(config.policy, squash="clip")  # SAC's squash is tanh, set below once bounds are known
    head = shared_action_head(env, env_params, policy) if agents else action_head(spaces, policy)
    if not isinstance(head, BoxActions):
        raise ConfigError(f"SAC needs a continuous (Box) action space, got {spaces!r}", key="algo")
    if not all(math.isfinite(bound) for bound in (*head.low, *head.high)):
        raise ConfigError(
            f"SAC squashes its actions with tanh into the action box, which needs finite bounds; got "
            f"low={head.low} high={head.high} (wrap the environment to rescale its actions from a bounded box)",
            key="algo",
        )
    return Actor(dataclasses.replace(head, log_std="state_dependent", squash="tanh"), config.policy)


def warm_replay_items(config: SACConfig, agents: list[str] | None = None) -> int:
    """Replay items stored before learning starts: ``learning_starts`` env steps of one item
    per agent (one without ``agents``).

    Raises:
      ConfigError: keyed ``learning_starts``, when those items overflow ``buffer_size`` (the
        buffer would never fill that far, and learning never start).
    """
    per_env_step = len(agents) if agents else 1
    items = config.learning_starts * per_env_step
    if items > config.buffer_size:
        raise ConfigError(
            f"learning_starts ({config.learning_starts} env steps of {per_env_step} replay items, one per agent) "
            f"must fit in buffer_size ({config.buffer_size} replay items)",
            key="learning_starts",
        )
    return items


def make_train(
    config: SACConfig,
    env,
    env_params,
    *,
    agents: list[str] | None = None,
    on_update: Callable[[Any], None] | None = None,
) -> Callable[[jax.Array], dict[str, Any]]:
    """``train(rng) -> {"params": actor params, "metrics": {name: [num_updates]}}`` (metrics:
    ``episode_return``, ``episode_length``, ``episodes``, ``critic_loss``, ``actor_loss``,
    ``temperature``, ``q_mean``); ``on_update`` as in :func:`.ppo.make_train`.

    With ``agents`` (a multi-agent environment's, JaxMARL's dict API) this is independent SAC
    with parameter sharing: one actor and one pair of critics for all agents, each agent's
    transition stored as one replay item (``num_envs * len(agents)`` per step), every agent's
    episode ending with ``"__all__"``; ``episode_return`` is the return per agent.
    ``learning_starts`` still counts env steps (:func:`warm_replay_items`).
    """
    warm_items = warm_replay_items(config, agents)
    envs = BatchedEnv(LogWrapper(env), config.num_envs)
    actor = make_actor(config, env, env_params, agents)
    view = multi_agent_view(agents, centralised_critic=False) if agents else AgentView()
    rows = (config.num_envs, len(agents)) if agents else (config.num_envs,)  # leading axes of every step array
    flat = lambda x: x.reshape(-1, *x.shape[len(rows) :])  # noqa: E731  [*rows, ...] -> [replay items, ...]
    critic = ActionValue(config.policy)
    action_dim = actor.action.action_dim
    target_entropy = -float(action_dim) if config.target_entropy is None else config.target_entropy
    low, high = jnp.asarray(actor.action.low), jnp.asarray(actor.action.high)

    def learn(state, batch, key):
        actor_state, critic_state, target_params, temperature_state = state
        temperature = jnp.exp(temperature_state.params["log_temperature"])
        next_key, actor_key = jax.random.split(key)
        next_dist = actor.apply(actor_state.params, batch["next_obs"])
        next_raw = next_dist.sample(next_key)
        next_action = next_dist.env_action(next_raw)
        targets = soft_targets(
            batch["reward"],
            batch["terminated"],
            critic.apply(target_params[0], batch["next_obs"], next_action),
            critic.apply(target_params[1], batch["next_obs"], next_action),
            next_dist.log_prob(next_raw),
            temperature,
            gamma=config.gamma,
        )
        targets = jax.lax.stop_gradient(targets)

        def critics_loss(params):
            q1 = critic.apply(params[0], batch["obs"], batch["action"])
            q2 = critic.apply(params[1], batch["obs"], batch["action"])
            return critic_loss(q1, q2, targets), jnp.mean(q1)

        (c_loss, q_mean), grads = jax.value_and_grad(critics_loss, has_aux=True)(critic_state.params)
        critic_state = critic_state.apply_gradients(grads=grads)

        def policy_loss(params):
            dist = actor.apply(params, batch["obs"])
            raw = dist.sample(actor_key)
            action = dist.env_action(raw)
            log_prob = dist.log_prob(raw)
            q1 = critic.apply(critic_state.params[0], batch["obs"], action)
            q2 = critic.apply(critic_state.params[1], batch["obs"], action)
            return actor_loss(log_prob, q1, q2, temperature), log_prob

        (a_loss, log_prob), grads = jax.value_and_grad(policy_loss, has_aux=True)(actor_state.params)
        actor_state = actor_state.apply_gradients(grads=grads)
        grads = jax.grad(lambda p: temperature_loss(p["log_temperature"], log_prob, target_entropy))(
            temperature_state.params
        )
        temperature_state = temperature_state.apply_gradients(grads=grads)
        target_params = optax.incremental_update(critic_state.params, target_params, config.tau)
        losses = {"critic_loss": c_loss, "actor_loss": a_loss, "q_mean": q_mean}
        return (actor_state, critic_state, target_params, temperature_state), losses

    def train(rng: jax.Array) -> dict[str, Any]:
        rng, actor_key, critic_key, reset_key = jax.random.split(rng, 4)
        env_obs, env_state = envs.reset(reset_key, env_params)
        obs = view.observe(env_obs)
        dummy_action = jnp.zeros((*rows, action_dim), jnp.float32)
        actor_state = TrainState.create(
            apply_fn=actor.apply, params=actor.init(actor_key, obs), tx=optax.adam(config.actor_lr)
        )
        critic_params = tuple(critic.init(k, obs, dummy_action) for k in jax.random.split(critic_key))
        critic_state = TrainState.create(apply_fn=critic.apply, params=critic_params, tx=optax.adam(config.critic_lr))
        temperature_state = TrainState.create(
            apply_fn=None,
            params={"log_temperature": jnp.log(jnp.float32(config.init_temperature))},
            tx=optax.adam(config.temperature_lr),
        )
        one = jax.tree.map(lambda x: flat(x)[0], obs)
        example = {
            "obs": one,
            "action": flat(dummy_action)[0],
            "reward": jnp.float32(0),
            "next_obs": one,
            "terminated": False,
        }
        buffer = replay_buffer_init(example, config.buffer_size)

        def iteration(carry, _):
            state, buffer, env_state, obs, noise, rng = carry
            rng, act_key, random_key, env_key, learn_key = jax.random.split(rng, 5)
            dist = actor.apply(state[0].params, obs)
            noise = correlated_noise(act_key, noise, config.noise_correlation)
            policy_action = dist.env_action(dist.mean + jnp.exp(dist.log_std) * noise)
            uniform = jax.random.uniform(random_key, policy_action.shape, minval=low, maxval=high)
            warm = buffer.size < warm_items
            action = jnp.where(warm, uniform, policy_action)
            env_action = view.env_action(action)
            next_obs, env_state, reward, terminated, truncated, info = envs.step(
                env_key, env_state, env_action, env_params
            )
            reward, terminated, _ = view.step_arrays(reward, terminated, truncated)
            transitions = {
                "obs": obs,
                "action": action,
                "reward": reward * config.reward_scale,
                "next_obs": view.observe(info["final_observation"]),
                "terminated": terminated,
            }
            buffer = replay_buffer_add(buffer, jax.tree.map(flat, transitions))

            def updates(state):
                def one_update(state, key):
                    sample_key, step_key = jax.random.split(key)
                    batch = replay_buffer_sample(buffer, sample_key, config.batch_size)
                    return learn(state, batch, step_key)

                keys = jax.random.split(learn_key, config.updates_per_step)
                state, losses = jax.lax.scan(one_update, state, keys)
                return state, jax.tree.map(jnp.mean, losses)

            nan = jnp.float32(jnp.nan)
            skipped = {"critic_loss": nan, "actor_loss": nan, "q_mean": nan}
            state, losses = jax.lax.cond(warm, lambda s: (s, skipped), updates, state)
            stats = {
                "done": info["returned_episode"],
                "return": info["returned_episode_returns"],
                "length": info["returned_episode_lengths"],
                **losses,
            }
            return (state, buffer, env_state, view.observe(next_obs), noise, rng), stats

        def update(carry, update_index):
            carry, stats = jax.lax.scan(iteration, carry, None, length=config.log_every)
            metrics = {
                **episode_statistics(stats["done"], stats["return"], stats["length"]),
                **{name: jnp.nanmean(stats[name]) for name in ("critic_loss", "actor_loss", "q_mean")},
                "temperature": jnp.exp(carry[0][3].params["log_temperature"]),
            }
            if on_update is not None:
                jax.debug.callback(on_update, {"update": update_index, **metrics})
            return carry, metrics

        state = (actor_state, critic_state, critic_params, temperature_state)
        carry = (state, buffer, env_state, obs, dummy_action, rng)
        (state, *_), metrics = jax.lax.scan(update, carry, jnp.arange(config.num_updates))
        return {"params": state[0].params, "metrics": metrics}

    return train


def make_act(actor: Actor, params: Any, *, deterministic: bool = True, agents: list[str] | None = None) -> PolicyAct:
    """``act(obs, key) -> environment actions``: the squashed mean, or a squashed sample; with
    ``agents``, from and to per-agent dicts through the shared actor (a :class:`.PolicyAct`)."""
    return PolicyAct(actor, params, deterministic=deterministic, agents=tuple(agents) if agents else None)


__all__ = [
    "SACConfig",
    "actor_loss",
    "correlated_noise",
    "critic_loss",
    "make_act",
    "make_actor",
    "make_train",
    "soft_targets",
    "temperature_loss",
]

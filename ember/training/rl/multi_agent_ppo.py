"""IPPO and MAPPO with parameter sharing over the multi-agent dict API (JaxMARL convention).

    env, env_params = ember.envs.make("MPE-simple_spread")
    train = jax.jit(make_train(PPOConfig(...), env, env_params, centralised_critic=True))  # MAPPO

All agents share one actor (and one critic). Agents must be homogeneous: the same
observation shape and the same action space. Per-agent arrays are stacked along an agent
axis, so a rollout is ``[T, num_envs, agents, ...]`` and GAE and the PPO loss
(:mod:`.gae`, :mod:`.losses`) run on it unchanged:

- **IPPO**: the critic sees the agent's own observation;
- **MAPPO**: the critic sees the global state -- every agent's observation concatenated,
  plus a one-hot agent id so that per-agent rewards stay predictable.

An episode ends for all agents at once (``terminated["__all__"] | truncated["__all__"]``);
the ``episode_return`` metric is the return per agent (the episode's rewards averaged over
agents, summed over time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax.training.train_state import TrainState

from ember.envs.batched import BatchedEnv
from ember.models.policies import CentralisedActorCritic, action_head
from ember.training.rl.gae import gae_advantages
from ember.training.rl.ppo import (
    PPOConfig,
    PPOHyperparams,
    episode_statistics,
    make_optimizer,
    minibatch_epochs,
    minibatch_loss,
)


def stack_agents(per_agent: dict[str, Any], agents: list[str]) -> Any:
    """A dict ``{agent: x [batch, ...]}`` as one array ``[batch, agents, ...]`` (in ``agents`` order)."""
    return jnp.stack([per_agent[agent] for agent in agents], axis=1)


def global_state(obs: jax.Array) -> jax.Array:
    """MAPPO's critic input ``[batch, agents, agents * obs_dim + agents]`` from stacked
    observations ``[batch, agents, obs_dim]``: all observations plus a one-hot agent id."""
    batch, agents = obs.shape[:2]
    everyone = jnp.broadcast_to(obs.reshape(batch, 1, -1), (batch, agents, agents * obs.shape[-1]))
    identity = jnp.broadcast_to(jnp.eye(agents, dtype=obs.dtype), (batch, agents, agents))
    return jnp.concatenate([everyone, identity], axis=-1)


def make_policy(config: PPOConfig, env, env_params) -> CentralisedActorCritic:
    """The shared actor-critic of ``env``'s (homogeneous) agents."""
    observation_spaces = env.observation_space(env_params)
    action_spaces = env.action_space(env_params)
    shapes = {tuple(observation_spaces[agent].shape) for agent in env.agents}
    heads = {action_head(action_spaces[agent], config.policy) for agent in env.agents}
    if len(shapes) != 1 or len(heads) != 1:
        raise ValueError(
            f"parameter sharing needs agents with one observation shape and one action space; got shapes {shapes} "
            f"and action heads {heads}"
        )
    return CentralisedActorCritic(heads.pop(), config.policy)


def make_train(
    config: PPOConfig,
    env,
    env_params,
    *,
    centralised_critic: bool = False,
    on_update: Callable[[Any], None] | None = None,
) -> Callable[..., dict[str, Any]]:
    """``train(rng, hyperparams=None) -> {"params", "metrics"}`` as :func:`.ppo.make_train`,
    for a multi-agent environment; ``centralised_critic`` selects MAPPO over IPPO."""
    if config.normalize_rewards:
        raise ValueError("ppo.normalize_rewards is not supported for multi-agent training")
    if config.normalize_observations:
        raise ValueError(
            "ppo.normalize_observations is not supported for multi-agent training (ippo, mappo); "
            "it is available for algo: ppo"
        )
    agents = list(env.agents)
    envs = BatchedEnv(env, config.num_envs)
    policy = make_policy(config, env, env_params)
    critic_input = global_state if centralised_critic else (lambda obs: obs)
    num_updates = config.num_updates

    def train(rng: jax.Array, hyperparams: PPOHyperparams | None = None) -> dict[str, Any]:
        hp = PPOHyperparams.from_config(config) if hyperparams is None else hyperparams
        rng, init_key, reset_key = jax.random.split(rng, 3)
        obs_dict, env_state = envs.reset(reset_key, env_params)
        obs = stack_agents(obs_dict, agents)  # [N, A, obs_dim]
        params = policy.init(init_key, obs, critic_input(obs))
        optimizer = make_optimizer(hp.learning_rate, hp.max_grad_norm, anneal_steps=config.anneal_steps)
        train_state = TrainState.create(apply_fn=policy.apply, params=params, tx=optimizer)
        running_return = jnp.zeros(config.num_envs)
        running_length = jnp.zeros(config.num_envs, jnp.int32)

        def rollout_step(carry, key):
            params, env_state, obs, running_return, running_length = carry
            action_key, env_key = jax.random.split(key)
            dist, value = policy.apply(params, obs, critic_input(obs))
            raw_action = dist.sample(action_key)  # [N, A]
            env_action = dist.env_action(raw_action)
            actions = {agent: env_action[:, i] for i, agent in enumerate(agents)}
            next_obs, env_state, rewards, terminated, truncated, info = envs.step(env_key, env_state, actions, env_params)
            reward = stack_agents(rewards, agents).astype(jnp.float32)  # [N, A]
            done = terminated["__all__"] | truncated["__all__"]  # [N]
            running_return = running_return + reward.mean(axis=1)
            running_length = running_length + 1
            per_agent = lambda flag: jnp.broadcast_to(flag[:, None], reward.shape)  # noqa: E731
            transition = {
                "obs": obs,
                "raw_action": raw_action,
                "log_prob": dist.log_prob(raw_action),
                "value": value,
                "reward": reward,
                "terminated": per_agent(terminated["__all__"]),
                "truncated": per_agent(truncated["__all__"]),
                "final_obs": stack_agents(info["final_observation"], agents),
                "episode_done": done,
                "episode_return": running_return,
                "episode_length": running_length,
            }
            running_return = jnp.where(done, 0.0, running_return)
            running_length = jnp.where(done, 0, running_length)
            next_obs = stack_agents(next_obs, agents)
            return (params, env_state, next_obs, running_return, running_length), transition

        def loss_fn(params, minibatch):
            dist, value = policy.apply(params, minibatch["obs"], minibatch["critic_input"])
            return minibatch_loss(dist, value, minibatch, hp, normalize_advantage=config.normalize_advantage)

        def update(carry, update_index):
            train_state, env_state, obs, running_return, running_length, rng = carry
            rng, rollout_key, epochs_key = jax.random.split(rng, 3)
            (_, env_state, obs, running_return, running_length), rollout = jax.lax.scan(
                rollout_step,
                (train_state.params, env_state, obs, running_return, running_length),
                jax.random.split(rollout_key, config.num_steps),
            )
            final_obs = rollout["final_obs"]  # [T, N, A, obs_dim]
            next_values = jax.vmap(lambda o: policy.apply(train_state.params, critic_input(o), method="value"))(final_obs)
            advantages, returns = gae_advantages(
                rollout["reward"],
                rollout["value"],
                next_values,
                rollout["terminated"],
                rollout["truncated"],
                gamma=hp.gamma,
                gae_lambda=hp.gae_lambda,
            )
            batch = {
                "obs": rollout["obs"],
                "critic_input": jax.vmap(critic_input)(rollout["obs"]),
                "raw_action": rollout["raw_action"],
                "log_prob": rollout["log_prob"],
                "value": rollout["value"],
                "advantages": advantages,
                "returns": returns,
            }
            batch = jax.tree.map(lambda x: x.reshape(-1, *x.shape[3:]), batch)  # [T * N * A, ...]
            train_state, losses = minibatch_epochs(
                train_state, batch, loss_fn, epochs_key, num_epochs=config.update_epochs, num_minibatches=config.num_minibatches
            )
            metrics = {
                **episode_statistics(rollout["episode_done"], rollout["episode_return"], rollout["episode_length"]),
                **losses,
            }
            if on_update is not None:
                jax.debug.callback(on_update, {"update": update_index, **metrics})
            return (train_state, env_state, obs, running_return, running_length, rng), metrics

        carry = (train_state, env_state, obs, running_return, running_length, rng)
        (train_state, *_), metrics = jax.lax.scan(update, carry, jnp.arange(num_updates))
        return {"params": train_state.params, "metrics": metrics}

    return train


def make_act(policy: CentralisedActorCritic, params: Any, agents: list[str], *, deterministic: bool = True):
    """``act(obs_dict, key) -> actions_dict`` for a batch of environments (``obs_dict`` values
    ``[batch, obs_dim]``): the shared actor's mode, or a sample."""

    def act(obs_dict, key):
        obs = stack_agents(obs_dict, agents)
        dist = policy.apply(params, obs, method=lambda module, x: module.actor(x))
        raw = dist.mode() if deterministic else dist.sample(key)
        env_action = dist.env_action(raw)
        return {agent: env_action[:, i] for i, agent in enumerate(agents)}

    return act


__all__ = ["global_state", "make_act", "make_policy", "make_train", "stack_agents"]

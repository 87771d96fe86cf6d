"""Running normalisation: ``NormalizeObservation`` and ``NormalizeReward`` (gymnasium's
definitions, statistics carried in the state so everything stays functional).

Around a ``BatchedEnv`` (anything with ``num_envs``, also under other wrappers) the statistics are shared by the
batch: each step updates them with all ``num_envs`` values at once, as gymnasium's vector
wrappers do. Around a single environment they are that environment's own.

A policy trained on normalised observations is evaluated with the statistics frozen at the
end of training: ``stats.normalize(obs)`` applies them without updating anything.

Around a multi-agent environment (``ember.envs.multi_agent``: observation dicts of agents with
one observation shape) ``NormalizeObservation`` keeps a :class:`MultiAgentObsStats`: one
:class:`RunningMeanVar` for every agent's observations together (the statistics of what an
actor shared by the agents sees) and, where the environment offers a global state, one of
its own for that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs.environment import EnvState
from ember.envs.multi_agent import episode_over, has_global_state, is_multi_agent
from ember.envs.spaces import Box, Dict
from ember.envs.wrappers.base import Wrapper, num_envs, require_array_observation

#: Added to the variance before the square root (gymnasium's default).
EPSILON = 1e-8


@struct.dataclass
class RunningMeanVar:
    """Mean and (population) variance of every value seen so far, starting from a prior
    of mean 0, variance 1 and weight ``count`` (gymnasium's ``RunningMeanStd``)."""

    mean: jax.Array
    var: jax.Array
    count: jax.Array

    @classmethod
    def create(cls, shape, count: float = 1e-4) -> RunningMeanVar:
        return cls(jnp.zeros(shape, jnp.float32), jnp.ones(shape, jnp.float32), jnp.asarray(count, jnp.float32))

    def update(self, values: jax.Array, batch_axes: tuple[int, ...], where: jax.Array | None = None) -> RunningMeanVar:
        """Merges ``values`` (reduced over ``batch_axes``; ``()`` means one value). ``where``
        (bool, the shape of the leading ``batch_axes``, which must then be ``(0, ..., k-1)``)
        merges only the values where it is true; none at all leaves the statistics as they are."""
        values = values.astype(jnp.float32)
        if where is not None:
            weights = where.astype(jnp.float32).reshape(where.shape + (1,) * (values.ndim - where.ndim))
            batch_count = weights.sum()
            per_value = jnp.maximum(batch_count, 1.0)  # no value merged: a finite mean, weighted by 0
            batch_mean = (weights * values).sum(axis=batch_axes) / per_value
            batch_var = (weights * (values - batch_mean) ** 2).sum(axis=batch_axes) / per_value
            return self._merge(batch_mean, batch_var, batch_count)
        batch_count = 1.0
        for axis in batch_axes:
            batch_count *= values.shape[axis]
        batch_mean = values.mean(axis=batch_axes) if batch_axes else values
        batch_var = values.var(axis=batch_axes) if batch_axes else jnp.zeros_like(values)
        return self._merge(batch_mean, batch_var, batch_count)

    def _merge(self, batch_mean: jax.Array, batch_var: jax.Array, batch_count) -> RunningMeanVar:
        """The statistics of everything seen so far and a batch of ``batch_count`` values."""
        delta = batch_mean - self.mean
        total = self.count + batch_count
        mean = self.mean + delta * batch_count / total
        m2 = self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / total
        return RunningMeanVar(mean, m2 / total, total)

    def normalize(self, values: jax.Array, epsilon: float = EPSILON) -> jax.Array:
        """``(values - mean) / sqrt(var + epsilon)`` in float32; ``values`` is ``[..., *mean.shape]``.
        Reads the statistics only (frozen normalisation, e.g. when evaluating a policy)."""
        return ((values - self.mean) / jnp.sqrt(self.var + epsilon)).astype(jnp.float32)


def _batch_axes(env) -> tuple[int, ...]:
    """``(0,)`` around a batch, also through other wrappers (so
    ``NormalizeObservation(NormalizeReward(BatchedEnv(...)))`` shares statistics too)."""
    return (0,) if num_envs(env) is not None else ()


@struct.dataclass
class MultiAgentObsStats:
    """The observation statistics of a multi-agent environment (what ``NormalizeObservation``
    keeps around one, and what IPPO/MAPPO save with the policy).

    Attributes:
      agents: one :class:`RunningMeanVar` of an agent's observation shape, updated with every
        living agent's observations: the agents share it as they share the actor.
      global_state: a :class:`RunningMeanVar` of ``global_state_space``'s shape, or ``None``
        for an environment without a global state.
    """

    agents: RunningMeanVar
    global_state: RunningMeanVar | None = None


@struct.dataclass
class NormalizeObservationState:
    env_state: EnvState
    stats: RunningMeanVar | MultiAgentObsStats


class NormalizeObservation(Wrapper):
    """Observations (one array) become ``(obs - mean) / sqrt(var + epsilon)`` with running
    statistics updated by every observation returned (reset and step), before normalising.
    The state's ``stats`` (a :class:`RunningMeanVar`) are what to save with the policy.

    Around a multi-agent environment the state's ``stats`` are a :class:`MultiAgentObsStats`:
    each agent's observation is normalised with the statistics of all agents' observations, and
    ``global_state(state, params)`` and ``info["final_global_state"]`` with those of the global
    state (where the environment has one), each updated by the values the reset or step returns.
    An agent that has ended (``terminated[agent]`` before its episode is over: a dead SMAX unit,
    whose observation JaxMARL zeroes) leaves the agents' statistics as they are: its observation
    is a placeholder, not something the agent saw, and counting it would shift every living
    agent's normalised observation with the number of units dead.
    """

    wraps_state = True

    def __init__(self, env, epsilon: float = EPSILON):
        super().__init__(env)
        self.epsilon = epsilon
        self.batch_axes = _batch_axes(env)
        self.multi_agent = is_multi_agent(env)
        self.has_global_state = has_global_state(env)

    def observation_space(self, params):
        """An unbounded float32 ``Box`` of the inner space's shape (gymnasium's): normalised
        values lie anywhere, whatever the inner bounds and dtype (a ``Dict`` of them for a
        multi-agent environment)."""
        inner = self.env.observation_space(params)
        if self.multi_agent:
            return Dict({agent: _unbounded(space) for agent, space in inner.spaces.items()})
        if inner.shape is None:  # a Dict or Tuple space
            raise ValueError(
                f"NormalizeObservation: the observation must be one array, got {inner!r}; "
                "wrap a pytree-observation env in FlattenObservation first"
            )
        return _unbounded(inner)

    def global_state_space(self, params):
        if not self.has_global_state:  # the inner environment's error
            return super().global_state_space(params)
        return _unbounded(self.env.global_state_space(params))

    def global_state(self, state, params):
        """The inner global state of ``state``, normalised with ``state``'s statistics."""
        if not self.has_global_state:
            return super().global_state(state, params)
        return state.stats.global_state.normalize(self.env.global_state(state.env_state, params), self.epsilon)

    def reset_from_noise(self, noise, params):
        obs, env_state = self.env.reset_from_noise(noise, params)
        if self.multi_agent:
            agents = self._stack(obs)
            stats = MultiAgentObsStats(
                RunningMeanVar.create(agents.shape[len(self.batch_axes) + 1 :]).update(agents, self._agent_axes()),
                self._global_stats(None, env_state, params),
            )
            return self._normalize_agents(obs, stats.agents), NormalizeObservationState(env_state, stats)
        require_array_observation(obs, "NormalizeObservation")
        value_shape = obs.shape[len(self.batch_axes) :]
        stats = RunningMeanVar.create(value_shape).update(obs, self.batch_axes)
        return stats.normalize(obs, self.epsilon), NormalizeObservationState(env_state, stats)

    def step_from_noise(self, noise, state, action, params):
        obs, env_state, reward, terminated, truncated, info = self.env.step_from_noise(
            noise, state.env_state, action, params
        )
        if self.multi_agent:
            stats, obs, info = self._step_agents(state.stats, obs, env_state, terminated, truncated, info, params)
        else:
            stats = state.stats.update(obs, self.batch_axes)
            info = {**info, "final_observation": stats.normalize(info["final_observation"], self.epsilon)}
            obs = stats.normalize(obs, self.epsilon)
        return obs, NormalizeObservationState(env_state, stats), reward, terminated, truncated, info

    def _step_agents(self, stats, obs, env_state, terminated, truncated, info, params):
        """``(stats, obs, info)`` of a multi-agent step: the statistics updated with the living
        agents' observations (after any auto-reset every agent lives again) and the global
        state of ``env_state``; the observations and the final ones normalised with them."""
        over = episode_over(terminated, truncated)
        living = jnp.stack([~terminated[agent] | over for agent in self.unwrapped.agents], axis=-1)
        stats = MultiAgentObsStats(
            stats.agents.update(self._stack(obs), self._agent_axes(), where=living),
            self._global_stats(stats.global_state, env_state, params),
        )
        info = {**info, "final_observation": self._normalize_agents(info["final_observation"], stats.agents)}
        if self.has_global_state:
            info["final_global_state"] = stats.global_state.normalize(info["final_global_state"], self.epsilon)
        return stats, self._normalize_agents(obs, stats.agents), info

    def _stack(self, obs: dict) -> jax.Array:
        """The agents' observations ``[*batch, agents, *obs_shape]`` (one shape for all of them)."""
        agents = self.unwrapped.agents
        shapes = {agent: tuple(obs[agent].shape) for agent in agents}
        if len(set(shapes.values())) != 1:
            raise ValueError(
                f"NormalizeObservation: one statistics for every agent needs agents with one observation shape, "
                f"got {shapes}"
            )
        return jnp.stack([obs[agent] for agent in agents], axis=len(self.batch_axes))

    def _agent_axes(self) -> tuple[int, ...]:
        """The batch axes of stacked observations: the environments' (if batched) and the agents'."""
        return (*self.batch_axes, len(self.batch_axes))

    def _normalize_agents(self, obs: dict, stats: RunningMeanVar) -> dict:
        return {agent: stats.normalize(value, self.epsilon) for agent, value in obs.items()}

    def _global_stats(self, stats: RunningMeanVar | None, env_state, params) -> RunningMeanVar | None:
        """``stats`` (new ones at a reset) updated with the global state of ``env_state``;
        ``None`` for an environment without one."""
        if not self.has_global_state:
            return None
        values = self.env.global_state(env_state, params)
        if stats is None:
            stats = RunningMeanVar.create(values.shape[len(self.batch_axes) :])
        return stats.update(values, self.batch_axes)


def _unbounded(space) -> Box:
    """An unbounded float32 ``Box`` of ``space``'s shape: where normalised values lie."""
    return Box(-np.inf, np.inf, space.shape, jnp.float32)


@struct.dataclass
class NormalizeRewardState:
    env_state: EnvState
    discounted_return: jax.Array  # per environment
    stats: RunningMeanVar  # of discounted_return (scalar statistics)


class NormalizeReward(Wrapper):
    """Rewards become ``reward / sqrt(var(G) + epsilon)``, ``G`` the running discounted
    return ``G <- gamma * G * (1 - terminated) + reward`` (gymnasium's ``NormalizeReward``).
    ``info["raw_reward"]`` keeps the reward before scaling."""

    wraps_state = True

    def __init__(self, env, gamma: float | jax.Array = 0.99, epsilon: float = EPSILON):
        super().__init__(env)
        if is_multi_agent(env):  # its rewards and flags are per-agent dicts
            raise ValueError(
                f"NormalizeReward: {env!r} is a multi-agent environment; this wrapper scales one reward per "
                "environment (single-agent environments only)"
            )
        if not isinstance(gamma, jax.core.Tracer) and not 0.0 <= gamma <= 1.0:  # a traced gamma is the caller's
            raise ValueError(f"NormalizeReward: gamma must be in [0, 1], got {gamma}")
        self.gamma, self.epsilon = gamma, epsilon
        self.batch_axes = _batch_axes(env)

    def reset_from_noise(self, noise, params):
        obs, env_state = self.env.reset_from_noise(noise, params)
        batch_shape = (num_envs(self.env),) if self.batch_axes else ()
        returns = jnp.zeros(batch_shape, jnp.float32)
        return obs, NormalizeRewardState(env_state, returns, RunningMeanVar.create(()))

    def step_from_noise(self, noise, state, action, params):
        obs, env_state, reward, terminated, truncated, info = self.env.step_from_noise(
            noise, state.env_state, action, params
        )
        returns = state.discounted_return * self.gamma * (1.0 - terminated) + reward
        stats = state.stats.update(returns, self.batch_axes)
        scaled = reward / jnp.sqrt(stats.var + self.epsilon)
        info = {**info, "raw_reward": reward}
        return obs, NormalizeRewardState(env_state, returns, stats), scaled, terminated, truncated, info

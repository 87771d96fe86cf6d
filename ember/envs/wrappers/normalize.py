"""Running normalisation: ``NormalizeObservation`` and ``NormalizeReward`` (gymnasium's
definitions, statistics carried in the state so everything stays functional).

Around a ``BatchedEnv`` (anything with ``num_envs``, also under other wrappers) the statistics are shared by the
batch: each step updates them with all ``num_envs`` values at once, as gymnasium's vector
wrappers do. Around a single environment they are that environment's own.

A policy trained on normalised observations is evaluated with the statistics frozen at the
end of training: ``stats.normalize(obs)`` applies them without updating anything.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs.environment import EnvState
from ember.envs.multi_agent import is_multi_agent
from ember.envs.spaces import Box
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

    def update(self, values: jax.Array, batch_axes: tuple[int, ...]) -> RunningMeanVar:
        """Merges ``values`` (reduced over ``batch_axes``; ``()`` means one value)."""
        values = values.astype(jnp.float32)
        batch_count = 1.0
        for axis in batch_axes:
            batch_count *= values.shape[axis]
        batch_mean = values.mean(axis=batch_axes) if batch_axes else values
        batch_var = values.var(axis=batch_axes) if batch_axes else jnp.zeros_like(values)
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
class NormalizeObservationState:
    env_state: EnvState
    stats: RunningMeanVar


class NormalizeObservation(Wrapper):
    """Observations (one array) become ``(obs - mean) / sqrt(var + epsilon)`` with running
    statistics updated by every observation returned (reset and step), before normalising.
    The state's ``stats`` (a :class:`RunningMeanVar`) are what to save with the policy."""

    wraps_state = True

    def __init__(self, env, epsilon: float = EPSILON):
        super().__init__(env)
        self.epsilon = epsilon
        self.batch_axes = _batch_axes(env)

    def observation_space(self, params):
        """An unbounded float32 ``Box`` of the inner space's shape (gymnasium's): normalised
        values lie anywhere, whatever the inner bounds and dtype."""
        inner = self.env.observation_space(params)
        if inner.shape is None:  # a Dict or Tuple space
            raise ValueError(
                f"NormalizeObservation: the observation must be one array, got {inner!r}; "
                "wrap a pytree-observation env in FlattenObservation first"
            )
        return Box(-np.inf, np.inf, inner.shape, jnp.float32)

    def reset_from_noise(self, noise, params):
        obs, env_state = self.env.reset_from_noise(noise, params)
        require_array_observation(obs, "NormalizeObservation")
        value_shape = obs.shape[len(self.batch_axes) :]
        stats = RunningMeanVar.create(value_shape).update(obs, self.batch_axes)
        return stats.normalize(obs, self.epsilon), NormalizeObservationState(env_state, stats)

    def step_from_noise(self, noise, state, action, params):
        obs, env_state, reward, terminated, truncated, info = self.env.step_from_noise(
            noise, state.env_state, action, params
        )
        stats = state.stats.update(obs, self.batch_axes)
        info = {**info, "final_observation": stats.normalize(info["final_observation"], self.epsilon)}
        return (
            stats.normalize(obs, self.epsilon),
            NormalizeObservationState(env_state, stats),
            reward,
            terminated,
            truncated,
            info,
        )


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

"""Observation wrappers: ``FlattenObservation`` and ``FrameStack``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs import spaces
from ember.envs.environment import EnvState
from ember.envs.multi_agent import is_multi_agent
from ember.envs.wrappers.base import Wrapper, require_array_observation


def _space_leaves(space: spaces.Space) -> list[spaces.Space]:
    if isinstance(space, spaces.Dict):
        # jax.tree flattens dicts in sorted-key order; match it.
        return [leaf for name in sorted(space.spaces) for leaf in _space_leaves(space.spaces[name])]
    if isinstance(space, spaces.Tuple):
        return [leaf for sub in space.spaces for leaf in _space_leaves(sub)]
    return [space]


def _bounds(space: spaces.Space) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(space, spaces.Box):
        return space.low.ravel(), space.high.ravel()
    if isinstance(space, spaces.Discrete):
        return np.array([space.start]), np.array([space.start + space.n - 1])
    if isinstance(space, spaces.MultiDiscrete):
        return np.zeros(space.nvec.size), (space.nvec - 1).ravel().astype(np.float64)
    raise ValueError(f"FlattenObservation: cannot flatten a {space!r}")


def flatten(obs) -> jax.Array:
    """Every leaf of the observation pytree, raveled and concatenated as float32 ``[size]``."""
    return jnp.concatenate([jnp.ravel(leaf).astype(jnp.float32) for leaf in jax.tree.leaves(obs)])


class FlattenObservation(Wrapper):
    """Observations (any pytree of arrays) become one float32 vector ``[size]``. Single-agent
    environments only: a multi-agent one's observation is a dict of every agent's."""

    one_environment = True

    def __init__(self, env):
        super().__init__(env)
        if is_multi_agent(env):
            raise ValueError(
                f"FlattenObservation: {env!r} is a multi-agent environment, whose observations are one per "
                "agent (a dict); flattening would join them into one vector"
            )

    def observation_space(self, params):
        bounds = [_bounds(leaf) for leaf in _space_leaves(self.env.observation_space(params))]
        low = np.concatenate([low for low, _ in bounds])
        high = np.concatenate([high for _, high in bounds])
        return spaces.Box(low, high, low.shape, jnp.float32)

    def reset_from_noise(self, noise, params):
        obs, state = self.env.reset_from_noise(noise, params)
        return flatten(obs), state

    def step_from_noise(self, noise, state, action, params):
        obs, state, reward, terminated, truncated, info = self.env.step_from_noise(noise, state, action, params)
        info = {**info, "final_observation": flatten(info["final_observation"])}
        return flatten(obs), state, reward, terminated, truncated, info


@struct.dataclass
class FrameStackState:
    env_state: EnvState
    frames: jax.Array  # [num_frames, *obs_shape], oldest first


class FrameStack(Wrapper):
    """Observations become the last ``num_frames`` observations stacked on a new leading
    axis, oldest first: ``[num_frames, *obs_shape]``. A new episode starts with the reset
    observation repeated; ``final_observation`` is the stack the episode ended on."""

    wraps_state = True
    one_environment = True

    def __init__(self, env, num_frames: int):
        super().__init__(env)
        if not isinstance(num_frames, int) or num_frames < 1:
            raise ValueError(f"FrameStack: num_frames must be a positive int, got {num_frames!r}")
        self.num_frames = num_frames

    def observation_space(self, params):
        inner = self.env.observation_space(params)
        if not isinstance(inner, spaces.Box):
            raise ValueError(f"FrameStack: needs a Box observation space, got {inner!r}")
        repeat = lambda bound: np.broadcast_to(bound, (self.num_frames, *inner.shape))  # noqa: E731
        return spaces.Box(repeat(inner.low), repeat(inner.high), (self.num_frames, *inner.shape), inner.dtype)

    def _repeated(self, obs):
        return jnp.broadcast_to(obs, (self.num_frames, *jnp.shape(obs)))

    def reset_from_noise(self, noise, params):
        obs, env_state = self.env.reset_from_noise(noise, params)
        require_array_observation(obs, "FrameStack")  # jnp.broadcast_to raised a TypeError for a dict
        frames = self._repeated(obs)
        return frames, FrameStackState(env_state, frames)

    def step_from_noise(self, noise, state, action, params):
        obs, env_state, reward, terminated, truncated, info = self.env.step_from_noise(
            noise, state.env_state, action, params
        )
        final_frames = jnp.concatenate([state.frames[1:], info["final_observation"][None]], axis=0)
        frames = jnp.where(terminated | truncated, self._repeated(obs), final_frames)
        info = {**info, "final_observation": final_frames}
        return frames, FrameStackState(env_state, frames), reward, terminated, truncated, info

"""``GymnasiumVectorEnv``: any Ember environment as a ``gymnasium.vector.VectorEnv``.

    envs = GymnasiumVectorEnv("CartPole-v1", num_envs=8)   # or an (env, params) pair
    obs, info = envs.reset(seed=0)
    obs, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())

Steps are one jitted ``BatchedEnv`` call; arrays come back as NumPy. ``autoreset_mode``:
  * ``AutoresetMode.NEXT_STEP`` (gymnasium's default, which its vector wrappers such as
    ``RecordEpisodeStatistics`` assume): the step that ends an episode returns its last
    observation; the next ``step`` ignores that sub-environment's action and returns the
    new episode's first observation with reward 0 and both flags false;
  * ``AutoresetMode.SAME_STEP`` (Ember's own semantics): the step that ends an episode
    returns the new episode's observation, and ``infos["final_obs"]`` (object array,
    ``None`` elsewhere) with mask ``infos["_final_obs"]`` holds the one it ended on.
"""

from __future__ import annotations

from typing import Any

import gymnasium
import jax
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from ember.envs import spaces
from ember.envs.batched import BatchedEnv
from ember.envs.environment import Environment
from ember.envs.multi_agent import is_multi_agent
from ember.envs.registry import make


def to_gymnasium_space(space: spaces.Space) -> gymnasium.Space:
    """An Ember space as the equivalent gymnasium space."""
    if isinstance(space, spaces.Discrete):
        return gymnasium.spaces.Discrete(space.n, start=space.start)
    if isinstance(space, spaces.MultiDiscrete):
        return gymnasium.spaces.MultiDiscrete(space.nvec)
    if isinstance(space, spaces.Box):
        low, high = space.bounds_in_dtype()
        return gymnasium.spaces.Box(low, high, space.shape, np.dtype(space.dtype))
    if isinstance(space, spaces.Dict):
        return gymnasium.spaces.Dict({name: to_gymnasium_space(sub) for name, sub in space.spaces.items()})
    if isinstance(space, spaces.Tuple):
        return gymnasium.spaces.Tuple([to_gymnasium_space(sub) for sub in space.spaces])
    raise ValueError(f"cannot convert {space!r} to a gymnasium space")


class GymnasiumVectorEnv(VectorEnv):
    def __init__(
        self,
        env: str | Environment,
        num_envs: int,
        params: Any = None,
        render_mode: str | None = None,
        autoreset_mode: AutoresetMode = AutoresetMode.NEXT_STEP,
    ):
        if isinstance(env, str):
            env, default_params = make(env)
            params = default_params if params is None else params
        if is_multi_agent(env):  # gymnasium's VectorEnv has one reward and one pair of flags per environment
            raise ValueError(
                f"GymnasiumVectorEnv: {env!r} is a multi-agent environment (rewards and flags per agent); "
                "a gymnasium VectorEnv holds single-agent environments only"
            )
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        if autoreset_mode not in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP):
            raise ValueError(f"autoreset_mode must be NEXT_STEP or SAME_STEP, got {autoreset_mode!r}")
        self.metadata = {"autoreset_mode": autoreset_mode, "render_modes": ["rgb_array"]}
        self.env = env
        self.params = env.default_params if params is None else params
        self.num_envs = num_envs
        self.render_mode = render_mode
        self._batched = BatchedEnv(env, num_envs)
        self.single_observation_space = to_gymnasium_space(env.observation_space(self.params))
        self.single_action_space = to_gymnasium_space(env.action_space(self.params))
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self._reset = jax.jit(self._batched.reset)
        self._step = jax.jit(self._batched.step)
        self._render = jax.jit(jax.vmap(env.render, in_axes=(0, None)))
        self._key = jax.random.key(0)
        self._state = None
        self._pending_reset = np.zeros(num_envs, bool)  # NEXT_STEP: ended last step
        self._reset_obs = None

    def _next_key(self) -> jax.Array:
        self._key, key = jax.random.split(self._key)
        return key

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self._key = jax.random.key(seed)
        obs, self._state = self._reset(self._next_key(), self.params)
        self._pending_reset[:] = False
        return jax.tree.map(np.asarray, obs), {}

    def step(self, actions):
        if self._state is None:
            raise RuntimeError("GymnasiumVectorEnv: call reset() before step()")
        previous_state = self._state
        obs, self._state, reward, terminated, truncated, info = self._step(
            self._next_key(), self._state, jax.tree.map(np.asarray, actions), self.params
        )
        obs, info = jax.tree.map(np.asarray, (obs, info))
        reward, terminated, truncated = (np.array(x) for x in (reward, terminated, truncated))
        if self.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP:
            return self._next_step_semantics(previous_state, obs, reward, terminated, truncated, info)
        done = terminated | truncated
        final = np.full(self.num_envs, None, dtype=object)
        for index in np.flatnonzero(done):
            final[index] = jax.tree.map(lambda leaf, index=index: leaf[index], info["final_observation"])
        infos = {"final_obs": final, "_final_obs": done}
        return obs, reward, terminated, truncated, infos

    def _next_step_semantics(self, previous_state, obs, reward, terminated, truncated, info):
        """Rewrites one SAME_STEP batch into NEXT_STEP: sub-environments that ended last
        step keep their (already reset) state and report the reset observation, reward 0."""
        pending = self._pending_reset
        if pending.any():
            self._state = jax.tree.map(
                lambda old, new: np.where(pending.reshape((-1,) + (1,) * (np.ndim(new) - 1)), old, new),
                previous_state,
                self._state,
            )
            obs = jax.tree.map(
                lambda reset, new: np.where(pending.reshape((-1,) + (1,) * (new.ndim - 1)), reset, new),
                self._reset_obs,
                obs,
            )
            reward[pending], terminated[pending], truncated[pending] = 0, False, False
        done = terminated | truncated
        # The returned observation of an ending episode is its last one; keep the new
        # episode's first observation for the next call.
        self._reset_obs = obs
        obs = jax.tree.map(
            lambda final, new: np.where(done.reshape((-1,) + (1,) * (new.ndim - 1)), final, new),
            info["final_observation"],
            obs,
        )
        self._pending_reset = done
        return obs, reward, terminated, truncated, {}

    def render(self):
        """A tuple of ``num_envs`` uint8 ``[height, width, 3]`` frames (``render_mode="rgb_array"``)."""
        if self.render_mode != "rgb_array" or self._state is None:
            return None
        return tuple(np.asarray(self._render(self._state, self.params)))

"""``BatchedEnv``: ``num_envs`` copies of an environment stepped in lockstep.

    env, params = ember.envs.make("CartPole-v1")
    envs = BatchedEnv(LogWrapper(env), num_envs=1024)
    obs, state = envs.reset(key, params)                 # obs [1024, 4]
    obs, state, reward, terminated, truncated, info = envs.step(key, state, actions, params)

The contract is the single environment's with a leading ``[num_envs]`` axis on every
observation, state leaf, action, reward, flag and info entry; ``params`` is shared. One key
drives the whole batch: its random words are drawn in ONE call of shape
``[num_envs, words]`` (``noise.draw_batch``, XLA's native threefry, from 64 environments
on; ``jax.random.bits`` below, where its fixed cost would dominate) and the
per-environment functions are ``jax.vmap``-ed over them, instead of splitting a key per
environment (what ``jax.vmap(env.step)(keys, ...)`` does, which also works). Under a
``jax.vmap`` over seeds (``jax.vmap(make_train(...))(keys)``) each seed's words come from its
own key, equal to a separate run's. Spaces are those of one environment.
"""

from __future__ import annotations

import jax

from ember.envs import noise as noise_lib
from ember.envs.environment import Environment
from ember.envs.wrappers.base import Wrapper

BATCHED_DRAW_MIN_ENVS = 64


class BatchedEnv(Wrapper):
    def __init__(self, env: Environment, num_envs: int):
        super().__init__(env)
        if not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"BatchedEnv: num_envs must be a positive int, got {num_envs!r}")
        self.num_envs = num_envs

    @property
    def reset_noise_shape(self):
        return (self.num_envs, *self.env.reset_noise_shape)

    @property
    def step_noise_shape(self):
        return (self.num_envs, *self.env.step_noise_shape)

    def draw_noise(self, key, shape):
        # RngBitGenerator pays a fixed cost per call that only large batches amortise.
        if self.num_envs >= BATCHED_DRAW_MIN_ENVS:
            return noise_lib.draw_batch(key, shape)
        return noise_lib.draw(key, shape)

    def reset_from_noise(self, noise, params):
        return jax.vmap(self.env.reset_from_noise, in_axes=(0, None))(noise, params)

    def step_from_noise(self, noise, state, action, params):
        return jax.vmap(self.env.step_from_noise, in_axes=(0, 0, 0, None))(noise, state, action, params)

    def action_masks(self, state, params):
        """Each sub-environment's legal actions: ``{agent: bool [num_envs, num_actions]}``."""
        return jax.vmap(self.env.action_masks, in_axes=(0, None))(state, params)

    def global_state(self, state, params):
        """Each sub-environment's global state: ``[num_envs, *global_state_space(params).shape]``."""
        return jax.vmap(self.env.global_state, in_axes=(0, None))(state, params)

    def render(self, state, params, index: int = 0):
        """The picture of sub-environment ``index``."""
        return self.env.render(jax.tree.map(lambda leaf: leaf[index], state), params)

    def __repr__(self) -> str:
        return f"BatchedEnv({self.env!r}, num_envs={self.num_envs})"

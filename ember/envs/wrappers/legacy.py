"""``LegacyStep``: the five-value step of gymnax 0.x, for code written against it.

    env = LegacyStep(ember_env)
    obs, state, reward, done, info = env.step(key, state, action, params)

``done = terminated | truncated``; ``info`` also carries ``"terminated"``, ``"truncated"``,
``"discount"`` (0 on termination, else 1) and ``"final_observation"``.
"""

from __future__ import annotations

import jax.numpy as jnp

from ember.envs.environment import Environment


class LegacyStep:
    def __init__(self, env: Environment):
        if not isinstance(env, Environment):
            raise ValueError(f"LegacyStep: env must be an ember Environment, got {type(env).__name__}")
        self.env = env

    @property
    def default_params(self):
        return self.env.default_params

    def reset(self, key, params=None):
        return self.env.reset(key, params)

    def step(self, key, state, action, params=None):
        obs, state, reward, terminated, truncated, info = self.env.step(key, state, action, params)
        info = {
            **info,
            "terminated": terminated,
            "truncated": truncated,
            "discount": 1.0 - terminated.astype(jnp.float32),
        }
        return obs, state, reward, terminated | truncated, info

    def observation_space(self, params):
        return self.env.observation_space(params)

    def action_space(self, params):
        return self.env.action_space(params)

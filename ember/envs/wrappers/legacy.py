"""``LegacyStep``: the five-value step of gymnax 0.x, for code written against it.

    env = LegacyStep(ember_env)
    obs, state, reward, done, info = env.step(key, state, action, params)

``done = terminated | truncated``; ``info`` also carries ``"terminated"``, ``"truncated"``,
``"discount"`` (0 on termination, else 1) and ``"final_observation"``. For a multi-agent
environment ``done`` and ``discount`` are dicts keyed like its flags (``"__all__"`` included),
as JaxMARL's five-value ``step`` returns ``dones``.
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
        if isinstance(terminated, dict):  # multi-agent: per-agent flag dicts (JaxMARL's dones)
            done = {name: terminated[name] | truncated[name] for name in terminated}
            discount = {name: 1.0 - flag.astype(jnp.float32) for name, flag in terminated.items()}
        else:
            done, discount = terminated | truncated, 1.0 - terminated.astype(jnp.float32)
        info = {**info, "terminated": terminated, "truncated": truncated, "discount": discount}
        return obs, state, reward, done, info

    def observation_space(self, params):
        return self.env.observation_space(params)

    def action_space(self, params):
        return self.env.action_space(params)

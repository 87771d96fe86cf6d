"""``GymnaxEnv``: a gymnax (1.x) environment behind Ember's single-agent contract.

    import gymnax
    env = GymnaxEnv(*gymnax.make("CartPole-v1"))
    obs, state = env.reset(key, env.default_params)
    obs, state, reward, terminated, truncated, info = env.step(key, state, action, params)

gymnax's ``step_env`` (gymnax >= 1.0.1) reports natural termination only, which becomes
``terminated``; the time limit (``params.max_steps_in_episode``, which every gymnax params
object carries) is ``truncated``, applied by Ember's ``step`` as for its own environments,
so a terminal step that is also the last allowed one reads as both. The gymnax key of each
reset/transition is built from two random words, so ``BatchedEnv`` draws a whole batch's
randomness in one call here too.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from ember.envs import noise as noise_lib
from ember.envs import spaces
from ember.envs.environment import Environment


def from_library_space(space: Any) -> spaces.Space:
    """A gymnax or JaxMARL space (``Discrete``, ``Box``, ``Dict``, ``Tuple``) as an Ember space."""
    kind = type(space).__name__
    if kind == "Discrete":
        return spaces.Discrete(int(space.n), dtype=getattr(space, "dtype", jnp.int32))
    if kind == "Box":  # JaxMARL's Hanabi gives its shape as one integer
        shape = tuple(space.shape) if isinstance(space.shape, (tuple, list)) else (int(space.shape),)
        return spaces.Box(space.low, space.high, shape, getattr(space, "dtype", jnp.float32))
    if kind == "MultiDiscrete":
        return spaces.MultiDiscrete(space.num_categories)
    if kind == "Dict":
        return spaces.Dict({name: from_library_space(sub) for name, sub in space.spaces.items()})
    if kind == "Tuple":
        return spaces.Tuple([from_library_space(sub) for sub in space.spaces])
    raise ValueError(f"cannot convert a {kind} space; supported: Discrete, Box, MultiDiscrete, Dict, Tuple")


class GymnaxEnv(Environment):
    reset_noise_words = 2
    transition_noise_words = 2

    def __init__(self, gymnax_env: Any, gymnax_params: Any = None):
        for method in ("reset_env", "step_env", "default_params", "action_space", "observation_space"):
            if not hasattr(gymnax_env, method):
                raise ValueError(
                    f"GymnaxEnv: expected a gymnax environment (no '{method}' on {type(gymnax_env).__name__})"
                )
        self.gymnax_env = gymnax_env
        self.gymnax_params = gymnax_params if gymnax_params is not None else gymnax_env.default_params

    @property
    def default_params(self):
        return self.gymnax_params

    def reset_env(self, noise, params):
        return self.gymnax_env.reset_env(noise_lib.to_key(noise), params)

    def step_env(self, noise, state, action, params):
        obs, next_state, reward, terminated, info = self.gymnax_env.step_env(
            noise_lib.to_key(noise), state, action, params
        )
        info = {name: value for name, value in info.items() if name != "discount"}
        return obs, next_state, reward, terminated, info

    def observation_space(self, params):
        return from_library_space(self.gymnax_env.observation_space(params))

    def action_space(self, params):
        return from_library_space(self.gymnax_env.action_space(params))

    @property
    def name(self) -> str:
        return f"gymnax:{self.gymnax_env.name}"

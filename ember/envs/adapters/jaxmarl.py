"""``JaxMARLEnv``: a JaxMARL environment behind Ember's multi-agent contract.

    import jaxmarl
    env = JaxMARLEnv(jaxmarl.make("MPE_simple_spread_v3"))
    obs, state = env.reset(key, env.default_params)

JaxMARL environments take no params; the adapter's params carry only the time limit
(``max_steps_in_episode``, default the environment's ``max_steps``), which becomes
``truncated``; JaxMARL's ``dones["__all__"]`` become ``terminated``, except on the step where
the environment's own ``max_steps`` ends the episode (its time limit, not a termination). The
limit can only shorten the environment's own ``max_steps``: past it JaxMARL ends the episode
itself, in a ``dones`` that does not say it was the time limit, so a longer limit is refused. A
termination on the environment's own last step reads as truncation only (JaxMARL's ``dones``
cannot tell the two apart there). The JaxMARL state is kept as ``state.env_state``.

Every agent acts on every step and the episode ends for all agents at once (Ember's multi-agent
contract): only ``dones["__all__"]`` is read. Environments that mask their agents' actions
(``get_avail_actions``, ``get_legal_moves``: SMAX, Hanabi, JaxNav), whose agents also drop out
one by one, are refused with :class:`UnsupportedEnvironment`: trained through this adapter,
their agents would take illegal actions and bootstrap through steps after their own end.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import struct

from ember.envs import noise as noise_lib
from ember.envs.adapters.gymnax import from_library_space
from ember.envs.environment import EnvParams, EnvState
from ember.envs.multi_agent import MultiAgentEnvironment
from ember.envs.spaces import Dict


class UnsupportedEnvironment(ValueError):
    """A JaxMARL environment outside what the adapter can represent (see the module docstring)."""


def _action_mask_method(jaxmarl_env: Any) -> str | None:
    """The name of ``jaxmarl_env``'s own per-step action-mask method, None where it has none
    (JaxMARL's ``MultiAgentEnv`` declares ``get_avail_actions`` without implementing it)."""
    for cls in type(jaxmarl_env).__mro__:
        if cls.__name__ == "MultiAgentEnv" and cls.__module__.startswith("jaxmarl."):
            break
        for name in ("get_avail_actions", "get_legal_moves"):
            if name in vars(cls):
                return name
    return None


@struct.dataclass
class JaxMARLState(EnvState):
    env_state: Any


class JaxMARLEnv(MultiAgentEnvironment):
    reset_noise_words = 2
    transition_noise_words = 2

    def __init__(self, jaxmarl_env: Any, max_steps: int | None = None):
        """Wraps ``jaxmarl_env`` with the time limit ``max_steps`` (default, and at most, the
        environment's own ``max_steps``; required where it has none)."""
        for attribute in ("agents", "reset", "step_env", "observation_space", "action_space"):
            if not hasattr(jaxmarl_env, attribute):
                raise ValueError(
                    f"JaxMARLEnv: expected a JaxMARL environment (no '{attribute}' on {type(jaxmarl_env).__name__})"
                )
        mask = _action_mask_method(jaxmarl_env)
        if mask is not None:
            raise UnsupportedEnvironment(
                f"JaxMARLEnv: {type(jaxmarl_env).__name__} masks its agents' actions each step ({mask}) and can end "
                "agents one by one; Ember's multi-agent contract has every agent act on every step and the episode "
                "end for all at once (supported: JaxMARL environments without action masks, e.g. MPE)"
            )
        self.jaxmarl_env = jaxmarl_env
        self.agents = list(jaxmarl_env.agents)
        own_limit = getattr(jaxmarl_env, "max_steps", None)
        limit = max_steps if max_steps is not None else own_limit
        if limit is None:
            raise ValueError("JaxMARLEnv: the environment has no max_steps; pass max_steps")
        if own_limit is not None and int(limit) > int(own_limit):
            raise ValueError(
                f"JaxMARLEnv: a time limit of {limit} steps exceeds the environment's own max_steps "
                f"({own_limit}); the limit can only shorten episodes"
            )
        self.max_steps = int(limit)
        self.own_max_steps = None if own_limit is None else int(own_limit)

    @property
    def default_params(self) -> EnvParams:
        return EnvParams(max_steps_in_episode=self.max_steps)

    def step_from_noise(self, noise, state, action, params):
        # A params limit past the environment's own (passed directly, not through the
        # constructor or make_from_config, which refuse it) is cut to the own: beyond it
        # JaxMARL's episode is over, and that step is a truncation here.
        if self.own_max_steps is not None:
            limit = jnp.minimum(params.max_steps_in_episode, self.own_max_steps)
            params = params.replace(max_steps_in_episode=limit)
        return super().step_from_noise(noise, state, action, params)

    def reset_env(self, noise, params):
        obs, env_state = self.jaxmarl_env.reset(noise_lib.to_key(noise))
        return obs, JaxMARLState(time=jnp.int32(0), env_state=env_state)

    def step_env(self, noise, state, actions, params):
        obs, env_state, rewards, dones, info = self.jaxmarl_env.step_env(
            noise_lib.to_key(noise), state.env_state, actions
        )
        terminated = jnp.asarray(dones["__all__"], bool)
        if self.own_max_steps is not None:  # JaxMARL's own time limit; the adapter's reads as truncated
            terminated &= state.time + 1 < self.own_max_steps
        return obs, state.replace(env_state=env_state), rewards, terminated, info

    def observation_space(self, params):
        return Dict({agent: from_library_space(self.jaxmarl_env.observation_space(agent)) for agent in self.agents})

    def action_space(self, params):
        return Dict({agent: from_library_space(self.jaxmarl_env.action_space(agent)) for agent in self.agents})


__all__ = ["JaxMARLEnv", "JaxMARLState", "UnsupportedEnvironment"]

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

Agents that end one by one and act under masks (``ember.envs.multi_agent``): JaxMARL's
``dones[agent]`` become ``terminated[agent]`` (except on the environment's own last step, as
for the episode; an agent that ended earlier stays terminated), and an environment with an
action-mask method of its own (``get_avail_actions``: SMAX, ``HeuristicEnemySMAX``;
``get_legal_moves``: Hanabi) gives it as ``action_masks(state, params)``. Observations and
rewards keep the agents' entries only (SMAX adds ``"world_state"`` to its observations, Hanabi
``"__all__"`` to its rewards). An environment whose ``get_world_state(state)`` is one flat array
offers it as its global state, ``global_state(state, params)`` and ``info["final_global_state"]``
(``ember.envs.multi_agent``): SMAX's ``world_state``, every living unit's health, position,
weapon cooldown and type (enemies included; zeros for a dead unit), then every unit's team and
type. Other ``get_world_state`` shapes are per-agent views, not one global state (MPE
simple_facmac's dict of observations, JaxNav's ``[agents, ...]`` with agent ids), and are not
offered. Masks of agents whose actions are not discrete (SMAX with ``action_type="continuous"``,
JaxNav) cannot restrict a categorical policy: such an environment is refused with
:class:`UnsupportedEnvironment`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from ember.envs import noise as noise_lib
from ember.envs.adapters.gymnax import from_library_space
from ember.envs.environment import EnvParams, EnvState
from ember.envs.multi_agent import MultiAgentEnvironment
from ember.envs.spaces import Box, Dict


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


def _world_state_shape(jaxmarl_env: Any, noise_words: int) -> jax.ShapeDtypeStruct | None:
    """The shape and dtype of ``jaxmarl_env.get_world_state`` of a state it resets to, where it
    has that method and it gives one flat array; None otherwise (traced, not run)."""
    if not callable(getattr(jaxmarl_env, "get_world_state", None)):
        return None

    def world_state(noise):
        return jaxmarl_env.get_world_state(jaxmarl_env.reset(noise_lib.to_key(noise))[1])

    shape = jax.eval_shape(world_state, jax.ShapeDtypeStruct((noise_words,), jnp.uint32))
    return shape if isinstance(shape, jax.ShapeDtypeStruct) and len(shape.shape) == 1 else None


@struct.dataclass
class JaxMARLState(EnvState):
    """``env_state``: JaxMARL's state; ``agents_done``: bool ``[agents]``, which agents have
    ended (``dones[agent]``) in this episode so far."""

    env_state: Any
    agents_done: jax.Array


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
        self.jaxmarl_env = jaxmarl_env
        self.agents = list(jaxmarl_env.agents)
        self.mask_method = _action_mask_method(jaxmarl_env)
        self.masks_actions = self.mask_method is not None
        if self.masks_actions:
            for agent in self.agents:
                space = jaxmarl_env.action_space(agent)
                if not hasattr(space, "n"):
                    raise UnsupportedEnvironment(
                        f"JaxMARLEnv: {type(jaxmarl_env).__name__} masks its agents' actions ({self.mask_method}) but "
                        f"agent {agent!r} has non-discrete actions ({type(space).__name__}); masks are supported for "
                        "Discrete action spaces only (e.g. SMAX with action_type='discrete', Hanabi)"
                    )
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
        self._world_state = _world_state_shape(jaxmarl_env, self.reset_noise_words)
        self.has_global_state = self._world_state is not None

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
        agents_done = jnp.zeros(len(self.agents), jnp.bool_)
        return self._agents_only(obs), JaxMARLState(time=jnp.int32(0), env_state=env_state, agents_done=agents_done)

    def step_env(self, noise, state, actions, params):
        obs, env_state, rewards, dones, info = self.jaxmarl_env.step_env(
            noise_lib.to_key(noise), state.env_state, actions
        )
        ended = jnp.stack([jnp.asarray(dones[agent], jnp.bool_) for agent in self.agents])
        terminated_all = jnp.asarray(dones["__all__"], jnp.bool_)
        if self.own_max_steps is not None:  # JaxMARL's own time limit; the adapter's reads as truncated
            not_own_limit = state.time + 1 < self.own_max_steps
            terminated_all &= not_own_limit
            ended &= not_own_limit
        ended |= state.agents_done
        terminated = {agent: ended[i] for i, agent in enumerate(self.agents)} | {"__all__": terminated_all}
        next_state = state.replace(env_state=env_state, agents_done=ended)
        return self._agents_only(obs), next_state, self._agents_only(rewards), terminated, info

    def action_masks(self, state, params):
        """JaxMARL's own masks (``get_avail_actions`` / ``get_legal_moves``) of ``state.env_state``
        as bool ``[num_actions]`` per agent; all true for an environment without them."""
        if not self.masks_actions:
            return super().action_masks(state, params)
        masks = getattr(self.jaxmarl_env, self.mask_method)(state.env_state)
        return {agent: jnp.asarray(masks[agent]).astype(jnp.bool_) for agent in self.agents}

    def global_state(self, state, params):
        """JaxMARL's ``get_world_state`` of ``state.env_state`` (SMAX: what its observations carry
        as ``"world_state"``), ``[state_dim]``."""
        if not self.has_global_state:
            return super().global_state(state, params)
        return self.jaxmarl_env.get_world_state(state.env_state)

    def global_state_space(self, params):
        """An unbounded ``Box`` of ``get_world_state``'s shape and dtype (SMAX's positions are in
        map units, its unit types integers)."""
        if not self.has_global_state:
            return super().global_state_space(params)
        return Box(-jnp.inf, jnp.inf, self._world_state.shape, self._world_state.dtype)

    def _agents_only(self, per_agent: dict) -> dict:
        return {agent: per_agent[agent] for agent in self.agents}

    def observation_space(self, params):
        return Dict({agent: from_library_space(self.jaxmarl_env.observation_space(agent)) for agent in self.agents})

    def action_space(self, params):
        return Dict({agent: from_library_space(self.jaxmarl_env.action_space(agent)) for agent in self.agents})


__all__ = ["JaxMARLEnv", "JaxMARLState", "UnsupportedEnvironment"]

"""The multi-agent contract (JaxMARL's convention on top of ``Environment``'s):

    env, params = ember.envs.make("MPE-simple_spread")
    obs, state = env.reset(key, params)                      # obs: {agent: array}
    obs, state, rewards, terminated, truncated, info = env.step(key, state, actions, params)

``actions``, ``obs`` and ``rewards`` are dicts keyed by the names in ``env.agents``;
``terminated`` and ``truncated`` are too, plus the key ``"__all__"`` (the episode is over
for everyone). The episode auto-resets when ``terminated["__all__"] | truncated["__all__"]``,
with ``info["final_observation"]`` (a dict) as in the single-agent contract.
``observation_space(params)`` and ``action_space(params)`` return ``spaces.Dict`` of the
per-agent spaces; actions are clipped into them as for single-agent environments.
``episode_over(terminated, truncated)`` reads the end of an episode from the flags of
either contract.

Agents that end one by one and act under masks (SMAX, Hanabi):

* ``terminated[agent]``: that agent reached its own end (a unit died, a player is out) on this
  step or before; it stays true until the episode ends, and it is true for every agent when
  ``terminated["__all__"]`` is. ``truncated[agent]`` is the episode's time limit for every
  agent. An environment whose agents all end together gives each agent the episode's flag.
  (``step_env`` returns ``terminated`` either as one bool, the episode's, or as a dict of
  per-agent flags plus ``"__all__"``.)
* ``action_masks(state, params) -> {agent: bool [num_actions]}``: the legal discrete actions
  of each agent in ``state``, the state that goes with the observation the agents act on.
  ``step`` returns the state after any auto-reset, so the masks of the state it returns are
  those of the observation it returns, the first of a new episode included. Wrappers and
  ``BatchedEnv`` pass it on (``[num_envs, num_actions]`` per agent for a batch).
  ``masks_actions(env)`` tells whether an environment (under any wrappers) has masks; one
  without them (``masks_actions = False``, the default) has every action legal, and its masks
  are all true.

A global state for a centralised critic (SMAX's ``world_state``: every unit, enemies included):

* ``global_state(state, params) -> [*global_state_space(params).shape]``: what the whole
  environment is in ``state`` (one array, the same for every agent, never among the agents'
  observations), for learners that may read more than the agents see (MAPPO's critic).
  ``step`` adds ``info["final_global_state"]``, the global state of the state the transition
  reached before any auto-reset (as ``info["final_observation"]``). Wrappers and
  ``BatchedEnv`` pass it on (``[num_envs, ...]`` for a batch). ``has_global_state(env)``
  tells whether an environment (under any wrappers) offers one; one without it
  (``has_global_state = False``, the default) refuses ``global_state`` with a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ember.envs.environment import Environment
from ember.envs.spaces import Box


def episode_over(terminated, truncated):
    """Whether a step ended the episode: ``terminated | truncated`` for a single-agent
    environment, ``terminated["__all__"] | truncated["__all__"]`` for a multi-agent one
    (flag dicts, whose ``|`` would merge the dicts instead)."""
    if isinstance(terminated, dict):
        return terminated["__all__"] | truncated["__all__"]
    return terminated | truncated


class MultiAgentEnvironment(Environment):
    #: agent names, in a fixed order (set per instance by each environment; an immutable
    #: empty default so no list is shared between instances)
    agents: Sequence[str] = ()

    @property
    def num_agents(self) -> int:
        return len(self.agents)

    #: whether the agents' legal actions change from step to step (``action_masks``)
    masks_actions: bool = False

    #: whether the environment offers ``global_state`` (a centralised critic's input)
    has_global_state: bool = False

    def episode_terminated(self, terminated):
        """``terminated["__all__"]`` of per-agent flags, or the one flag of every agent."""
        return jnp.asarray(terminated["__all__"] if isinstance(terminated, dict) else terminated, jnp.bool_)

    def transition_outputs(self, rewards, terminated, truncated_all):
        """Rewards stay a dict; the end flags become per-agent dicts with ``"__all__"``: the
        episode's for every agent, or, where ``step_env`` gave per-agent ``terminated``, each
        agent's own or the episode's."""
        terminated_all = self.episode_terminated(terminated)
        if isinstance(terminated, dict):
            own = {agent: jnp.asarray(terminated[agent], jnp.bool_) | terminated_all for agent in self.agents}
        else:
            own = {agent: terminated_all for agent in self.agents}
        truncated = {agent: truncated_all for agent in self.agents} | {"__all__": truncated_all}
        return rewards, own | {"__all__": terminated_all}, truncated

    def action_masks(self, state, params) -> dict[str, jax.Array]:
        """``{agent: bool [num_actions]}``: the legal actions of each agent in ``state`` (all of
        them, without masks; agents with discrete actions only)."""
        spaces = self.action_space(params).spaces
        masks = {}
        for agent in self.agents:
            if not hasattr(spaces[agent], "n"):
                raise ValueError(
                    f"{type(self).__name__}.action_masks: agent {agent!r} has no discrete actions "
                    f"({spaces[agent]!r}); masks are for Discrete action spaces"
                )
            masks[agent] = jnp.ones(int(spaces[agent].n), jnp.bool_)
        return masks

    def global_state(self, state, params) -> jax.Array:
        """The global state of ``state``: one array of ``global_state_space(params)``'s shape
        (environments with ``has_global_state`` implement it)."""
        raise ValueError(self._no_global_state("global_state"))

    def global_state_space(self, params) -> Box:
        """The space of ``global_state`` (environments with ``has_global_state`` implement it)."""
        raise ValueError(self._no_global_state("global_state_space"))

    def _no_global_state(self, method: str) -> str:
        return (
            f"{type(self).__name__}.{method}: this environment offers no global state (has_global_state is False); "
            "read the agents' observations instead"
        )

    def final_info(self, next_state, params) -> dict:
        """``info["final_global_state"]`` where the environment offers one."""
        return {"final_global_state": self.global_state(next_state, params)} if self.has_global_state else {}

    def step_env(self, noise, state, actions, params):
        """One transition: ``(obs dict, next_state, rewards dict, terminated (bool, all
        agents), info)``; ``actions`` is a dict already clipped into the action spaces."""
        raise NotImplementedError


def is_multi_agent(env: Environment) -> bool:
    """Whether ``env``, under any wrappers, is a :class:`MultiAgentEnvironment`."""
    return isinstance(getattr(env, "unwrapped", env), MultiAgentEnvironment)


def has_global_state(env: Environment) -> bool:
    """Whether ``env``, under any wrappers, is a multi-agent environment that offers a
    ``global_state`` (whose ``step`` adds ``info["final_global_state"]``)."""
    return is_multi_agent(env) and getattr(env, "unwrapped", env).has_global_state


def masks_actions(env: Environment) -> bool:
    """Whether ``env``, under any wrappers, is a multi-agent environment whose agents' legal
    actions change from step to step (its ``action_masks`` are not all true)."""
    return is_multi_agent(env) and getattr(env, "unwrapped", env).masks_actions


__all__ = ["MultiAgentEnvironment", "episode_over", "has_global_state", "is_multi_agent", "masks_actions"]

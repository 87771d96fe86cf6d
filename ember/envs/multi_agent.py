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
"""

from __future__ import annotations

from collections.abc import Sequence

from ember.envs.environment import Environment


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

    def transition_outputs(self, rewards, terminated_all, truncated_all):
        """Rewards stay a dict; the end flags become per-agent dicts with ``"__all__"``."""
        terminated = {agent: terminated_all for agent in self.agents} | {"__all__": terminated_all}
        truncated = {agent: truncated_all for agent in self.agents} | {"__all__": truncated_all}
        return rewards, terminated, truncated

    def step_env(self, noise, state, actions, params):
        """One transition: ``(obs dict, next_state, rewards dict, terminated (bool, all
        agents), info)``; ``actions`` is a dict already clipped into the action spaces."""
        raise NotImplementedError


def is_multi_agent(env: Environment) -> bool:
    """Whether ``env``, under any wrappers, is a :class:`MultiAgentEnvironment`."""
    return isinstance(getattr(env, "unwrapped", env), MultiAgentEnvironment)


__all__ = ["MultiAgentEnvironment", "episode_over", "is_multi_agent"]

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
"""

from __future__ import annotations

import jax.numpy as jnp

from ember.envs.environment import Environment, select_tree


class MultiAgentEnvironment(Environment):
    #: agent names, in a fixed order
    agents: list[str] = []

    @property
    def num_agents(self) -> int:
        return len(self.agents)

    def step_from_noise(self, noise, state, actions, params):
        transition_noise = noise[: self.transition_noise_words]
        reset_noise = noise[self.transition_noise_words :]
        actions = self.action_space(params).clip(actions)
        obs, next_state, rewards, terminated_all, info = self.step_env(transition_noise, state, actions, params)
        next_state = next_state.replace(time=state.time + 1)
        terminated_all = jnp.asarray(terminated_all, jnp.bool_)
        truncated_all = next_state.time >= params.max_steps_in_episode
        reset_obs, reset_state = self.reset_env(reset_noise, params)
        done = terminated_all | truncated_all
        terminated = {agent: terminated_all for agent in self.agents} | {"__all__": terminated_all}
        truncated = {agent: truncated_all for agent in self.agents} | {"__all__": truncated_all}
        info = {**info, "final_observation": obs}
        return (
            select_tree(done, reset_obs, obs),
            select_tree(done, reset_state, next_state),
            rewards,
            terminated,
            truncated,
            info,
        )

    def step_env(self, noise, state, actions, params):
        """One transition: ``(obs dict, next_state, rewards dict, terminated (bool, all
        agents), info)``; ``actions`` is a dict already clipped into the action spaces."""
        raise NotImplementedError

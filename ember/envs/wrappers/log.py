"""``LogWrapper``: episode statistics in ``info``, usable under ``vmap`` and ``scan``.

For a multi-agent environment (reward dicts, ``ember.envs.multi_agent``) the statistics are
per agent: the return is the episode's rewards averaged over agents (in ``env.agents``
order) and summed over time, and an episode ends with ``terminated/truncated["__all__"]``.

Adds to ``info`` after every step (scalars per environment):
  * ``"returned_episode"`` (bool): this step ended an episode (terminated or truncated) --
    the done mask to average the two statistics below with;
  * ``"returned_episode_returns"`` (float): undiscounted return of the most recently
    finished episode (held until the next one finishes; 0 before the first);
  * ``"returned_episode_lengths"`` (int32): its length in steps;
  * ``"timestep"`` (int32): steps taken since ``reset``, across episodes.

Mean return of the episodes that ended in a rollout:
``(info["returned_episode_returns"] * info["returned_episode"]).sum() / info["returned_episode"].sum()``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ember.envs.environment import EnvState
from ember.envs.multi_agent import episode_over
from ember.envs.wrappers.base import Wrapper, num_envs


@struct.dataclass
class LogEnvState:
    env_state: EnvState
    episode_returns: jax.Array
    episode_lengths: jax.Array
    returned_episode_returns: jax.Array
    returned_episode_lengths: jax.Array
    timestep: jax.Array


class LogWrapper(Wrapper):
    wraps_state = True

    def reset_from_noise(self, noise, params):
        obs, env_state = self.env.reset_from_noise(noise, params)
        # Around a BatchedEnv the statistics are per environment too (scalars grew to [num_envs]
        # at the first step, which broke a lax.scan carry).
        shape = () if num_envs(self.env) is None else (num_envs(self.env),)
        zero_f, zero_i = jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.int32)
        return obs, LogEnvState(env_state, zero_f, zero_i, zero_f, zero_i, zero_i)

    def step_from_noise(self, noise, state, action, params):
        obs, env_state, reward, terminated, truncated, info = self.env.step_from_noise(
            noise, state.env_state, action, params
        )
        done, step_reward = _episode_view(self.env, reward, terminated, truncated)
        episode_return = state.episode_returns + step_reward
        episode_length = state.episode_lengths + 1
        state = LogEnvState(
            env_state=env_state,
            episode_returns=jnp.where(done, 0.0, episode_return),
            episode_lengths=jnp.where(done, 0, episode_length),
            returned_episode_returns=jnp.where(done, episode_return, state.returned_episode_returns),
            returned_episode_lengths=jnp.where(done, episode_length, state.returned_episode_lengths),
            timestep=state.timestep + 1,
        )
        info = {
            **info,
            "returned_episode": done,
            "returned_episode_returns": state.returned_episode_returns,
            "returned_episode_lengths": state.returned_episode_lengths,
            "timestep": state.timestep,
        }
        return obs, state, reward, terminated, truncated, info


def _episode_view(env, reward, terminated, truncated) -> tuple[jax.Array, jax.Array]:
    """``(done, reward)`` of the whole episode: for a multi-agent step, ``"__all__"`` and the
    mean reward over agents (float32)."""
    if isinstance(reward, dict):
        agents = getattr(env, "unwrapped", env).agents
        reward = jnp.stack([reward[agent].astype(jnp.float32) for agent in agents]).mean(axis=0)
    return episode_over(terminated, truncated), reward.astype(jnp.float32)

"""Evaluation: run a policy for N whole episodes in parallel, jitted.

    act = lambda obs, key: policy.apply(params, obs)[0].mode()   # [N, ...] -> actions [N, ...]
    returns, lengths = evaluate(act, env, env_params, key, num_episodes=100)

Each of the ``num_episodes`` environments runs exactly one episode: the scan lasts as long
as the longest time limit of ``env`` (``env_params.max_steps_in_episode``, or a longer
``TimeLimit`` wrapper's: ``ember.envs.wrappers.max_episode_steps``), so every episode ends
by then, and a sub-environment stops counting reward once its first episode has ended
(auto-reset starts a second one, which is ignored). For multi-agent environments (reward
dicts) the return is the mean over agents of their returns, and an episode ends with
``terminated/truncated["__all__"]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ember.envs.batched import BatchedEnv
from ember.envs.multi_agent import episode_over
from ember.envs.wrappers import max_episode_steps


def evaluate(
    act: Callable[[Any, jax.Array], Any],
    env,
    env_params,
    key: jax.Array,
    num_episodes: int,
    *,
    max_steps: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Undiscounted returns and lengths of ``num_episodes`` episodes.

    Args:
      act: ``act(obs, key) -> env_action`` for a batch ``[num_episodes, ...]`` of observations.
      env, env_params: an Ember environment and its parameters (concrete, not traced: the
        episode cap is read from ``env_params.max_steps_in_episode`` and the ``TimeLimit``
        wrappers of ``env``, see ``max_episode_steps``).
      key: PRNG key for resets, the environment and ``act``.
      num_episodes: how many episodes (run side by side).
      max_steps: overrides the episode cap (for environments without a time limit).

    Returns:
      ``(returns, lengths)``: float32 ``[num_episodes]`` and int32 ``[num_episodes]``.
    """
    if not isinstance(num_episodes, int) or num_episodes < 1:
        raise ValueError(f"num_episodes must be a positive integer, got {num_episodes!r}")
    steps = max_episode_steps(env, env_params) if max_steps is None else int(max_steps)
    if steps < 1:
        raise ValueError(f"max_steps must be a positive integer, got {steps}")
    envs = BatchedEnv(env, num_episodes)

    @jax.jit
    def run(key):
        reset_key, key = jax.random.split(key)
        obs, state = envs.reset(reset_key, env_params)

        def step(carry, key):
            obs, state, running, returns, lengths = carry
            act_key, env_key = jax.random.split(key)
            obs, state, reward, terminated, truncated, _ = envs.step(env_key, state, act(obs, act_key), env_params)
            if isinstance(reward, dict):  # multi-agent: the mean over agents of their returns
                reward = jnp.stack(list(reward.values())).mean(axis=0)
            returns = returns + jnp.where(running, reward.astype(jnp.float32), 0.0)
            lengths = lengths + running.astype(jnp.int32)
            running = running & ~episode_over(terminated, truncated)
            return (obs, state, running, returns, lengths), None

        init = (obs, state, jnp.ones(num_episodes, bool), jnp.zeros(num_episodes), jnp.zeros(num_episodes, jnp.int32))
        (_, _, _, returns, lengths), _ = jax.lax.scan(step, init, jax.random.split(key, steps))
        return returns, lengths

    return run(key)


__all__ = ["evaluate"]

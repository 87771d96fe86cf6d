"""Stepping an Ember MinAtar game against the ``minatar`` package with MinAtar's random draws
replayed: before every step our state is set from MinAtar's and our noise words are made to
choose what MinAtar's next ``act`` will draw; observation, reward and termination must match."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from minatar import Environment as MinAtarEnvironment

import ember.envs

TRUE_WORD, FALSE_WORD = 0, 0xFFFFFFFF  # bernoulli(word, p) for any 0 < p < 1


def bernoulli_word(outcome: bool) -> int:
    return TRUE_WORD if outcome else FALSE_WORD


@functools.cache
def jitted_reset(env):
    """``jax.jit(env.reset)``, one per environment: an eager reset compiles op by op, and a
    second ``jax.jit`` of the same method would compile again."""
    return jax.jit(env.reset)


def replay_against_minatar(env_id, game, actions, rng, *, state_from_minatar, replayed_noise, each_step=None):
    """Plays ``actions`` in both; returns ``(total reward, terminations)``. ``each_step(game)``
    sees MinAtar's game before every step (to count what the episode went through).
    ``state_from_minatar(game, template)`` runs every step: it builds host (NumPy) arrays, which
    the jitted step takes as they are (a ``jnp`` array per field is an eager device transfer,
    ~6 ms a step for Seaquest's 48 fields)."""
    env, params = ember.envs.make(env_id, sticky_action_prob=0.0, max_steps_in_episode=100_000)
    step = jax.jit(env.step_from_noise)
    reference = MinAtarEnvironment(game, sticky_action_prob=0.0)
    reference.seed(int(jax.random.randint(rng, (), 0, 2**30)))
    reference.reset()
    _, state = jitted_reset(env)(rng, params)
    total = terminations = 0
    for t, action in enumerate(actions):
        if each_step is not None:
            each_step(reference.env)
        state = state_from_minatar(reference.env, state)
        noise = jnp.asarray(replayed_noise(reference))
        _, state, reward, terminated, _, info = step(noise, state, jnp.int32(action), params)
        expected_reward, expected_terminal = reference.act(int(action))
        np.testing.assert_array_equal(
            info["final_observation"], reference.state().astype(np.float32), err_msg=f"step {t}"
        )
        assert float(reward) == float(expected_reward), f"step {t}"
        assert bool(terminated) == expected_terminal, f"step {t}"
        total += int(expected_reward)
        if expected_terminal:
            terminations += 1
            reference.reset()
    return total, terminations

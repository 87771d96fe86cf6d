"""SpaceInvaders-MinAtar against the MinAtar package: the whole trajectory under random
actions (the game is deterministic), difficulty ramping included; scripted shots by hand."""

import jax
import jax.numpy as jnp
import numpy as np
from minatar import Environment as MinAtarEnvironment

import ember.envs
from tests.envs.minatar_replay import jitted_reset

MINATAR_ACTIONS = [0, 1, 3, 5]  # our 0/1/2/3 (no-op, left, right, fire) in MinAtar's full action set


def test_matches_minatar_space_invaders_step_by_step(rng):
    env, params = ember.envs.make("SpaceInvaders-MinAtar", sticky_action_prob=0.0, max_steps_in_episode=100_000)
    step = jax.jit(env.step)
    reference = MinAtarEnvironment("space_invaders", sticky_action_prob=0.0)
    seed = int(jax.random.randint(rng, (), 0, 2**30))
    reference.seed(seed)
    reference.reset()
    # Mostly fire, so blocks are cleared and the march speeds up.
    actions = np.random.default_rng(seed).choice(4, size=1500, p=[0.1, 0.2, 0.2, 0.5])
    obs, state = jitted_reset(env)(rng, params)
    np.testing.assert_array_equal(obs, reference.state().astype(np.float32))
    kills = terminations = 0
    for t, action in enumerate(actions):
        obs, state, reward, terminated, _, info = step(jax.random.fold_in(rng, t), state, jnp.int32(action), params)
        expected_reward, expected_terminal = reference.act(MINATAR_ACTIONS[action])
        np.testing.assert_array_equal(
            info["final_observation"], reference.state().astype(np.float32), err_msg=f"step {t}"
        )
        assert float(reward) == float(expected_reward), f"step {t}"
        assert bool(terminated) == expected_terminal, f"step {t}"
        kills += int(expected_reward)
        if expected_terminal:
            terminations += 1
            reference.reset()
            np.testing.assert_array_equal(obs, reference.state().astype(np.float32), err_msg=f"reset at {t}")
    assert kills >= 24 and terminations >= 1, (kills, terminations)


def test_scripted_shot_kills_an_alien():
    env, params = ember.envs.make("SpaceInvaders-MinAtar", sticky_action_prob=0.0)
    step = jax.jit(env.step)
    _, state = jitted_reset(env)(jax.random.key(0), params)
    aliens = jnp.zeros((10, 10), bool).at[5, 3].set(True)
    state = state.replace(position=jnp.int32(3), aliens=aliens, alien_move_timer=jnp.int32(50),
                          alien_shot_timer=jnp.int32(50))  # fmt: skip
    _, state, reward, _, _, _ = step(jax.random.key(1), state, jnp.int32(3), params)  # fire: the bullet is at row 8
    assert int(state.shot_timer) == 4 and bool(state.friendly_bullets[8, 3]) and float(reward) == 0.0
    total = 0.0
    for _ in range(3):  # rows 7, 6, 5: the third step meets the alien
        _, state, reward, _, _, _ = step(jax.random.key(1), state, jnp.int32(0), params)
        total += float(reward)
    assert total == 1.0 and not bool(state.friendly_bullets.any())
    assert bool(state.aliens[0:4, 2:8].all()) and int(state.move_interval) == 11  # a new, faster block

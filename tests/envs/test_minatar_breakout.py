"""Breakout-MinAtar against the MinAtar package (same states and actions) and in scripted
scenarios with hand-computed outcomes."""

import jax
import jax.numpy as jnp
import numpy as np
from minatar import Environment as MinAtarEnvironment

import ember.envs
from tests.envs.minatar_replay import FALSE_WORD, TRUE_WORD, jitted_reset
from tests.tolerances import assert_allclose

MINATAR_ACTIONS = [0, 1, 3]  # our 0/1/2 (no-op, left, right) in MinAtar's full action set


def state_from_minatar(game, template):
    return template.replace(
        ball_x=np.int32(game.ball_x),
        ball_y=np.int32(game.ball_y),
        ball_dir=np.int32(game.ball_dir),
        paddle_x=np.int32(game.pos),
        bricks=np.asarray(game.brick_map == 1),
        strike=np.asarray(game.strike),
        last_x=np.int32(game.last_x),
        last_y=np.int32(game.last_y),
    )


def test_matches_minatar_breakout_step_by_step(rng):
    env, params = ember.envs.make("Breakout-MinAtar", sticky_action_prob=0.0)
    step = jax.jit(env.step)
    reference = MinAtarEnvironment("breakout", sticky_action_prob=0.0)
    seed = int(jax.random.randint(rng, (), 0, 2**30))
    reference.seed(seed)
    reference.reset()
    actions = np.random.default_rng(seed).integers(0, 3, size=400)
    _, state = jitted_reset(env)(rng, params)
    rewards = terminations = 0
    for t, action in enumerate(actions):
        state = state_from_minatar(reference.env, state)
        _, state, reward, terminated, _, info = step(jax.random.fold_in(rng, t), state, jnp.int32(action), params)
        expected_reward, expected_terminal = reference.act(MINATAR_ACTIONS[action])
        np.testing.assert_array_equal(
            info["final_observation"], reference.state().astype(np.float32), err_msg=f"step {t}"
        )
        assert_allclose(reward, float(expected_reward), err_msg=f"step {t}")
        assert bool(terminated) == expected_terminal, f"step {t}"
        rewards += expected_reward
        if expected_terminal:
            terminations += 1
            reference.reset()
    assert terminations >= 3 and rewards >= 3, "the random policy should break bricks and lose balls"


def scripted(env, params, **fields):
    _, state = jitted_reset(env)(jax.random.key(0), params)
    return state.replace(**{name: jnp.asarray(value) for name, value in fields.items()})


def test_scripted_wall_brick_paddle_and_loss():
    env, params = ember.envs.make("Breakout-MinAtar", sticky_action_prob=0.0)
    no_op = jnp.int32(0)
    key = jax.random.key(1)

    # Wall: ball at the right edge moving up-right bounces to up-left, stays in column 9.
    state = scripted(env, params, ball_x=9, ball_y=6, ball_dir=1, bricks=jnp.zeros((10, 10), bool))
    _, state, reward, terminated, _, _ = env.step(key, state, no_op, params)
    assert (int(state.ball_x), int(state.ball_y), int(state.ball_dir)) == (9, 5, 0)
    assert float(reward) == 0.0 and not bool(terminated)

    # Brick: ball below the brick rows moving up-left breaks brick (row 3, column 4),
    # scores 1, stays on its row and turns down-left.
    state = scripted(env, params, ball_x=5, ball_y=4, ball_dir=0)
    _, state, reward, terminated, _, _ = env.step(key, state, no_op, params)
    assert float(reward) == 1.0 and not bool(state.bricks[3, 4]) and int(state.bricks.sum()) == 29
    assert (int(state.ball_x), int(state.ball_y), int(state.ball_dir)) == (4, 4, 3)

    # Paddle under the ball: ball at (row 8, column 3) moving down-right, paddle at 3 ->
    # bounces straight back up (down-right -> up-right), stays on row 8.
    state = scripted(env, params, ball_x=3, ball_y=8, ball_dir=2, paddle_x=3)
    _, state, reward, terminated, _, _ = env.step(key, state, no_op, params)
    assert (int(state.ball_y), int(state.ball_dir)) == (8, 1) and not bool(terminated)

    # Ball missed: paddle far away -> episode terminates with reward 0 and auto-resets.
    state = scripted(env, params, ball_x=3, ball_y=8, ball_dir=2, paddle_x=8)
    _obs, state, reward, terminated, _, info = env.step(key, state, no_op, params)
    assert bool(terminated) and float(reward) == 0.0
    assert float(info["final_observation"][9, 4, 1]) == 1.0, "the lost ball reached the bottom row"
    assert int(state.ball_y) == 3 and int(state.time) == 0 and int(state.bricks.sum()) == 30


def test_sticky_actions_repeat_the_previous_action(rng):
    env, params = ember.envs.make("Breakout-MinAtar", sticky_action_prob=1.0)
    _, state = jitted_reset(env)(rng, params)
    for t in range(3):  # always sticky: the first action (no-op) repeats, the paddle never moves
        _, state, *_ = env.step(jax.random.fold_in(rng, t), state, jnp.int32(2), params)
    assert int(state.paddle_x) == 4
    env, params = ember.envs.make("Breakout-MinAtar", sticky_action_prob=0.0)
    _, state = jitted_reset(env)(rng, params)
    for t in range(3):
        _, state, *_ = env.step(jax.random.fold_in(rng, t), state, jnp.int32(2), params)
    assert int(state.paddle_x) == 7


def test_the_last_action_outlives_an_episode_as_in_minatar():
    # MinAtar's Environment.reset() keeps last_action: a sticky first step repeats the previous
    # episode's last action. Before, the auto-reset set it to 0, so that step was a no-op.
    reference = MinAtarEnvironment("breakout", sticky_action_prob=0.0)
    reference.reset()
    reference.act(MINATAR_ACTIONS[2])
    reference.reset()
    assert reference.last_action == MINATAR_ACTIONS[2]

    env, params = ember.envs.make("Breakout-MinAtar", sticky_action_prob=0.5)
    step = jax.jit(env.step_from_noise)
    # The paddle moves right (not sticky) and misses the ball: the episode ends and restarts.
    state = scripted(env, params, ball_x=3, ball_y=8, ball_dir=2, paddle_x=6)
    _, state, _, terminated, _, _ = step(np.uint32([FALSE_WORD, 0]), state, jnp.int32(2), params)
    assert bool(terminated) and int(state.time) == 0 and int(state.paddle_x) == 4
    # A sticky first step repeats "right": the paddle goes 4 -> 5 although no-op was chosen.
    _, state, *_ = step(np.uint32([TRUE_WORD, 0]), state, jnp.int32(0), params)
    assert int(state.paddle_x) == 5 and int(state.last_action) == 2

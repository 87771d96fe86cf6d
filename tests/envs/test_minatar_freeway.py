"""Freeway-MinAtar against the MinAtar package (same states and actions), and scripted
crossings, hits and the time limit with hand-computed outcomes."""

import jax
import jax.numpy as jnp
import numpy as np
from minatar import Environment as MinAtarEnvironment

import ember.envs
from tests.envs.minatar_replay import jitted_reset

MINATAR_ACTIONS = [0, 2, 4]  # our 0/1/2 (no-op, up, down) in MinAtar's full action set


def state_from_minatar(game, template):
    cars = np.asarray(game.cars)
    return template.replace(
        position=np.int32(game.pos),
        move_timer=np.int32(game.move_timer),
        terminate_timer=np.int32(game.terminate_timer),
        car_x=np.asarray(cars[:, 0], np.int32),
        car_timer=np.asarray(cars[:, 2], np.int32),
        car_speed=np.asarray(cars[:, 3], np.int32),
    )


def test_matches_minatar_freeway_step_by_step(rng):
    env, params = ember.envs.make("Freeway-MinAtar", sticky_action_prob=0.0)
    step = jax.jit(env.step)
    reference = MinAtarEnvironment("freeway", sticky_action_prob=0.0)
    seed = int(jax.random.randint(rng, (), 0, 2**30))
    reference.seed(seed)
    reference.reset()
    # Mostly up, so the chicken crosses (and new speeds are drawn) as well as gets hit.
    actions = np.random.default_rng(seed).choice(3, size=600, p=[0.2, 0.7, 0.1])
    _, state = jitted_reset(env)(rng, params)
    crossings = hits = 0
    for t, action in enumerate(actions):
        state = state_from_minatar(reference.env, state)
        before = int(reference.env.pos)
        _, state, reward, terminated, _, info = step(jax.random.fold_in(rng, t), state, jnp.int32(action), params)
        expected_reward, expected_terminal = reference.act(MINATAR_ACTIONS[action])
        expected = reference.state().astype(np.float32)
        observed = np.asarray(info["final_observation"])
        if expected_reward:  # a crossing draws new speeds: each side its own draw, so only the trails differ
            crossings += 1
            np.testing.assert_array_equal(observed[..., :2], expected[..., :2], err_msg=f"step {t}")
        else:
            np.testing.assert_array_equal(observed, expected, err_msg=f"step {t}")
            hits += int(reference.env.pos == 9 and before < 9 and action != 2)
        assert float(reward) == float(expected_reward), f"step {t}"
        assert bool(terminated) == expected_terminal, f"step {t}"
    assert crossings >= 1 and hits >= 1, (crossings, hits)


def scripted(env, params, **fields):
    _, state = jitted_reset(env)(jax.random.key(0), params)
    return state.replace(**{name: jnp.asarray(value, np.int32) for name, value in fields.items()})


def test_scripted_crossing_hit_and_time_limit():
    env, params = ember.envs.make("Freeway-MinAtar", sticky_action_prob=0.0)
    step = jax.jit(env.step)
    key = jax.random.key(1)
    far = dict(car_x=[0] * 8, car_timer=[3] * 8, car_speed=[5, -5, 5, -5, 5, -5, 5, -5])
    # One row below the top and free to move: up reaches row 0, scores, returns to row 9.
    state = scripted(env, params, position=1, move_timer=0, **far)
    _, state, reward, terminated, _, _ = step(key, state, jnp.int32(1), params)
    assert float(reward) == 1.0 and int(state.position) == 9 and not bool(terminated)
    assert int(state.move_timer) == 2  # set to 3 by the move, then one step passes
    # The move timer blocks a move: the chicken stays.
    state = scripted(env, params, position=5, move_timer=2, **far)
    _, state, _, _, _, _ = step(key, state, jnp.int32(1), params)
    assert int(state.position) == 5 and int(state.move_timer) == 1
    # Car 3 (row 4) sits at column 3 and moves right this step onto the chicken's column: hit.
    cars = dict(car_x=[0, 0, 0, 3, 0, 0, 0, 0], car_timer=[3, 3, 3, 0, 3, 3, 3, 3], car_speed=[5, 5, 5, 2, 5, 5, 5, 5])
    state = scripted(env, params, position=4, move_timer=1, **cars)
    _, state, reward, _, _, _ = step(key, state, jnp.int32(0), params)
    assert int(state.position) == 9 and float(reward) == 0.0
    assert int(state.car_x[3]) == 4 and int(state.car_timer[3]) == 2
    # The 2500-step limit terminates (a MinAtar terminal state, not a truncation).
    state = scripted(env, params, position=9, terminate_timer=0, **far)
    _, _, _, terminated, truncated, _ = step(key, state, jnp.int32(0), params)
    assert bool(terminated) and not bool(truncated)

"""Asterix-MinAtar against the MinAtar package step for step, its random spawns included:
MinAtar's draws are replayed from a copy of its random state and handed to ours as noise
words that make the same choices; and scripted gold, enemy and ramping by hand."""

import jax
import jax.numpy as jnp
import numpy as np

import ember.envs
from tests.envs.minatar_replay import FALSE_WORD, bernoulli_word, jitted_reset, replay_against_minatar

# Actions 0-4 (no-op, left, up, right, down) are MinAtar's first five.


def state_from_minatar(game, template):
    entities = [e if e is not None else [0, i + 1, False, False] for i, e in enumerate(game.entities)]
    return template.replace(
        player_x=np.int32(game.player_x),
        player_y=np.int32(game.player_y),
        active=np.asarray([e is not None for e in game.entities]),
        entity_x=np.asarray([e[0] for e in entities], np.int32),
        moving_right=np.asarray([bool(e[2]) for e in entities]),
        gold=np.asarray([bool(e[3]) for e in entities]),
        spawn_timer=np.int32(game.spawn_timer),
        spawn_interval=np.int32(game.spawn_speed),
        move_timer=np.int32(game.move_timer),
        move_interval=np.int32(game.move_speed),
        ramp_timer=np.int32(game.ramp_timer),
        ramp_index=np.int32(game.ramp_index),
    )


def replayed_noise(reference) -> np.ndarray:
    """The 4 transition words making our step choose what MinAtar's next ``act`` will draw:
    no sticky action, then (when it spawns) the side, gold or not, and the free lane."""
    replay = np.random.RandomState()
    replay.set_state(reference.random.get_state())
    replay.rand()  # the wrapper's sticky-action draw
    words = [FALSE_WORD, FALSE_WORD, FALSE_WORD, 0]
    if reference.env.spawn_timer == 0:
        words[1] = bernoulli_word(replay.rand() < 1 / 2)
        words[2] = bernoulli_word(replay.rand() < 1 / 3)
        free = [i for i, e in enumerate(reference.env.entities) if e is None]
        words[3] = replay.randint(len(free)) if free else 0
    return np.asarray(words, np.uint32)


def test_matches_minatar_asterix_step_by_step(rng):
    actions = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**30))).integers(0, 5, size=1500)
    golds, terminations = replay_against_minatar(
        "Asterix-MinAtar", "asterix", actions, rng, state_from_minatar=state_from_minatar, replayed_noise=replayed_noise
    )
    assert golds >= 1 and terminations >= 3, (golds, terminations)


def test_scripted_gold_enemy_and_ramp():
    env, params = ember.envs.make("Asterix-MinAtar", sticky_action_prob=0.0)
    step = jax.jit(env.step)
    _, state = jitted_reset(env)(jax.random.key(0), params)
    lanes = jnp.zeros(8, bool)
    # Gold one cell right of the player in its lane: moving right collects it.
    state = state.replace(active=lanes.at[4].set(True), entity_x=jnp.full(8, 6, jnp.int32), gold=lanes.at[4].set(True),
                          moving_right=lanes, spawn_timer=jnp.int32(5), move_timer=jnp.int32(3))  # fmt: skip
    _, state, reward, terminated, _, _ = step(jax.random.key(1), state, jnp.int32(3), params)
    assert float(reward) == 1.0 and not bool(terminated) and not bool(state.active[4])
    # An enemy moving onto the player terminates.
    state = state.replace(player_x=jnp.int32(5), active=lanes.at[4].set(True), entity_x=jnp.full(8, 4, jnp.int32),
                          gold=lanes, moving_right=lanes.at[4].set(True), move_timer=jnp.int32(0))  # fmt: skip
    _, _, reward, terminated, _, _ = step(jax.random.key(1), state, jnp.int32(0), params)
    assert bool(terminated) and float(reward) == 0.0
    # The ramp: past its timer, the spawn interval shortens (the move interval on odd ramps only).
    _, state = jitted_reset(env)(jax.random.key(0), params)
    state = state.replace(ramp_timer=jnp.int32(-1), ramp_index=jnp.int32(1))
    _, state, _, _, _, _ = step(jax.random.key(1), state, jnp.int32(0), params)
    assert (int(state.spawn_interval), int(state.move_interval), int(state.ramp_index)) == (9, 4, 2)
    assert int(state.ramp_timer) == 100

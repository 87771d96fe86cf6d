"""Seaquest-MinAtar against the MinAtar package step for step, its random spawns included:
MinAtar's draws are replayed from a copy of its random state and handed to ours as noise
words that make the same choices; and a scripted surfacing with six divers."""

import jax
import jax.numpy as jnp
import numpy as np

import ember.envs
from ember.envs.minatar.seaquest import SLOTS, Entities
from tests.envs.minatar_replay import FALSE_WORD, bernoulli_word, jitted_reset, replay_against_minatar


def entities_from_list(items, slots, *, timer=3, shot=None):
    """A MinAtar list as our slots, list position = insertion order."""
    fields = {name: np.zeros(slots, np.int32) for name in ("x", "y", "timer", "shot", "order")}
    right, active = np.zeros(slots, bool), np.zeros(slots, bool)
    for index, item in enumerate(items):
        fields["x"][index], fields["y"][index], right[index] = item[0], item[1], bool(item[2])
        fields["timer"][index] = item[timer] if timer is not None else 0
        fields["shot"][index] = item[shot] if shot is not None else 0
        fields["order"][index], active[index] = index, True
    return Entities(right=right, active=active, **fields)


def state_from_minatar(game, template):
    lists = {
        "player_bullets": entities_from_list(game.f_bullets, SLOTS["player_bullets"], timer=None),
        "enemy_bullets": entities_from_list(game.e_bullets, SLOTS["enemy_bullets"], timer=None),
        "fish": entities_from_list(game.e_fish, SLOTS["fish"]),
        "subs": entities_from_list(game.e_subs, SLOTS["subs"], shot=4),
        "divers": entities_from_list(game.divers, SLOTS["divers"]),
    }
    return template.replace(
        sub_x=np.int32(game.sub_x),
        sub_y=np.int32(game.sub_y),
        sub_right=np.bool_(game.sub_or),
        oxygen=np.int32(game.oxygen),
        divers_held=np.int32(game.diver_count),
        surfaced=np.bool_(game.surface),
        shot_timer=np.int32(game.shot_timer),
        spawn_interval=np.int32(game.e_spawn_speed),
        spawn_timer=np.int32(game.e_spawn_timer),
        diver_timer=np.int32(game.d_spawn_timer),
        move_interval=np.int32(game.move_speed),
        ramp_index=np.int32(game.ramp_index),
        counter=np.int32(64),
        **lists,
    )


def replayed_noise(reference) -> np.ndarray:
    """The 6 transition words making our step choose what MinAtar's next ``act`` will draw:
    no sticky action, then the enemy spawn's side, kind and row, then the diver's side and row."""
    replay = np.random.RandomState()
    replay.set_state(reference.random.get_state())
    replay.rand()  # the wrapper's sticky-action draw
    words = [FALSE_WORD, FALSE_WORD, FALSE_WORD, 0, FALSE_WORD, 0]
    if reference.env.e_spawn_timer == 0:
        words[1] = bernoulli_word(replay.rand() < 1 / 2)
        words[2] = bernoulli_word(replay.rand() < 1 / 3)
        words[3] = replay.randint(low=1, high=9) - 1
    if reference.env.d_spawn_timer == 0:
        words[4] = bernoulli_word(replay.rand() < 1 / 2)
        words[5] = replay.randint(low=1, high=9) - 1
    return np.asarray(words, np.uint32)


def test_matches_minatar_seaquest_step_by_step(rng):
    # Mostly fire and stay low (enemies to shoot), sometimes surface: rewards and every kind of ending.
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**30)))
    actions = generator.choice(6, size=2000, p=[0.1, 0.15, 0.1, 0.15, 0.2, 0.3])
    most_enemies = []
    rewards, terminations = replay_against_minatar(
        "Seaquest-MinAtar", "seaquest", actions, rng,
        state_from_minatar=state_from_minatar, replayed_noise=replayed_noise,
        each_step=lambda game: most_enemies.append(len(game.e_fish) + len(game.e_subs)),
    )  # fmt: skip
    assert rewards >= 3 and terminations >= 5 and max(most_enemies) >= 3, (rewards, terminations, max(most_enemies))


def test_surfacing_with_six_divers_pays_for_oxygen_and_ramps():
    env, params = ember.envs.make("Seaquest-MinAtar", sticky_action_prob=0.0)
    step = jax.jit(env.step)
    _, state = jitted_reset(env)(jax.random.key(0), params)
    state = state.replace(sub_y=jnp.int32(1), surfaced=jnp.bool_(False), divers_held=jnp.int32(6),
                          oxygen=jnp.int32(150), ramp_index=jnp.int32(1))  # fmt: skip
    _, state, reward, terminated, _, _ = step(jax.random.key(1), state, jnp.int32(2), params)  # up
    assert float(reward) == 150 * 10 // 200 and not bool(terminated)
    # MinAtar's count after a full surfacing: reset to 0, then one diver dropped, -1.
    assert (int(state.divers_held), int(state.oxygen), bool(state.surfaced)) == (-1, 200, True)
    assert (int(state.spawn_interval), int(state.move_interval), int(state.ramp_index)) == (19, 4, 2)
    # Surfacing with no diver ends the episode.
    _, state = jitted_reset(env)(jax.random.key(0), params)
    state = state.replace(sub_y=jnp.int32(1), surfaced=jnp.bool_(False))
    _, _, _, terminated, _, _ = step(jax.random.key(1), state, jnp.int32(2), params)
    assert bool(terminated)

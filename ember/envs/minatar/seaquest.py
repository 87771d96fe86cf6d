"""``Seaquest-MinAtar``: MinAtar's Seaquest rules on a 10x10 grid.

The player's submarine (front and back cells, so its heading shows) moves in rows 0-8 and
fires bullets ahead (one every 6 steps). Enemy fish and submarines enter rows 1-8 from
either side (every ``spawn speed`` steps, a sub with probability 1/3, not into a row where
an enemy moves the other way) and move one cell every ``move speed`` steps; enemy subs
shoot every 11 steps. Divers enter every 31 steps and move every 6. A bullet that hits an
enemy gives +1 and removes both. Touching a diver picks it up (at most 6). Oxygen (200)
drops by one per step below the surface; surfacing with divers refills it and drops one
diver, surfacing with all 6 gives ``oxygen * 10 // 200`` and clears them, and each surfacing
ramps the difficulty (faster spawns, and every other time faster enemies). Touching an
enemy or an enemy bullet, running out of oxygen, or surfacing with no diver terminates.
``sticky_action_prob`` (MinAtar's default 0.1; 0 disables) repeats the previous action.
Truncated at 1000 steps (gymnax's limit; MinAtar itself has none).

MinAtar keeps its bullets, enemies and divers in Python lists, iterated newest first and
searched oldest first, and those orders decide which of two bullets hits an enemy. Here each
kind is a fixed number of slots with an insertion counter that gives the same orders, so
the game is step for step MinAtar's (including its quirks: a sub that is removed still fires
that step, and surfacing with 6 divers leaves the count at -1). More live entities of a kind
than its slots (never seen in play) are not spawned.

Observation float32 ``[10, 10, 10]`` of 0/1, channels (sub front, sub back, friendly bullet,
trail, enemy bullet, enemy fish, enemy sub, oxygen gauge, diver gauge, diver). Actions 0-5:
no-op, left, up, right, down, fire.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ember.envs import noise as noise_lib
from ember.envs import rendering
from ember.envs.environment import EnvParams, EnvState, select_tree
from ember.envs.minatar.sticky_actions import StickyActionEnvironment, sticky_action
from ember.envs.spaces import Box, Discrete

GRID = 10
MAX_OXYGEN = 200
INITIAL_SPAWN_INTERVAL = 20
DIVER_SPAWN_INTERVAL = 30
INITIAL_MOVE_INTERVAL = 5
SHOT_COOL_DOWN = 5
ENEMY_SHOT_INTERVAL = 10
DIVER_MOVE_INTERVAL = 5
MAX_DIVERS = 6
CHANNELS = 10
SLOTS = {"player_bullets": 4, "enemy_bullets": 24, "fish": 24, "subs": 16, "divers": 8}
NOOP, LEFT, UP, RIGHT, DOWN, FIRE = range(6)


@struct.dataclass
class Entities:
    """One MinAtar list as slots: ``[slots]`` arrays. ``order`` is the insertion counter (list
    position = rank of ``order`` among active slots); ``timer`` counts down to the next move,
    ``shot`` to an enemy sub's next shot (unused for the other kinds)."""

    x: jax.Array
    y: jax.Array
    right: jax.Array
    timer: jax.Array
    shot: jax.Array
    active: jax.Array
    order: jax.Array

    @classmethod
    def empty(cls, slots: int) -> Entities:
        zeros = jnp.zeros(slots, jnp.int32)
        return cls(zeros, zeros, jnp.zeros(slots, bool), zeros, zeros, jnp.zeros(slots, bool), zeros)

    def set(self, slot: jax.Array, when: jax.Array, **values: jax.Array) -> Entities:
        """These entities with fields ``values`` of ``slot`` replaced where ``when``."""
        hit = when & (jnp.arange(self.x.shape[0]) == slot)
        return self.replace(**{k: jnp.where(hit, jnp.asarray(v, getattr(self, k).dtype), getattr(self, k))
                               for k, v in values.items()})  # fmt: skip

    def first_at(self, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(found, slot)``: the oldest active entity on cell ``(x, y)``."""
        here = self.active & (self.x == x) & (self.y == y)
        return here.any(), jnp.argmin(jnp.where(here, self.order, jnp.iinfo(jnp.int32).max))

    def newest_first(self) -> jax.Array:
        """Slots in MinAtar's ``reversed(list)`` order: active ones newest first, then the rest."""
        return jnp.argsort(jnp.where(self.active, -self.order, jnp.iinfo(jnp.int32).max))


@struct.dataclass
class SeaquestState(EnvState):
    sub_x: jax.Array
    sub_y: jax.Array
    sub_right: jax.Array
    oxygen: jax.Array
    divers_held: jax.Array
    surfaced: jax.Array
    shot_timer: jax.Array
    spawn_interval: jax.Array
    spawn_timer: jax.Array
    diver_timer: jax.Array
    move_interval: jax.Array
    ramp_index: jax.Array
    counter: jax.Array  # insertion orders handed out so far
    player_bullets: Entities
    enemy_bullets: Entities
    fish: Entities
    subs: Entities
    divers: Entities
    last_action: jax.Array


@struct.dataclass
class SeaquestParams(EnvParams):
    max_steps_in_episode: int = 1000
    sticky_action_prob: float = 0.1
    ramping: bool = True


def append(state: SeaquestState, kind: str, when: jax.Array, **values: jax.Array) -> SeaquestState:
    """``state`` with a new newest entity of ``kind`` (in the first free slot) where ``when``."""
    entities = getattr(state, kind)
    free = ~entities.active
    when = when & free.any()
    slot = jnp.argmax(free)
    defaults = {"timer": 0, "shot": 0}
    entities = entities.set(slot, when, **{**defaults, **values}, active=True, order=state.counter)
    return state.replace(**{kind: entities}, counter=state.counter + when)


def heading(right: jax.Array) -> jax.Array:
    return jnp.where(right, 1, -1)


def spawn_enemy(state: SeaquestState, noise: jax.Array) -> SeaquestState:
    """MinAtar's ``_spawn_enemy`` from 3 words (side, sub or fish, row): nothing when an enemy
    in that row moves the other way."""
    from_left = noise_lib.bernoulli(noise[0], 0.5)
    is_sub = noise_lib.bernoulli(noise[1], 1.0 / 3.0)
    row = noise_lib.randint(noise[2], 1, GRID - 1)
    enemies = (state.fish, state.subs)
    clash = jnp.stack([(e.active & (e.y == row) & (e.right != from_left)).any() for e in enemies]).any()
    x = jnp.where(from_left, 0, GRID - 1)
    values = dict(x=x, y=row, right=from_left, timer=state.move_interval)
    state = append(state, "subs", ~clash & is_sub, **values, shot=ENEMY_SHOT_INTERVAL)
    return append(state, "fish", ~clash & ~is_sub, **values)


def spawn_diver(state: SeaquestState, noise: jax.Array) -> SeaquestState:
    """MinAtar's ``_spawn_diver`` from 2 words (side, row)."""
    from_left = noise_lib.bernoulli(noise[0], 0.5)
    row = noise_lib.randint(noise[1], 1, GRID - 1)
    x = jnp.where(from_left, 0, GRID - 1)
    return append(state, "divers", jnp.bool_(True), x=x, y=row, right=from_left, timer=DIVER_MOVE_INTERVAL)


def move_player(state: SeaquestState, action: jax.Array) -> SeaquestState:
    fire = (action == FIRE) & (state.shot_timer == 0)
    state = append(state, "player_bullets", fire, x=state.sub_x, y=state.sub_y, right=state.sub_right)
    return state.replace(
        shot_timer=jnp.where(fire, SHOT_COOL_DOWN, state.shot_timer),
        sub_x=jnp.clip(state.sub_x + (action == RIGHT) - (action == LEFT), 0, GRID - 1),
        sub_y=jnp.clip(state.sub_y + (action == DOWN) - (action == UP), 0, GRID - 2),
        sub_right=jnp.where(action == LEFT, False, jnp.where(action == RIGHT, True, state.sub_right)),
    )


def newest_first_loop(state: SeaquestState, kind: str, touches: tuple[str, ...], body, carry):
    """Runs ``body(slot, state, carry) -> (state, carry)`` over ``kind``'s active slots, newest
    first (MinAtar's ``for e in reversed(list)``); ``body`` changes only the fields ``touches``
    names, the only ones the loop carries (under ``vmap`` every carried array is selected per
    iteration). Only the current entity ever leaves its own list in a pass, so the first
    ``count`` slots of the order are exactly the live ones, and the loop runs as long as the
    fullest list of the batch needs, not over every slot."""
    entities = getattr(state, kind)
    slots, count = entities.newest_first(), entities.active.sum()

    def one(loop):
        index, fields, carry = loop
        new_state, carry = body(slots[index], state.replace(**fields), carry)
        return index + 1, {name: getattr(new_state, name) for name in touches}, carry

    fields = {name: getattr(state, name) for name in touches}
    _, fields, carry = jax.lax.while_loop(lambda loop: loop[0] < count, one, (jnp.int32(0), fields, carry))
    return state.replace(**fields), carry


def player_bullets_step(state: SeaquestState, reward: jax.Array) -> tuple[SeaquestState, jax.Array]:
    """Each bullet moves; off the grid it goes, else it hits the oldest fish, else the oldest sub, there."""

    def body(slot, state, reward):
        bullets = state.player_bullets
        x, y = bullets.x[slot] + heading(bullets.right[slot]), bullets.y[slot]
        inside = (x >= 0) & (x < GRID)
        on_fish, fish_slot = state.fish.first_at(x, y)
        on_sub, sub_slot = state.subs.first_at(x, y)
        hit_fish = inside & on_fish
        hit_sub = inside & ~on_fish & on_sub
        state = state.replace(
            player_bullets=bullets.set(slot, jnp.bool_(True), x=x, active=inside & ~hit_fish & ~hit_sub),
            fish=state.fish.set(fish_slot, hit_fish, active=False),
            subs=state.subs.set(sub_slot, hit_sub, active=False),
        )
        return state, reward + hit_fish + hit_sub

    return newest_first_loop(state, "player_bullets", ("player_bullets", "fish", "subs"), body, reward)


def divers_step(state: SeaquestState) -> SeaquestState:
    def body(slot, state, _):
        divers = state.divers
        picked_here = (
            (divers.x[slot] == state.sub_x) & (divers.y[slot] == state.sub_y) & (state.divers_held < MAX_DIVERS)
        )
        moving = ~picked_here & (divers.timer[slot] == 0)
        x = divers.x[slot] + jnp.where(moving, heading(divers.right[slot]), 0)
        inside = (x >= 0) & (x < GRID)
        picked_after = (
            moving & inside & (x == state.sub_x) & (divers.y[slot] == state.sub_y) & (state.divers_held < MAX_DIVERS)
        )
        picked = picked_here | picked_after
        timer = jnp.where(moving, DIVER_MOVE_INTERVAL, divers.timer[slot] - 1)
        divers = divers.set(slot, jnp.bool_(True), x=x, timer=timer, active=~picked & inside)
        return state.replace(divers=divers, divers_held=state.divers_held + picked), None

    return newest_first_loop(state, "divers", ("divers", "divers_held"), body, None)[0]


def enemies_step(state: SeaquestState, kind: str, reward: jax.Array, dead: jax.Array):
    """Enemy ``kind`` (``fish`` or ``subs``) moves, newest first: touching the player ends the
    episode; moving onto the oldest player bullet there removes both (+1). Subs also fire."""

    def body(slot, state, carry):
        reward, dead = carry
        enemies = getattr(state, kind)
        at_player = lambda x: (x == state.sub_x) & (enemies.y[slot] == state.sub_y)  # noqa: E731
        dead = dead | at_player(enemies.x[slot])
        moving = enemies.timer[slot] == 0
        x = enemies.x[slot] + jnp.where(moving, heading(enemies.right[slot]), 0)
        inside = (x >= 0) & (x < GRID)
        dead = dead | (moving & inside & at_player(x))
        on_bullet, bullet_slot = state.player_bullets.first_at(x, enemies.y[slot])
        shot_down = moving & inside & ~at_player(x) & on_bullet
        timer = jnp.where(moving, state.move_interval, enemies.timer[slot] - 1)
        enemies = enemies.set(slot, jnp.bool_(True), x=x, timer=timer, active=~(moving & ~inside) & ~shot_down)
        state = state.replace(
            **{kind: enemies}, player_bullets=state.player_bullets.set(bullet_slot, shot_down, active=False)
        )
        if kind == "subs":  # fires whether or not it just left the list, from where it is now
            firing = enemies.shot[slot] == 0
            shot = jnp.where(firing, ENEMY_SHOT_INTERVAL, enemies.shot[slot] - 1)
            state = state.replace(subs=state.subs.set(slot, jnp.bool_(True), shot=shot))
            state = append(state, "enemy_bullets", firing, x=x, y=enemies.y[slot], right=enemies.right[slot])
        return state, (reward + shot_down, dead)

    touches = (kind, "player_bullets", "enemy_bullets", "counter") if kind == "subs" else (kind, "player_bullets")
    return newest_first_loop(state, kind, touches, body, (reward, dead))


def enemy_bullets_step(state: SeaquestState, dead: jax.Array) -> tuple[SeaquestState, jax.Array]:
    def body(slot, state, dead):
        bullets = state.enemy_bullets
        at_player = lambda x: (x == state.sub_x) & (bullets.y[slot] == state.sub_y)  # noqa: E731
        dead = dead | at_player(bullets.x[slot])
        x = bullets.x[slot] + heading(bullets.right[slot])
        inside = (x >= 0) & (x < GRID)
        dead = dead | (inside & at_player(x))
        return state.replace(enemy_bullets=bullets.set(slot, jnp.bool_(True), x=x, active=inside)), dead

    return newest_first_loop(state, "enemy_bullets", ("enemy_bullets",), body, dead)


def surface_and_oxygen(state: SeaquestState, reward, dead, params) -> tuple[SeaquestState, jax.Array, jax.Array]:
    """The timers, oxygen, and surfacing (MinAtar's ``_surface`` and the end of ``act``)."""
    dead = dead | (state.oxygen <= 0)
    below = state.sub_y > 0
    surfacing = ~below & ~state.surfaced
    dead = dead | (surfacing & (state.divers_held == 0))
    surfaces = surfacing & (state.divers_held != 0)
    full = state.divers_held == MAX_DIVERS
    reward = reward + jnp.where(surfaces & full, state.oxygen * 10 // MAX_OXYGEN, 0)
    held = jnp.where(surfaces, jnp.where(full, 0, state.divers_held) - 1, state.divers_held)
    ramp = surfaces & params.ramping & ((state.spawn_interval > 1) | (state.move_interval > 2))
    faster_moves = ramp & (state.move_interval > 2) & (state.ramp_index % 2 == 1)
    faster_spawns = ramp & (state.spawn_interval > 1)
    state = state.replace(
        spawn_timer=state.spawn_timer - (state.spawn_timer > 0),
        diver_timer=state.diver_timer - (state.diver_timer > 0),
        shot_timer=state.shot_timer - (state.shot_timer > 0),
        oxygen=jnp.where(below, state.oxygen - 1, jnp.where(surfaces, MAX_OXYGEN, state.oxygen)),
        surfaced=jnp.where(below, False, state.surfaced | surfaces),
        divers_held=held,
        move_interval=state.move_interval - faster_moves,
        spawn_interval=state.spawn_interval - faster_spawns,
        ramp_index=state.ramp_index + ramp,
    )
    return state, reward, dead


class SeaquestMinAtar(StickyActionEnvironment):
    reset_noise_words = 0
    transition_noise_words = 6

    @property
    def default_params(self) -> SeaquestParams:
        return SeaquestParams()

    def reset_env(self, noise, params):
        state = SeaquestState(
            time=jnp.int32(0),
            sub_x=jnp.int32(5),
            sub_y=jnp.int32(0),
            sub_right=jnp.bool_(False),
            oxygen=jnp.int32(MAX_OXYGEN),
            divers_held=jnp.int32(0),
            surfaced=jnp.bool_(True),
            shot_timer=jnp.int32(0),
            spawn_interval=jnp.int32(INITIAL_SPAWN_INTERVAL),
            spawn_timer=jnp.int32(INITIAL_SPAWN_INTERVAL),
            diver_timer=jnp.int32(DIVER_SPAWN_INTERVAL),
            move_interval=jnp.int32(INITIAL_MOVE_INTERVAL),
            ramp_index=jnp.int32(0),
            counter=jnp.int32(0),
            **{kind: Entities.empty(slots) for kind, slots in SLOTS.items()},
            last_action=jnp.int32(0),
        )
        return self.observation(state), state

    def step_env(self, noise, state, action, params):
        action = sticky_action(noise[0], state.last_action, action, params.sticky_action_prob)
        spawning = state.spawn_timer == 0
        state = select_tree(spawning, spawn_enemy(state, noise[1:4]), state)
        state = state.replace(spawn_timer=jnp.where(spawning, state.spawn_interval, state.spawn_timer))
        diving = state.diver_timer == 0
        state = select_tree(diving, spawn_diver(state, noise[4:6]), state)
        state = state.replace(diver_timer=jnp.where(diving, DIVER_SPAWN_INTERVAL, state.diver_timer))
        state = move_player(state, action)
        reward, dead = jnp.int32(0), jnp.bool_(False)
        state, reward = player_bullets_step(state, reward)
        state = divers_step(state)
        state, (reward, dead) = enemies_step(state, "subs", reward, dead)
        state, dead = enemy_bullets_step(state, dead)
        state, (reward, dead) = enemies_step(state, "fish", reward, dead)
        state, reward, dead = surface_and_oxygen(state, reward, dead, params)
        return self.observation(state), state.replace(last_action=action), reward.astype(jnp.float32), dead, {}

    @staticmethod
    def observation(state: SeaquestState) -> jax.Array:
        """``[10, 10, 10]`` float32 0/1 (channels in the module docstring)."""
        rows, cols = jnp.arange(GRID)[:, None], jnp.arange(GRID)[None, :]

        def cells(entities: Entities, x: jax.Array | None = None) -> jax.Array:
            # Comparisons rather than a scatter: under vmap on CPU a scatter per channel costs more.
            x = entities.x if x is None else x
            here = (rows[None] == entities.y[:, None, None]) & (cols[None] == x[:, None, None])
            return (here & entities.active[:, None, None]).any(axis=0)

        def trail(entities: Entities) -> jax.Array:
            return cells(entities, entities.x - heading(entities.right))

        front = (rows == state.sub_y) & (cols == state.sub_x)
        back = (rows == state.sub_y) & (cols == state.sub_x - heading(state.sub_right))
        oxygen = (rows == GRID - 1) & (cols < jnp.maximum(state.oxygen, 0) * 10 // MAX_OXYGEN)
        divers = (rows == GRID - 1) & (cols >= GRID - 1 - state.divers_held) & (cols < GRID - 1)
        channels = [
            front,
            back,
            cells(state.player_bullets),
            trail(state.fish) | trail(state.subs) | trail(state.divers),
            cells(state.enemy_bullets),
            cells(state.fish),
            cells(state.subs),
            oxygen,
            divers,
            cells(state.divers),
        ]
        return jnp.stack(channels, axis=-1).astype(jnp.float32)

    def observation_space(self, params):
        return Box(0.0, 1.0, (GRID, GRID, CHANNELS), jnp.float32)

    def action_space(self, params):
        return Discrete(6)

    def render(self, state, params, cell_pixels: int = 16):
        channels = self.observation(state) == 1
        layers = [  # later layers on top
            (channels[..., 3], (70, 90, 120)),
            (channels[..., 7], (90, 200, 255)),
            (channels[..., 8], (120, 230, 120)),
            (channels[..., 9], (120, 230, 120)),
            (channels[..., 5], (230, 90, 60)),
            (channels[..., 6], (200, 60, 200)),
            (channels[..., 4], (255, 160, 60)),
            (channels[..., 2], (250, 240, 120)),
            (channels[..., 1], (60, 120, 220)),
            (channels[..., 0], (80, 180, 255)),
        ]
        return rendering.layered_grid_image(layers, (0, 10, 40), cell_pixels)

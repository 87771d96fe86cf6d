"""``Asterix-MinAtar``: MinAtar's Asterix rules on a 10x10 grid.

The player moves in rows 1-8. Eight lanes (rows 1-8) each hold at most one entity, an enemy
or gold, entering from the left or right edge (every ``spawn speed`` steps, into a random
free lane, gold with probability 1/3) and moving one cell every ``move speed`` steps until it
leaves the grid. Touching gold gives +1 and removes it; touching an enemy terminates the
episode. With difficulty ramping (MinAtar's default) every 100 steps the spawn interval
shortens (from 10) and every other time the move interval too (from 5), down to 1.
``sticky_action_prob`` (MinAtar's default 0.1; 0 disables) repeats the previous action.
Truncated at 1000 steps (gymnax's limit; MinAtar itself has none).

Observation float32 ``[10, 10, 4]`` of 0/1, channels (player, enemy, trail, gold): the trail
marks the cell behind each entity. Actions 0-4: no-op, left, up, right, down (MinAtar's
minimal set).
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
LANES = 8
RAMP_INTERVAL = 100
INITIAL_SPAWN_INTERVAL = 10
INITIAL_MOVE_INTERVAL = 5
CHANNELS = 4
MOVE_X = jnp.array([0, -1, 0, 1, 0])  # no-op, left, up, right, down
MOVE_Y = jnp.array([0, 0, -1, 0, 1])


@struct.dataclass
class AsterixState(EnvState):
    player_x: jax.Array
    player_y: jax.Array
    active: jax.Array  # [8] bool: lane i (row i + 1) holds an entity
    entity_x: jax.Array  # [8]
    moving_right: jax.Array  # [8] bool
    gold: jax.Array  # [8] bool
    spawn_timer: jax.Array
    spawn_interval: jax.Array
    move_timer: jax.Array
    move_interval: jax.Array
    ramp_timer: jax.Array
    ramp_index: jax.Array
    last_action: jax.Array


@struct.dataclass
class AsterixParams(EnvParams):
    max_steps_in_episode: int = 1000
    sticky_action_prob: float = 0.1
    ramping: bool = True


def spawn(state: AsterixState, noise: jax.Array) -> AsterixState:
    """A new entity in a uniformly drawn free lane (nothing when every lane is taken), from
    3 noise words: its side, whether it is gold, and the lane."""
    from_left = noise_lib.bernoulli(noise[0], 0.5)
    is_gold = noise_lib.bernoulli(noise[1], 1.0 / 3.0)
    free = ~state.active
    choice = noise_lib.randint(noise[2], 0, jnp.maximum(free.sum(), 1))
    lane = jnp.argmax(free & (jnp.cumsum(free) == choice + 1))  # the choice-th free lane
    chosen = free.any() & (jnp.arange(LANES) == lane)
    return state.replace(
        active=state.active | chosen,
        entity_x=jnp.where(chosen, jnp.where(from_left, 0, GRID - 1), state.entity_x),
        moving_right=jnp.where(chosen, from_left, state.moving_right),
        gold=jnp.where(chosen, is_gold, state.gold),
    )


def touch(state: AsterixState) -> tuple[AsterixState, jax.Array, jax.Array]:
    """``(state, reward, hit an enemy)``: gold on the player's cell is collected and removed."""
    here = state.active & (state.entity_x == state.player_x) & (jnp.arange(LANES) + 1 == state.player_y)
    collected = here & state.gold
    return state.replace(active=state.active & ~collected), collected.sum(), (here & ~state.gold).any()


class AsterixMinAtar(StickyActionEnvironment):
    reset_noise_words = 0
    transition_noise_words = 4

    @property
    def default_params(self) -> AsterixParams:
        return AsterixParams()

    def reset_env(self, noise, params):
        lanes = jnp.zeros(LANES, bool)
        state = AsterixState(
            time=jnp.int32(0),
            player_x=jnp.int32(5),
            player_y=jnp.int32(5),
            active=lanes,
            entity_x=jnp.zeros(LANES, jnp.int32),
            moving_right=lanes,
            gold=lanes,
            spawn_timer=jnp.int32(INITIAL_SPAWN_INTERVAL),
            spawn_interval=jnp.int32(INITIAL_SPAWN_INTERVAL),
            move_timer=jnp.int32(INITIAL_MOVE_INTERVAL),
            move_interval=jnp.int32(INITIAL_MOVE_INTERVAL),
            ramp_timer=jnp.int32(RAMP_INTERVAL),
            ramp_index=jnp.int32(0),
            last_action=jnp.int32(0),
        )
        return self.observation(state), state

    def step_env(self, noise, state, action, params):
        action = sticky_action(noise[0], state.last_action, action, params.sticky_action_prob)
        spawning = state.spawn_timer == 0
        state = select_tree(spawning, spawn(state, noise[1:]), state)
        spawn_timer = jnp.where(spawning, state.spawn_interval, state.spawn_timer)
        state = state.replace(
            player_x=jnp.clip(state.player_x + MOVE_X[action], 0, GRID - 1),
            player_y=jnp.clip(state.player_y + MOVE_Y[action], 1, LANES),
        )
        state, reward, hit = touch(state)

        # Entities move together when the move timer runs out, leave past an edge, then touch again.
        moving = state.move_timer == 0
        entity_x = state.entity_x + jnp.where(state.moving_right, 1, -1)
        inside = (entity_x >= 0) & (entity_x < GRID)
        moved = state.replace(entity_x=entity_x, active=state.active & inside)
        moved, moved_reward, moved_hit = touch(moved)
        state = select_tree(moving, moved, state)
        reward = reward + jnp.where(moving, moved_reward, 0)
        hit = hit | (moving & moved_hit)
        move_timer = jnp.where(moving, state.move_interval, state.move_timer)

        # Difficulty: every 101 steps the spawn interval, and every other time the move
        # interval, shortens (while either is above 1).
        ramping = params.ramping & ((state.spawn_interval > 1) | (state.move_interval > 1))
        ramp_now = ramping & (state.ramp_timer < 0)
        faster_moves = ramp_now & (state.move_interval > 1) & (state.ramp_index % 2 == 1)
        faster_spawns = ramp_now & (state.spawn_interval > 1)
        ramp_timer = jnp.where(ramp_now, RAMP_INTERVAL, state.ramp_timer - ramping)
        state = state.replace(
            spawn_timer=(spawn_timer - 1).astype(jnp.int32),
            move_timer=(move_timer - 1).astype(jnp.int32),
            move_interval=(state.move_interval - faster_moves).astype(jnp.int32),
            spawn_interval=(state.spawn_interval - faster_spawns).astype(jnp.int32),
            ramp_index=(state.ramp_index + ramp_now).astype(jnp.int32),
            ramp_timer=ramp_timer.astype(jnp.int32),
            entity_x=state.entity_x.astype(jnp.int32),
            last_action=action,
        )
        return self.observation(state), state, reward.astype(jnp.float32), hit, {}

    @staticmethod
    def observation(state: AsterixState) -> jax.Array:
        """``[10, 10, 4]`` float32 0/1: player, enemy, trail, gold."""
        rows, cols = jnp.arange(GRID)[:, None], jnp.arange(GRID)[None, :]
        player = (rows == state.player_y) & (cols == state.player_x)
        lanes = jnp.arange(LANES) + 1
        x = jnp.where(state.active, state.entity_x, GRID)  # inactive lanes draw off the grid
        back = x - jnp.where(state.moving_right, 1, -1)
        back = jnp.where(state.active & (back >= 0) & (back < GRID), back, GRID)
        enemy = jnp.zeros((GRID, GRID + 1), bool).at[lanes, jnp.where(state.gold, GRID, x)].set(True)
        gold = jnp.zeros((GRID, GRID + 1), bool).at[lanes, jnp.where(state.gold, x, GRID)].set(True)
        trail = jnp.zeros((GRID, GRID + 1), bool).at[lanes, back].set(True)
        channels = [player, enemy[:, :GRID], trail[:, :GRID], gold[:, :GRID]]
        return jnp.stack(channels, axis=-1).astype(jnp.float32)

    def observation_space(self, params):
        return Box(0.0, 1.0, (GRID, GRID, CHANNELS), jnp.float32)

    def action_space(self, params):
        return Discrete(5)

    def render(self, state, params, cell_pixels: int = 16):
        channels = self.observation(state) == 1
        layers = [  # later layers on top: trails < enemies < gold < the player
            (channels[..., 2], (110, 110, 110)),
            (channels[..., 1], (230, 90, 60)),
            (channels[..., 3], (250, 220, 60)),
            (channels[..., 0], (80, 160, 255)),
        ]
        return rendering.layered_grid_image(layers, (0, 0, 0), cell_pixels)

"""``SpaceInvaders-MinAtar``: MinAtar's Space Invaders rules on a 10x10 grid.

The cannon sits in the bottom row and moves left or right or fires (one shot every 5 steps).
A block of 4x6 aliens marches sideways, one cell every ``min(aliens left, move interval)``
steps, and one row down (reversing) when it reaches a side; every 10 steps the alien
nearest the cannon's column shoots. Bullets move one row per step. Each alien hit gives +1;
when none is left a new block appears and, with difficulty ramping (MinAtar's default), the
march interval shortens from 12 to at least 6. An enemy bullet or an alien reaching the
cannon, or the block reaching the bottom row, terminates the episode. The game is
deterministic; ``sticky_action_prob`` (MinAtar's default 0.1; 0 disables) repeats the
previous action. Truncated at 1000 steps (gymnax's limit; MinAtar itself has none).

Observation float32 ``[10, 10, 6]`` of 0/1, channels (cannon, alien, alien moving left,
alien moving right, friendly bullet, enemy bullet). Actions 0/1/2/3: no-op, left, right,
fire (MinAtar's minimal set).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ember.envs import rendering
from ember.envs.environment import EnvParams, EnvState
from ember.envs.minatar.sticky_actions import StickyActionEnvironment, sticky_action
from ember.envs.spaces import Box, Discrete

GRID = 10
SHOT_COOL_DOWN = 5
ENEMY_MOVE_INTERVAL = 12
ENEMY_SHOT_INTERVAL = 10
FASTEST_MOVE_INTERVAL = 6
CHANNELS = 6


def initial_aliens() -> jax.Array:
    """``[10, 10]`` bool: rows 0-3, columns 2-7."""
    rows, cols = jnp.arange(GRID)[:, None], jnp.arange(GRID)[None, :]
    return (rows <= 3) & (cols >= 2) & (cols <= 7)


@struct.dataclass
class SpaceInvadersState(EnvState):
    position: jax.Array  # the cannon's column
    aliens: jax.Array  # [10, 10] bool
    alien_direction: jax.Array  # -1 left, +1 right
    friendly_bullets: jax.Array  # [10, 10] bool
    enemy_bullets: jax.Array  # [10, 10] bool
    shot_timer: jax.Array
    alien_move_timer: jax.Array
    alien_shot_timer: jax.Array
    move_interval: jax.Array
    ramp_index: jax.Array
    last_action: jax.Array


@struct.dataclass
class SpaceInvadersParams(EnvParams):
    max_steps_in_episode: int = 1000
    sticky_action_prob: float = 0.1
    ramping: bool = True


def nearest_shooter(aliens: jax.Array, position: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(row, column)`` of the alien that shoots: in the nonempty column nearest the cannon
    (the lower column on a tie), its lowest alien."""
    columns = jnp.arange(GRID)
    occupied = aliens.any(axis=0)
    # Distance first, then the column index breaks ties (MinAtar's stable sort by distance).
    order = jnp.where(occupied, jnp.abs(columns - position) * GRID + columns, GRID * GRID * 2)
    column = jnp.argmin(order)
    row = jnp.max(jnp.where(aliens[:, column], jnp.arange(GRID), -1))
    return row, column


class SpaceInvadersMinAtar(StickyActionEnvironment):
    reset_noise_words = 0
    transition_noise_words = 1

    @property
    def default_params(self) -> SpaceInvadersParams:
        return SpaceInvadersParams()

    def reset_env(self, noise, params):
        empty = jnp.zeros((GRID, GRID), bool)
        state = SpaceInvadersState(
            time=jnp.int32(0),
            position=jnp.int32(5),
            aliens=initial_aliens(),
            alien_direction=jnp.int32(-1),
            friendly_bullets=empty,
            enemy_bullets=empty,
            shot_timer=jnp.int32(0),
            alien_move_timer=jnp.int32(ENEMY_MOVE_INTERVAL),
            alien_shot_timer=jnp.int32(ENEMY_SHOT_INTERVAL),
            move_interval=jnp.int32(ENEMY_MOVE_INTERVAL),
            ramp_index=jnp.int32(0),
            last_action=jnp.int32(0),
        )
        return self.observation(state), state

    def step_env(self, noise, state, action, params):
        action = sticky_action(noise[0], state.last_action, action, params.sticky_action_prob)
        rows, cols = jnp.arange(GRID)[:, None], jnp.arange(GRID)[None, :]
        fire = (action == 3) & (state.shot_timer == 0)
        friendly = state.friendly_bullets | (fire & (rows == GRID - 1) & (cols == state.position))
        shot_timer = jnp.where(fire, SHOT_COOL_DOWN, state.shot_timer)
        position = state.position + jnp.where(action == 1, -1, 0) + jnp.where(action == 2, 1, 0)
        position = jnp.clip(position, 0, GRID - 1)
        at_cannon = (rows == GRID - 1) & (cols == position)

        # Bullets: friendly ones rise and leave at the top, enemy ones fall and leave at the bottom.
        friendly = jnp.roll(friendly, -1, axis=0) & (rows < GRID - 1)
        enemy = jnp.roll(state.enemy_bullets, 1, axis=0) & (rows > 0)
        terminated = (enemy & at_cannon).any() | (state.aliens & at_cannon).any()

        # The block marches when its timer runs out: down and reversing at a side, else sideways.
        aliens, direction, move_timer = state.aliens, state.alien_direction, state.alien_move_timer
        march = move_timer == 0
        at_side = (aliens[:, 0].any() & (direction < 0)) | (aliens[:, GRID - 1].any() & (direction > 0))
        descend = march & at_side
        terminated = terminated | (descend & aliens[GRID - 1].any())
        moved = jnp.where(at_side, jnp.roll(aliens, 1, axis=0), jnp.roll(aliens, direction, axis=1))
        aliens = jnp.where(march, moved, aliens)
        direction = jnp.where(descend, -direction, direction)
        move_timer = jnp.where(march, jnp.minimum(state.aliens.sum(), state.move_interval), move_timer)
        terminated = terminated | (march & (aliens & at_cannon).any())

        shoot = state.alien_shot_timer == 0
        shooter_row, shooter_column = nearest_shooter(aliens, position)
        enemy = enemy | (shoot & aliens.any() & (rows == shooter_row) & (cols == shooter_column))
        shot_timer_aliens = jnp.where(shoot, ENEMY_SHOT_INTERVAL, state.alien_shot_timer)

        kills = aliens & friendly
        reward = kills.sum().astype(jnp.float32)
        aliens, friendly = aliens & ~kills, friendly & ~kills

        cleared = ~aliens.any()
        ramp = cleared & params.ramping & (state.move_interval > FASTEST_MOVE_INTERVAL)
        state = state.replace(
            position=position.astype(jnp.int32),
            aliens=jnp.where(cleared, initial_aliens(), aliens),
            alien_direction=direction.astype(jnp.int32),
            friendly_bullets=friendly,
            enemy_bullets=enemy,
            shot_timer=(shot_timer - (shot_timer > 0)).astype(jnp.int32),
            alien_move_timer=(move_timer - 1).astype(jnp.int32),
            alien_shot_timer=(shot_timer_aliens - 1).astype(jnp.int32),
            move_interval=(state.move_interval - ramp).astype(jnp.int32),
            ramp_index=(state.ramp_index + ramp).astype(jnp.int32),
            last_action=action,
        )
        return self.observation(state), state, reward, terminated, {}

    @staticmethod
    def observation(state: SpaceInvadersState) -> jax.Array:
        """``[10, 10, 6]`` float32 0/1: cannon, alien, alien moving left / right, friendly
        and enemy bullets."""
        rows, cols = jnp.arange(GRID)[:, None], jnp.arange(GRID)[None, :]
        cannon = (rows == GRID - 1) & (cols == state.position)
        left = state.aliens & (state.alien_direction < 0)
        right = state.aliens & (state.alien_direction > 0)
        channels = [cannon, state.aliens, left, right, state.friendly_bullets, state.enemy_bullets]
        return jnp.stack(channels, axis=-1).astype(jnp.float32)

    def observation_space(self, params):
        return Box(0.0, 1.0, (GRID, GRID, CHANNELS), jnp.float32)

    def action_space(self, params):
        return Discrete(4)

    def render(self, state, params, cell_pixels: int = 16):
        channels = self.observation(state) == 1
        layers = [  # later layers on top: aliens < friendly bullets < enemy bullets < cannon
            (channels[..., 1], (120, 220, 120)),
            (channels[..., 4], (255, 255, 255)),
            (channels[..., 5], (230, 90, 60)),
            (channels[..., 0], (80, 160, 255)),
        ]
        return rendering.layered_grid_image(layers, (0, 0, 0), cell_pixels)

"""``Freeway-MinAtar``: MinAtar's Freeway rules on a 10x10 grid.

The chicken starts at the bottom (row 9, column 4) and moves up or down one row, at most once
every 3 steps. Reaching the top row gives +1, returns it to the bottom and draws new car
speeds. Eight cars, one per row 1-8, drive horizontally and wrap around; car ``i`` moves one
cell every ``|speed_i|`` steps (speeds 1-5, the sign its direction). A car meeting the chicken
sends it back to the bottom. The episode terminates after 2500 steps (MinAtar's time limit,
a terminal state there).

Observation float32 ``[10, 10, 7]`` of 0/1, channels (chicken, car, speed1 ... speed5): the
speed channels mark each car's trail, the cell behind it, in the channel of its speed.
Actions 0/1/2: no-op, up, down (MinAtar's minimal set). ``sticky_action_prob`` (MinAtar's
default 0.1; 0 disables) repeats the previous action instead of the chosen one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ember.envs import noise as noise_lib
from ember.envs import rendering
from ember.envs.environment import EnvParams, EnvState
from ember.envs.minatar.sticky_actions import StickyActionEnvironment, sticky_action
from ember.envs.spaces import Box, Discrete

GRID = 10
CARS = 8
CHICKEN_COLUMN = 4
PLAYER_SPEED = 3
TIME_LIMIT = 2500
CHANNELS = 7


@struct.dataclass
class FreewayState(EnvState):
    position: jax.Array  # the chicken's row
    move_timer: jax.Array
    terminate_timer: jax.Array
    car_x: jax.Array  # [8] columns; car i drives in row i + 1
    car_timer: jax.Array  # [8] steps until it moves
    car_speed: jax.Array  # [8] signed: |speed| steps per move, the sign its direction
    last_action: jax.Array


@struct.dataclass
class FreewayParams(EnvParams):
    max_steps_in_episode: int = TIME_LIMIT + 1  # the game terminates itself first
    sticky_action_prob: float = 0.1


def random_speeds(noise: jax.Array) -> jax.Array:
    """``[8]`` signed speeds from 16 noise words: magnitudes 1-5, directions +-1."""
    magnitude = noise_lib.randint(noise[:CARS], 1, 6)
    direction = noise_lib.randint(noise[CARS:], 0, 2) * 2 - 1
    return (magnitude * direction).astype(jnp.int32)


class FreewayMinAtar(StickyActionEnvironment):
    reset_noise_words = 2 * CARS
    transition_noise_words = 1 + 2 * CARS

    @property
    def default_params(self) -> FreewayParams:
        return FreewayParams()

    def reset_env(self, noise, params):
        speeds = random_speeds(noise)
        state = FreewayState(
            time=jnp.int32(0),
            position=jnp.int32(GRID - 1),
            move_timer=jnp.int32(PLAYER_SPEED),
            terminate_timer=jnp.int32(TIME_LIMIT),
            car_x=jnp.zeros(CARS, jnp.int32),
            car_timer=jnp.abs(speeds),
            car_speed=speeds,
            last_action=jnp.int32(0),
        )
        return self.observation(state), state

    def step_env(self, noise, state, action, params):
        action = sticky_action(noise[0], state.last_action, action, params.sticky_action_prob)
        can_move = state.move_timer == 0
        up, down = can_move & (action == 1), can_move & (action == 2)
        position = jnp.where(up, jnp.maximum(state.position - 1, 0), state.position)
        position = jnp.where(down, jnp.minimum(position + 1, GRID - 1), position)
        move_timer = jnp.where(up | down, PLAYER_SPEED, state.move_timer)

        # Reaching the top: +1, back to the bottom, new speeds (their timers restart too).
        won = position == 0
        speeds = jnp.where(won, random_speeds(noise[1:]), state.car_speed)
        car_timer = jnp.where(won, jnp.abs(speeds), state.car_timer)
        position = jnp.where(won, GRID - 1, position)

        # Cars move in order; only the car in the chicken's row can meet it (before or after
        # its move), and a hit sends the chicken to row 9, where no car drives.
        moves = car_timer == 0
        car_x = jnp.where(moves, (state.car_x + jnp.sign(speeds)) % GRID, state.car_x)
        car_timer = jnp.where(moves, jnp.abs(speeds), car_timer - 1)
        in_row = jnp.arange(CARS) + 1 == position
        hit = jnp.any(in_row & ((state.car_x == CHICKEN_COLUMN) | (car_x == CHICKEN_COLUMN)))
        position = jnp.where(hit, GRID - 1, position)

        terminate_timer = state.terminate_timer - 1
        state = state.replace(
            position=position,
            move_timer=move_timer - (move_timer > 0),
            terminate_timer=terminate_timer,
            car_x=car_x.astype(jnp.int32),
            car_timer=car_timer.astype(jnp.int32),
            car_speed=speeds,
            last_action=action,
        )
        return self.observation(state), state, won.astype(jnp.float32), terminate_timer < 0, {}

    @staticmethod
    def observation(state: FreewayState) -> jax.Array:
        """``[10, 10, 7]`` float32 0/1: chicken, car, then the trail in its speed's channel."""
        rows, cols = jnp.arange(GRID)[:, None], jnp.arange(GRID)[None, :]
        chicken = (rows == state.position) & (cols == CHICKEN_COLUMN)
        car_rows = jnp.arange(CARS) + 1
        cars = jnp.zeros((GRID, GRID), bool).at[car_rows, state.car_x].set(True)
        back_x = (state.car_x - jnp.sign(state.car_speed)) % GRID
        trail = jnp.zeros((GRID, GRID, CHANNELS), bool).at[car_rows, back_x, jnp.abs(state.car_speed) + 1].set(True)
        return trail.at[..., 0].set(chicken).at[..., 1].set(cars).astype(jnp.float32)

    def observation_space(self, params):
        return Box(0.0, 1.0, (GRID, GRID, CHANNELS), jnp.float32)

    def action_space(self, params):
        return Discrete(3)

    def render(self, state, params, cell_pixels: int = 16):
        channels = self.observation(state) == 1
        layers = [  # later layers on top: trails < cars < the chicken
            (channels[..., 2:].any(axis=-1), (110, 110, 110)),
            (channels[..., 1], (230, 90, 60)),
            (channels[..., 0], (250, 220, 60)),
        ]
        return rendering.layered_grid_image(layers, (0, 0, 0), cell_pixels)

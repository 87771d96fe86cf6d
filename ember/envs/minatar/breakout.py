"""``Breakout-MinAtar``: MinAtar's Breakout rules on a 10x10 grid.

Observation float32 ``[10, 10, 4]`` of 0/1, channels (paddle, ball, trail, brick); the
trail marks the ball's previous cell. Actions 0/1/2: no-op, left, right (MinAtar's
minimal set). Three rows of bricks (rows 1-3); the ball moves one cell diagonally per
step, bounces off walls, the ceiling, bricks (+1 reward, brick removed) and the paddle
(row 9); missing it terminates the episode. When the ball reaches the bottom row and no
brick is left, the three rows are rebuilt. ``sticky_action_prob`` (MinAtar's default 0.1;
0 disables) repeats the previous action instead of the chosen one. Truncated at 1000 steps
(gymnax's limit; MinAtar itself has none).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs import noise as noise_lib
from ember.envs import rendering
from ember.envs.environment import EnvParams, EnvState
from ember.envs.minatar.sticky_actions import StickyActionEnvironment, sticky_action
from ember.envs.spaces import Box, Discrete

GRID = 10
# Ball directions: 0 up-left, 1 up-right, 2 down-right, 3 down-left.
DIRECTION_DX = np.array([-1, 1, 1, -1])
DIRECTION_DY = np.array([-1, -1, 1, 1])
FLIP_HORIZONTAL = np.array([1, 0, 3, 2])
FLIP_VERTICAL = np.array([3, 2, 1, 0])
FLIP_BOTH = np.array([2, 3, 0, 1])
PADDLE_MOVE = np.array([0, -1, 1])  # no-op, left, right


def initial_bricks() -> jax.Array:
    """``[10, 10]`` bool: rows 1-3 full."""
    rows = jnp.arange(GRID)[:, None]
    return jnp.broadcast_to((rows >= 1) & (rows <= 3), (GRID, GRID))


@struct.dataclass
class BreakoutState(EnvState):
    ball_x: jax.Array
    ball_y: jax.Array
    ball_dir: jax.Array
    paddle_x: jax.Array
    bricks: jax.Array  # [10, 10] bool
    strike: jax.Array  # the ball hit a brick last step (no second hit in a row)
    last_x: jax.Array
    last_y: jax.Array
    last_action: jax.Array


@struct.dataclass
class BreakoutParams(EnvParams):
    max_steps_in_episode: int = 1000
    sticky_action_prob: float = 0.1


class BreakoutMinAtar(StickyActionEnvironment):
    reset_noise_words = 1
    transition_noise_words = 1

    @property
    def default_params(self) -> BreakoutParams:
        return BreakoutParams()

    def reset_env(self, noise, params):
        from_right = noise_lib.randint(noise[0], 0, 2) == 1
        ball_x = jnp.where(from_right, 9, 0).astype(jnp.int32)
        state = BreakoutState(
            time=jnp.int32(0),
            ball_x=ball_x,
            ball_y=jnp.int32(3),
            ball_dir=jnp.where(from_right, 3, 2).astype(jnp.int32),
            paddle_x=jnp.int32(4),
            bricks=initial_bricks(),
            strike=jnp.asarray(False),
            last_x=ball_x,
            last_y=jnp.int32(3),
            last_action=jnp.int32(0),
        )
        return self.observation(state), state

    def step_env(self, noise, state, action, params):
        action = sticky_action(noise[0], state.last_action, action, params.sticky_action_prob)
        paddle_x = jnp.clip(state.paddle_x + jnp.asarray(PADDLE_MOVE)[action], 0, GRID - 1)

        direction = state.ball_dir
        new_x = state.ball_x + jnp.asarray(DIRECTION_DX)[direction]
        new_y = state.ball_y + jnp.asarray(DIRECTION_DY)[direction]
        hit_wall = (new_x < 0) | (new_x > GRID - 1)
        new_x = jnp.clip(new_x, 0, GRID - 1)
        direction = jnp.where(hit_wall, jnp.asarray(FLIP_HORIZONTAL)[direction], direction)

        hit_ceiling = new_y < 0
        new_y = jnp.maximum(new_y, 0)
        direction = jnp.where(hit_ceiling, jnp.asarray(FLIP_VERTICAL)[direction], direction)

        brick_here = ~hit_ceiling & state.bricks[new_y, new_x]
        breaks = brick_here & ~state.strike
        cell = (jnp.arange(GRID)[:, None] == new_y) & (jnp.arange(GRID)[None, :] == new_x)
        bricks = state.bricks & ~(breaks & cell)
        direction = jnp.where(breaks, jnp.asarray(FLIP_VERTICAL)[direction], direction)

        at_bottom = ~hit_ceiling & ~brick_here & (new_y == GRID - 1)
        bricks = jnp.where(at_bottom & ~bricks.any(), initial_bricks(), bricks)
        under_old = at_bottom & (state.ball_x == paddle_x)
        under_new = at_bottom & ~under_old & (new_x == paddle_x)
        direction = jnp.where(under_old, jnp.asarray(FLIP_VERTICAL)[direction], direction)
        direction = jnp.where(under_new, jnp.asarray(FLIP_BOTH)[direction], direction)
        new_y = jnp.where(breaks | under_old | under_new, state.ball_y, new_y)
        terminated = at_bottom & ~under_old & ~under_new

        state = state.replace(
            ball_x=new_x,
            ball_y=new_y,
            ball_dir=direction,
            paddle_x=paddle_x,
            bricks=bricks,
            strike=brick_here,
            last_x=state.ball_x,
            last_y=state.ball_y,
            last_action=action,
        )
        return self.observation(state), state, breaks.astype(jnp.float32), terminated, {}

    @staticmethod
    def observation(state: BreakoutState) -> jax.Array:
        """``[10, 10, 4]`` float32 0/1: paddle, ball, trail, brick."""
        rows, cols = jnp.arange(GRID)[:, None], jnp.arange(GRID)[None, :]
        paddle = (rows == GRID - 1) & (cols == state.paddle_x)
        ball = (rows == state.ball_y) & (cols == state.ball_x)
        trail = (rows == state.last_y) & (cols == state.last_x)
        return jnp.stack([paddle, ball, trail, state.bricks], axis=-1).astype(jnp.float32)

    def observation_space(self, params):
        return Box(0.0, 1.0, (GRID, GRID, 4), jnp.float32)

    def action_space(self, params):
        return Discrete(3)

    def render(self, state, params, cell_pixels: int = 16):
        channels = self.observation(state) == 1
        layers = [  # later layers on top: brick < trail < ball < paddle
            (channels[..., 3], (230, 90, 60)),
            (channels[..., 2], (110, 110, 110)),
            (channels[..., 1], (255, 255, 255)),
            (channels[..., 0], (80, 160, 255)),
        ]
        return rendering.layered_grid_image(layers, (0, 0, 0), cell_pixels)

"""``MountainCar-v0`` (discrete) and ``MountainCarContinuous-v0``: gymnasium's under-powered
car in a valley (Moore, 1990).

Observation ``[position, velocity]``.
  * ``MountainCar-v0``: actions 0/1/2 push left/none/right; reward -1 per step;
    terminated when ``position >= 0.5``; truncated at 200 steps.
  * ``MountainCarContinuous-v0``: action ``[1]`` force in ``[-1, 1]``; reward
    ``-0.1 force**2``, plus 100 on reaching ``position >= 0.45``; truncated at 999 steps.
    (gymnasium penalises the unclipped action; actions here are clipped first -- identical
    for every valid action.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs import noise as noise_lib
from ember.envs import rendering
from ember.envs.environment import Environment, EnvParams, EnvState
from ember.envs.spaces import Box, Discrete, default_float


@struct.dataclass
class MountainCarState(EnvState):
    position: jax.Array
    velocity: jax.Array


@struct.dataclass
class MountainCarParams(EnvParams):
    max_steps_in_episode: int = 200
    min_position: float = -1.2
    max_position: float = 0.6
    max_speed: float = 0.07
    goal_position: float = 0.5
    goal_velocity: float = 0.0
    force: float = 0.001
    gravity: float = 0.0025


@struct.dataclass
class MountainCarContinuousParams(EnvParams):
    max_steps_in_episode: int = 999
    min_position: float = -1.2
    max_position: float = 0.6
    max_speed: float = 0.07
    goal_position: float = 0.45
    goal_velocity: float = 0.0
    power: float = 0.0015
    gravity: float = 0.0025


def _move(state: MountainCarState, acceleration: jax.Array, params) -> MountainCarState:
    """Velocity then position update with the walls of both variants; the left wall stops the car."""
    velocity = jnp.clip(
        state.velocity + acceleration - params.gravity * jnp.cos(3 * state.position),
        -params.max_speed,
        params.max_speed,
    )
    position = jnp.clip(state.position + velocity, params.min_position, params.max_position)
    velocity = jnp.where((position == params.min_position) & (velocity < 0), jnp.zeros_like(velocity), velocity)
    return state.replace(position=position, velocity=velocity)


def _reached_goal(state: MountainCarState, params) -> jax.Array:
    return (state.position >= params.goal_position) & (state.velocity >= params.goal_velocity)


class _MountainCarBase(Environment):
    reset_noise_words = 1

    def reset_env(self, noise, params):
        position = noise_lib.uniform(noise[0], -0.6, -0.4)
        state = MountainCarState(time=jnp.int32(0), position=position, velocity=jnp.zeros_like(position))
        return self.observation(state), state

    @staticmethod
    def observation(state: MountainCarState) -> jax.Array:
        """``[2]``: position, velocity."""
        return jnp.stack([state.position, state.velocity])

    def observation_space(self, params):
        return Box(
            np.array([params.min_position, -params.max_speed]),
            np.array([params.max_position, params.max_speed]),
            (2,),
            default_float(),
        )

    def render(self, state, params, height: int = 200, width: int = 300):
        scale = width / (params.max_position - params.min_position)

        def to_pixels(position):
            height_m = jnp.sin(3 * position) * 0.45 + 0.55
            return (position - params.min_position) * scale, height - 10 - height_m * scale

        image = rendering.canvas(height, width)
        # The track: every pixel column painted around the hill's height at that position.
        columns = (jnp.arange(width) + 0.5) / scale + params.min_position
        _, track_y = to_pixels(columns)
        rows = jnp.arange(height)[:, None] + 0.5
        image = rendering.paint(image, jnp.abs(rows - track_y[None, :]) <= 1.5, rendering.BLACK)
        flag_x, flag_y = to_pixels(params.goal_position)
        image = rendering.fill_rect(image, flag_x, flag_y - 20, flag_x + 2, flag_y, rendering.BLACK)
        image = rendering.fill_rect(image, flag_x + 2, flag_y - 20, flag_x + 12, flag_y - 14, (204, 204, 0))
        car_x, car_y = to_pixels(state.position)
        return rendering.fill_circle(image, car_x, car_y - 6, 7, (80, 80, 200))


class MountainCar(_MountainCarBase):
    @property
    def default_params(self) -> MountainCarParams:
        return MountainCarParams()

    def step_env(self, noise, state, action, params):
        state = _move(state, (action - 1) * params.force, params)
        reward = jnp.full_like(state.position, -1.0)
        return self.observation(state), state, reward, _reached_goal(state, params), {}

    def action_space(self, params):
        return Discrete(3)


class MountainCarContinuous(_MountainCarBase):
    @property
    def default_params(self) -> MountainCarContinuousParams:
        return MountainCarContinuousParams()

    def step_env(self, noise, state, action, params):
        force = action[0].astype(state.position.dtype)
        state = _move(state, force * params.power, params)
        terminated = _reached_goal(state, params)
        reward = jnp.where(terminated, 100.0, 0.0) - 0.1 * force**2
        return self.observation(state), state, reward, terminated, {}

    def action_space(self, params):
        return Box(-1.0, 1.0, (1,), jnp.float32)

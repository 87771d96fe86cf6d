"""``Pendulum-v1``: gymnasium's inverted pendulum swing-up, continuous torque.

Observation ``[cos(theta), sin(theta), theta_dot]``; action ``[1]`` torque in ``[-2, 2]``;
reward ``-(angle_normalize(theta)**2 + 0.1 theta_dot**2 + 0.001 torque**2)``; never
terminates; truncated at 200 steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs import noise as noise_lib
from ember.envs import rendering
from ember.envs.environment import Environment, EnvParams, EnvState
from ember.envs.spaces import Box, default_float


@struct.dataclass
class PendulumState(EnvState):
    theta: jax.Array
    theta_dot: jax.Array
    last_torque: jax.Array  # for rendering


@struct.dataclass
class PendulumParams(EnvParams):
    max_steps_in_episode: int = 200
    max_speed: float = 8.0
    max_torque: float = struct.field(pytree_node=False, default=2.0)  # sets the action space
    dt: float = 0.05
    g: float = 10.0
    m: float = 1.0
    l: float = 1.0  # noqa: E741 (gymnasium's name)


def angle_normalize(theta: jax.Array) -> jax.Array:
    """``theta`` wrapped into ``[-pi, pi)``."""
    return ((theta + jnp.pi) % (2 * jnp.pi)) - jnp.pi


class Pendulum(Environment):
    reset_noise_words = 2

    @property
    def default_params(self) -> PendulumParams:
        return PendulumParams()

    def reset_env(self, noise, params):
        theta = noise_lib.uniform(noise[0], -jnp.pi, jnp.pi)
        theta_dot = noise_lib.uniform(noise[1], -1.0, 1.0)
        state = PendulumState(time=jnp.int32(0), theta=theta, theta_dot=theta_dot, last_torque=jnp.zeros_like(theta))
        return self.observation(state), state

    def step_env(self, noise, state, action, params):
        torque = action[0].astype(state.theta.dtype)
        cost = angle_normalize(state.theta) ** 2 + 0.1 * state.theta_dot**2 + 0.001 * torque**2
        theta_dot = (
            state.theta_dot
            + (3 * params.g / (2 * params.l) * jnp.sin(state.theta) + 3.0 / (params.m * params.l**2) * torque)
            * params.dt
        )
        theta_dot = jnp.clip(theta_dot, -params.max_speed, params.max_speed)
        state = state.replace(theta=state.theta + theta_dot * params.dt, theta_dot=theta_dot, last_torque=torque)
        return self.observation(state), state, -cost, jnp.asarray(False), {}

    @staticmethod
    def observation(state: PendulumState) -> jax.Array:
        """``[3]``: cos(theta), sin(theta), theta_dot."""
        return jnp.stack([jnp.cos(state.theta), jnp.sin(state.theta), state.theta_dot])

    def observation_space(self, params):
        high = np.array([1.0, 1.0, params.max_speed])
        return Box(-high, high, (3,), default_float())

    def action_space(self, params):
        return Box(-params.max_torque, params.max_torque, (1,), jnp.float32)

    def render(self, state, params, size: int = 200):
        centre = size / 2
        rod = size * 0.4
        tip_x = centre + rod * jnp.sin(state.theta)
        tip_y = centre - rod * jnp.cos(state.theta)
        image = rendering.canvas(size, size)
        image = rendering.draw_segment(image, centre, centre, tip_x, tip_y, size * 0.08, (204, 77, 77))
        # Torque as a bar under the pivot: right for positive, left for negative.
        bar = state.last_torque / params.max_torque * size * 0.3
        image = rendering.fill_rect(
            image, centre + jnp.minimum(bar, 0), size * 0.9, centre + jnp.maximum(bar, 0), size * 0.93, rendering.BLACK
        )
        return rendering.fill_circle(image, centre, centre, size * 0.025, rendering.BLACK)

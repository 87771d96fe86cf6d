"""``Acrobot-v1``: gymnasium's two-link underactuated pendulum (Sutton, 1996; "book" dynamics).

State ``[theta1, theta2, dtheta1, dtheta2]`` integrated with one RK4 step of ``dt = 0.2``;
observation ``[cos theta1, sin theta1, cos theta2, sin theta2, dtheta1, dtheta2]``; actions
0/1/2 apply torque -1/0/+1 to the joint; reward -1 per step, 0 on the terminating step;
terminated when the tip rises above the bar (``-cos t1 - cos(t1 + t2) > 1``); truncated
at 500 steps.
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
class AcrobotState(EnvState):
    joint_angle1: jax.Array
    joint_angle2: jax.Array
    velocity1: jax.Array
    velocity2: jax.Array


@struct.dataclass
class AcrobotParams(EnvParams):
    max_steps_in_episode: int = 500
    dt: float = 0.2
    link_length_1: float = 1.0
    link_mass_1: float = 1.0
    link_mass_2: float = 1.0
    link_com_pos_1: float = 0.5
    link_com_pos_2: float = 0.5
    link_moi: float = 1.0
    max_vel_1: float = 4 * np.pi
    max_vel_2: float = 9 * np.pi
    gravity: float = 9.8


def _derivatives(s: jax.Array, torque: jax.Array, p: AcrobotParams) -> jax.Array:
    """d/dt of ``s = [theta1, theta2, dtheta1, dtheta2]`` under ``torque`` (book dynamics)."""
    m1, m2, l1, lc1, lc2, inertia = (
        p.link_mass_1,
        p.link_mass_2,
        p.link_length_1,
        p.link_com_pos_1,
        p.link_com_pos_2,
        p.link_moi,
    )
    theta1, theta2, dtheta1, dtheta2 = s
    d1 = m1 * lc1**2 + m2 * (l1**2 + lc2**2 + 2 * l1 * lc2 * jnp.cos(theta2)) + 2 * inertia
    d2 = m2 * (lc2**2 + l1 * lc2 * jnp.cos(theta2)) + inertia
    phi2 = m2 * lc2 * p.gravity * jnp.cos(theta1 + theta2 - jnp.pi / 2.0)
    phi1 = (
        -m2 * l1 * lc2 * dtheta2**2 * jnp.sin(theta2)
        - 2 * m2 * l1 * lc2 * dtheta2 * dtheta1 * jnp.sin(theta2)
        + (m1 * lc1 + m2 * l1) * p.gravity * jnp.cos(theta1 - jnp.pi / 2)
        + phi2
    )
    ddtheta2 = (torque + d2 / d1 * phi1 - m2 * l1 * lc2 * dtheta1**2 * jnp.sin(theta2) - phi2) / (
        m2 * lc2**2 + inertia - d2**2 / d1
    )
    ddtheta1 = -(d2 * ddtheta2 + phi1) / d1
    return jnp.stack([dtheta1, dtheta2, ddtheta1, ddtheta2])


def _wrap_angle(x: jax.Array) -> jax.Array:
    """Into ``[-pi, pi]`` by whole turns, as gymnasium's ``wrap``."""
    turn = 2 * jnp.pi
    x = jnp.where(x > jnp.pi, x - turn * jnp.ceil((x - jnp.pi) / turn), x)
    return jnp.where(x < -jnp.pi, x + turn * jnp.ceil((-jnp.pi - x) / turn), x)


class Acrobot(Environment):
    reset_noise_words = 4

    @property
    def default_params(self) -> AcrobotParams:
        return AcrobotParams()

    def reset_env(self, noise, params):
        theta1, theta2, dtheta1, dtheta2 = noise_lib.uniform(noise, -0.1, 0.1)
        state = AcrobotState(jnp.int32(0), theta1, theta2, dtheta1, dtheta2)
        return self.observation(state), state

    def step_env(self, noise, state, action, params):
        s = jnp.stack([state.joint_angle1, state.joint_angle2, state.velocity1, state.velocity2])
        torque = (action - 1).astype(s.dtype)
        dt = params.dt
        k1 = _derivatives(s, torque, params)
        k2 = _derivatives(s + dt / 2 * k1, torque, params)
        k3 = _derivatives(s + dt / 2 * k2, torque, params)
        k4 = _derivatives(s + dt * k3, torque, params)
        s = s + dt / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)
        state = state.replace(
            joint_angle1=_wrap_angle(s[0]),
            joint_angle2=_wrap_angle(s[1]),
            velocity1=jnp.clip(s[2], -params.max_vel_1, params.max_vel_1),
            velocity2=jnp.clip(s[3], -params.max_vel_2, params.max_vel_2),
        )
        terminated = -jnp.cos(state.joint_angle1) - jnp.cos(state.joint_angle2 + state.joint_angle1) > 1.0
        reward = jnp.where(terminated, 0.0, -1.0).astype(s.dtype)
        return self.observation(state), state, reward, terminated, {}

    @staticmethod
    def observation(state: AcrobotState) -> jax.Array:
        """``[6]``: cos/sin of both joint angles, both angular velocities."""
        t1, t2 = state.joint_angle1, state.joint_angle2
        return jnp.stack([jnp.cos(t1), jnp.sin(t1), jnp.cos(t2), jnp.sin(t2), state.velocity1, state.velocity2])

    def observation_space(self, params):
        high = np.array([1.0, 1.0, 1.0, 1.0, params.max_vel_1, params.max_vel_2])
        return Box(-high, high, (6,), default_float())

    def action_space(self, params):
        return Discrete(3)

    def render(self, state, params, size: int = 200):
        centre, link = size / 2, size * 0.22
        t1, t2 = state.joint_angle1, state.joint_angle2
        elbow_x, elbow_y = centre + link * jnp.sin(t1), centre + link * jnp.cos(t1)
        tip_x, tip_y = elbow_x + link * jnp.sin(t1 + t2), elbow_y + link * jnp.cos(t1 + t2)
        image = rendering.canvas(size, size)
        image = rendering.fill_rect(image, 0, centre - link - 1, size, centre - link, rendering.BLACK)  # goal bar
        image = rendering.draw_segment(image, centre, centre, elbow_x, elbow_y, 8, (0, 204, 204))
        image = rendering.draw_segment(image, elbow_x, elbow_y, tip_x, tip_y, 8, (0, 204, 204))
        image = rendering.fill_circle(image, elbow_x, elbow_y, 4, (204, 204, 0))
        return rendering.fill_circle(image, centre, centre, 4, (204, 204, 0))

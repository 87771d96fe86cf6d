"""``CartPole-v1``: gymnasium's cart-pole (Barto, Sutton & Anderson, 1983), Euler integration.

Observation ``[x, x_dot, theta, theta_dot]``; actions 0 (push left) and 1 (push right);
reward 1 every step, including the terminating one; terminated when ``|x| > 2.4`` or
``|theta| > 12 degrees``; truncated at 500 steps.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs import noise as noise_lib
from ember.envs import rendering
from ember.envs.environment import Environment, EnvParams, EnvState
from ember.envs.spaces import Box, Discrete, default_float


@struct.dataclass
class CartPoleState(EnvState):
    x: jax.Array
    x_dot: jax.Array
    theta: jax.Array
    theta_dot: jax.Array


@struct.dataclass
class CartPoleParams(EnvParams):
    max_steps_in_episode: int = 500
    gravity: float = 9.8
    masscart: float = 1.0
    masspole: float = 0.1
    length: float = 0.5  # half the pole's length
    force_mag: float = 10.0
    tau: float = 0.02
    theta_threshold_radians: float = 12 * 2 * math.pi / 360
    x_threshold: float = 2.4


class CartPole(Environment):
    reset_noise_words = 4

    @property
    def default_params(self) -> CartPoleParams:
        return CartPoleParams()

    def reset_env(self, noise, params):
        x, x_dot, theta, theta_dot = noise_lib.uniform(noise, -0.05, 0.05)
        state = CartPoleState(time=jnp.int32(0), x=x, x_dot=x_dot, theta=theta, theta_dot=theta_dot)
        return self.observation(state), state

    def step_env(self, noise, state, action, params):
        force = jnp.where(action == 1, params.force_mag, -params.force_mag)
        cos_theta, sin_theta = jnp.cos(state.theta), jnp.sin(state.theta)
        total_mass = params.masspole + params.masscart
        polemass_length = params.masspole * params.length
        temp = (force + polemass_length * state.theta_dot**2 * sin_theta) / total_mass
        theta_acc = (params.gravity * sin_theta - cos_theta * temp) / (
            params.length * (4.0 / 3.0 - params.masspole * cos_theta**2 / total_mass)
        )
        x_acc = temp - polemass_length * theta_acc * cos_theta / total_mass
        state = state.replace(
            x=state.x + params.tau * state.x_dot,
            x_dot=state.x_dot + params.tau * x_acc,
            theta=state.theta + params.tau * state.theta_dot,
            theta_dot=state.theta_dot + params.tau * theta_acc,
        )
        terminated = (jnp.abs(state.x) > params.x_threshold) | (jnp.abs(state.theta) > params.theta_threshold_radians)
        reward = jnp.ones_like(state.x)
        return self.observation(state), state, reward, terminated, {}

    @staticmethod
    def observation(state: CartPoleState) -> jax.Array:
        """``[4]``: x, x_dot, theta, theta_dot."""
        return jnp.stack([state.x, state.x_dot, state.theta, state.theta_dot])

    def observation_space(self, params):
        high = np.array([params.x_threshold * 2, np.inf, params.theta_threshold_radians * 2, np.inf])
        return Box(-high, high, (4,), default_float())

    def action_space(self, params):
        return Discrete(2)

    def render(self, state, params, height: int = 200, width: int = 300):
        scale = width / (params.x_threshold * 2)
        cart_x = state.x * scale + width / 2
        cart_y = height * 0.75
        image = rendering.canvas(height, width)
        image = rendering.fill_rect(image, 0, cart_y, width, cart_y + 1, rendering.BLACK)
        image = rendering.fill_rect(image, cart_x - 25, cart_y - 15, cart_x + 25, cart_y + 15, rendering.BLACK)
        pole = 2 * params.length * scale * 0.5
        tip_x = cart_x + pole * jnp.sin(state.theta)
        tip_y = cart_y - 8 - pole * jnp.cos(state.theta)
        image = rendering.draw_segment(image, cart_x, cart_y - 8, tip_x, tip_y, 8, (202, 152, 101))
        return rendering.fill_circle(image, cart_x, cart_y - 8, 4, (129, 132, 203))

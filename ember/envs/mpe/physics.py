"""The MPE world: point masses in 2-D with damping, soft contact forces and speed limits.

One step (the original MPE ``World.step``):
  1. force = action force (movable agents) + contact forces between colliding entities,
     ``contact_force * delta / |delta| * margin * softplus(-(|delta| - r_a - r_b) / margin)``;
  2. ``vel <- vel * (1 - damping) + force / mass * dt`` (movable entities only), rescaled to
     ``max_speed`` when faster;
  3. ``pos <- pos + vel * dt`` with the NEW velocity. (JaxMARL integrates the position with
     the previous velocity; this follows MPE/PettingZoo.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Bodies:
    """Static per-entity properties, agents first then landmarks (``[entities]`` each)."""

    radius: np.ndarray
    movable: np.ndarray  # bool
    collide: np.ndarray  # bool
    mass: np.ndarray
    max_speed: np.ndarray  # np.inf: no limit
    damping: float = 0.25
    contact_force: float = 1e2
    contact_margin: float = 1e-3
    dt: float = 0.1


# Discrete MPE actions: no-op, -x, +x, -y, +y.
DISCRETE_DIRECTIONS = np.array([[0.0, 0.0], [-1.0, 0.0], [1.0, 0.0], [0.0, -1.0], [0.0, 1.0]])


def action_force(actions: jax.Array, accel: np.ndarray) -> jax.Array:
    """``[agents, 2]`` forces for discrete actions ``[agents]`` scaled by each agent's ``accel``."""
    return jnp.asarray(DISCRETE_DIRECTIONS)[actions] * jnp.asarray(accel)[:, None]


def pairwise(pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``delta[a, b] = pos[a] - pos[b]`` ([entities, entities, 2]) and its length."""
    delta = pos[:, None, :] - pos[None, :, :]
    return delta, jnp.sqrt(jnp.sum(delta**2, axis=-1))


def colliding(pos: jax.Array, bodies: Bodies) -> jax.Array:
    """``[entities, entities]`` bool: distinct entities that both collide and overlap."""
    _, distance = pairwise(pos)
    both = bodies.collide[:, None] & bodies.collide[None, :] & ~np.eye(len(bodies.radius), dtype=bool)
    return both & (distance < (bodies.radius[:, None] + bodies.radius[None, :]))


def contact_forces(pos: jax.Array, bodies: Bodies) -> jax.Array:
    """``[entities, 2]`` total soft contact force on each movable entity."""
    delta, distance = pairwise(pos)
    count = len(bodies.radius)
    interacting = bodies.collide[:, None] & bodies.collide[None, :] & ~np.eye(count, dtype=bool)
    distance = jnp.where(interacting, distance, 1.0)  # no 0/0 on the diagonal
    k = bodies.contact_margin
    penetration = jnp.logaddexp(0.0, -(distance - (bodies.radius[:, None] + bodies.radius[None, :])) / k) * k
    force = bodies.contact_force * delta / distance[..., None] * penetration[..., None]
    force = jnp.where(interacting[..., None], force, 0.0).sum(axis=1)
    return force * bodies.movable[:, None]


def world_step(pos: jax.Array, vel: jax.Array, agent_force: jax.Array, bodies: Bodies) -> tuple[jax.Array, jax.Array]:
    """``(pos, vel)`` ([entities, 2]) after one step under ``agent_force`` ([agents, 2])."""
    landmarks = pos.shape[0] - agent_force.shape[0]
    force = jnp.concatenate([agent_force, jnp.zeros((landmarks, 2), agent_force.dtype)]) + contact_forces(pos, bodies)
    movable = bodies.movable[:, None]
    vel = vel * (1 - bodies.damping) + jnp.where(movable, force / bodies.mass[:, None] * bodies.dt, 0.0)
    speed = jnp.sqrt(jnp.sum(vel**2, axis=-1, keepdims=True))
    limit = bodies.max_speed[:, None]
    vel = jnp.where(speed > limit, vel / jnp.maximum(speed, 1e-12) * limit, vel)
    return pos + vel * bodies.dt, vel


def others(values: jax.Array, index: int, count: int) -> jax.Array:
    """``values[:count]`` without row ``index``, in order: ``[count - 1, ...]``."""
    keep = np.array([i for i in range(count) if i != index])
    return values[keep]


def render_world(pos: jax.Array, bodies: Bodies, colours, size: int = 200, extent: float = 1.5):
    """Entities as discs on a white canvas covering ``[-extent, extent]^2``."""
    from ember.envs import rendering

    image = rendering.canvas(size, size)
    scale = size / (2 * extent)
    for index in reversed(range(pos.shape[0])):  # agents drawn last, on top
        x = (pos[index, 0] + extent) * scale
        y = (extent - pos[index, 1]) * scale
        image = rendering.fill_circle(image, x, y, max(float(bodies.radius[index]) * scale, 1.5), colours[index])
    return image

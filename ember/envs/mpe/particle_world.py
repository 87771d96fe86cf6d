"""What every MPE scenario shares: the state (entity positions and velocities, agents
first), the step (each agent's action becomes a force, then one physics tick of
:mod:`ember.envs.mpe.physics`), the action space and the colours.

Actions, as JaxMARL's MPE: ``Discrete(5)`` (no-op, -x, +x, -y, +y, a force of ``accel``), or
with ``continuous_actions`` (the ``-continuous`` environment ids) ``Box(0, 1, (5,))``, the force
``accel * (a[2] - a[1], a[4] - a[3])``.

A scenario sets ``agents``, ``bodies`` (:class:`~ember.envs.mpe.physics.Bodies`) and
``accel`` (``[agents]`` force per action) and defines ``reset_env``, ``observation(state)``,
``rewards(state, params)``, ``observation_space`` and ``render``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs import noise as noise_lib
from ember.envs.environment import EnvState
from ember.envs.mpe import physics
from ember.envs.multi_agent import MultiAgentEnvironment
from ember.envs.spaces import Box, Dict, Discrete

AGENT_COLOUR, LANDMARK_COLOUR = (115, 243, 115), (64, 64, 64)


@struct.dataclass
class MPEState(EnvState):
    pos: jax.Array  # [entities, 2], agents first
    vel: jax.Array  # [entities, 2]


@struct.dataclass
class GoalMPEState(MPEState):
    goal: jax.Array  # int32: the index (among the landmarks) of the goal landmark


class ParticleWorld(MultiAgentEnvironment):
    """The shared step and action space of the MPE scenarios (see the module docstring)."""

    bodies: physics.Bodies
    accel: np.ndarray
    continuous_actions: bool = False

    def step_env(self, noise, state, actions, params):
        force = self.agent_forces([actions[agent] for agent in self.agents], self.accel).astype(state.pos.dtype)
        pos, vel = physics.world_step(state.pos, state.vel, force, self.bodies)
        state = state.replace(pos=pos, vel=vel)
        return self.observation(state), state, self.rewards(state, params), jnp.asarray(False), {}

    def agent_forces(self, actions, accel: np.ndarray) -> jax.Array:
        """``[len(actions), 2]`` forces of the movement ``actions`` (one per moving agent)."""
        if self.continuous_actions:
            stacked = jnp.stack([jnp.asarray(a, jnp.float32) for a in actions])
            return jnp.stack([stacked[:, 2] - stacked[:, 1], stacked[:, 4] - stacked[:, 3]], axis=1) * accel[:, None]
        return physics.action_force(jnp.stack(actions), accel)

    def reset_with_goal(self, noise, num_landmarks: int, goals: int | None = None) -> GoalMPEState:
        """Every entity uniform in ``[-1, 1]^2`` (``2 * entities`` noise words), at rest, and a goal
        landmark drawn uniformly (the last word; with ``goals``, one per each of the last
        ``goals`` words, ``goal`` then ``[goals]``)."""
        words = 1 if goals is None else goals
        pos = noise_lib.uniform(noise[:-words], -1.0, 1.0).reshape(-1, 2)
        goal = noise_lib.randint(noise[-1] if goals is None else noise[-words:], 0, num_landmarks)
        return GoalMPEState(time=jnp.int32(0), pos=pos, vel=jnp.zeros_like(pos), goal=goal)

    def movement_space(self):
        """One moving agent's action space."""
        return Box(0.0, 1.0, (5,)) if self.continuous_actions else Discrete(5)

    def action_space(self, params):
        return Dict({agent: self.movement_space() for agent in self.agents})


__all__ = ["AGENT_COLOUR", "LANDMARK_COLOUR", "GoalMPEState", "MPEState", "ParticleWorld"]

"""What every MPE scenario shares: the state (entity positions and velocities, agents
first), the step (each agent's discrete action becomes a force, then one physics tick of
:mod:`ember.envs.mpe.physics`), the ``Discrete(5)`` action space and the colours.

A scenario sets ``agents``, ``bodies`` (:class:`~ember.envs.mpe.physics.Bodies`) and
``accel`` (``[agents]`` force per action) and defines ``reset_env``, ``observation(state)``,
``rewards(state, params)``, ``observation_space`` and ``render``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs.environment import EnvState
from ember.envs.mpe import physics
from ember.envs.multi_agent import MultiAgentEnvironment
from ember.envs.spaces import Dict, Discrete

AGENT_COLOUR, LANDMARK_COLOUR = (115, 243, 115), (64, 64, 64)


@struct.dataclass
class MPEState(EnvState):
    pos: jax.Array  # [entities, 2], agents first
    vel: jax.Array  # [entities, 2]


class ParticleWorld(MultiAgentEnvironment):
    """The shared step and action space of the MPE scenarios (see the module docstring)."""

    bodies: physics.Bodies
    accel: np.ndarray

    def step_env(self, noise, state, actions, params):
        action_array = jnp.stack([actions[agent] for agent in self.agents])
        force = physics.action_force(action_array, self.accel).astype(state.pos.dtype)
        pos, vel = physics.world_step(state.pos, state.vel, force, self.bodies)
        state = state.replace(pos=pos, vel=vel)
        return self.observation(state), state, self.rewards(state, params), jnp.asarray(False), {}

    def action_space(self, params):
        return Dict({agent: Discrete(5) for agent in self.agents})


__all__ = ["AGENT_COLOUR", "LANDMARK_COLOUR", "MPEState", "ParticleWorld"]

"""``MPE-simple_spread``: N agents cover N landmarks while avoiding each other.

Agent ``i`` observes ``[vel(2), pos(2), landmark - pos (2 L), other agents - pos (2 (N-1)),
communication (2 (N-1), always 0: agents are silent)]``. Actions ``Discrete(5)``: no-op,
-x, +x, -y, +y (force 5). Reward of agent ``i``: ``local_ratio * (-collisions of i) +
(1 - local_ratio) * (-sum over landmarks of the closest agent's distance)``. Never
terminates; truncated after 25 steps (PettingZoo's ``max_cycles``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs import noise as noise_lib
from ember.envs.environment import EnvParams
from ember.envs.mpe import physics
from ember.envs.mpe.particle_world import AGENT_COLOUR, LANDMARK_COLOUR, MPEState, ParticleWorld
from ember.envs.spaces import Box, Dict, default_float

COMMUNICATION_DIM = 2


@struct.dataclass
class SimpleSpreadParams(EnvParams):
    max_steps_in_episode: int = 25
    local_ratio: float = 0.5


class SimpleSpread(ParticleWorld):
    def __init__(self, num_agents: int = 3, num_landmarks: int = 3):
        if num_agents < 1 or num_landmarks < 1:
            raise ValueError(f"SimpleSpread: need >= 1 agent and landmark, got {num_agents}, {num_landmarks}")
        self.agents = [f"agent_{i}" for i in range(num_agents)]
        self.num_landmarks = num_landmarks
        entities = num_agents + num_landmarks
        is_agent = np.arange(entities) < num_agents
        self.bodies = physics.Bodies(
            radius=np.where(is_agent, 0.15, 0.05),
            movable=is_agent,
            collide=is_agent,
            mass=np.ones(entities),
            max_speed=np.full(entities, np.inf),
        )
        self.accel = np.full(num_agents, 5.0)
        self.reset_noise_words = 2 * entities

    @property
    def default_params(self) -> SimpleSpreadParams:
        return SimpleSpreadParams()

    def reset_env(self, noise, params):
        pos = noise_lib.uniform(noise, -1.0, 1.0).reshape(-1, 2)
        state = MPEState(time=jnp.int32(0), pos=pos, vel=jnp.zeros_like(pos))
        return self.observation(state), state

    def observation(self, state: MPEState) -> dict:
        n = self.num_agents
        observations = {}
        for i, agent in enumerate(self.agents):
            own = state.pos[i]
            observations[agent] = jnp.concatenate(
                [
                    state.vel[i],
                    own,
                    (state.pos[n:] - own).ravel(),
                    (physics.others(state.pos, i, n) - own).ravel(),
                    jnp.zeros((n - 1) * COMMUNICATION_DIM, state.pos.dtype),
                ]
            )
        return observations

    def rewards(self, state: MPEState, params) -> dict:
        n = self.num_agents
        collisions = physics.colliding(state.pos, self.bodies)[:n, :n].sum(axis=1)
        _, distance = physics.pairwise(state.pos)
        cover = -distance[n:, :n].min(axis=1).sum()
        return {
            agent: params.local_ratio * -collisions[i] + (1 - params.local_ratio) * cover
            for i, agent in enumerate(self.agents)
        }

    def observation_space(self, params):
        size = 4 + 2 * self.num_landmarks + (2 + COMMUNICATION_DIM) * (self.num_agents - 1)
        return Dict({agent: Box(-np.inf, np.inf, (size,), default_float()) for agent in self.agents})

    def render(self, state, params):
        colours = [AGENT_COLOUR] * self.num_agents + [LANDMARK_COLOUR] * self.num_landmarks
        return physics.render_world(state.pos, self.bodies, colours)


class SimpleSpreadContinuous(SimpleSpread):
    continuous_actions = True

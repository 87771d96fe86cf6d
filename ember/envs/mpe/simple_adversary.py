"""``MPE-simple_adversary``: good agents know which landmark is the goal, the adversary does
not; the good agents are rewarded for one of them reaching the goal while the adversary stays
far, the adversary for reaching it itself.

Agents ``adversary_0`` then ``agent_0``, ``agent_1``; two landmarks. Observations (JaxMARL's):
the adversary ``[landmark - pos(2 x 2), other agents - pos(2 x 2)]`` (8 values), a good agent
``[goal - pos(2), landmark - pos(2 x 2), other agents - pos(2 x 2)]`` (10). Rewards: the
adversary ``-|adversary - goal|``; every good agent ``sum over adversaries |adversary - goal| -
min over good agents |agent - goal|``. Nothing collides. Actions as every MPE scenario
(``Discrete(5)``, or ``Box(0, 1, (5,))`` in ``MPE-simple_adversary-continuous``). Never
terminates; truncated after 25 steps.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs.environment import EnvParams
from ember.envs.mpe import physics
from ember.envs.mpe.particle_world import AGENT_COLOUR, LANDMARK_COLOUR, GoalMPEState, ParticleWorld
from ember.envs.mpe.simple_tag import ADVERSARY_COLOUR
from ember.envs.spaces import Box, Dict, default_float


@struct.dataclass
class SimpleAdversaryParams(EnvParams):
    max_steps_in_episode: int = 25


class SimpleAdversary(ParticleWorld):
    def __init__(self, num_good: int = 2, num_adversaries: int = 1, num_landmarks: int = 2):
        if num_good < 1 or num_adversaries < 1 or num_landmarks < 1:
            raise ValueError(
                "SimpleAdversary: need >= 1 good agent, adversary and landmark, "
                f"got {num_good}, {num_adversaries}, {num_landmarks}"
            )
        self.num_good, self.num_adversaries, self.num_landmarks = num_good, num_adversaries, num_landmarks
        self.agents = [f"adversary_{i}" for i in range(num_adversaries)] + [f"agent_{i}" for i in range(num_good)]
        agents = num_good + num_adversaries
        entities = agents + num_landmarks
        self.bodies = physics.Bodies(
            radius=np.where(np.arange(entities) < agents, 0.15, 0.08),
            movable=np.arange(entities) < agents,
            collide=np.zeros(entities, bool),
            mass=np.ones(entities),
            max_speed=np.full(entities, np.inf),
        )
        self.accel = np.full(agents, 5.0)
        self.reset_noise_words = 2 * entities + 1

    @property
    def default_params(self) -> SimpleAdversaryParams:
        return SimpleAdversaryParams()

    def reset_env(self, noise, params):
        state = self.reset_with_goal(noise, self.num_landmarks)
        return self.observation(state), state

    def observation(self, state: GoalMPEState) -> dict:
        n = self.num_agents
        landmarks = state.pos[n:]
        observations = {}
        for i, agent in enumerate(self.agents):
            own = state.pos[i]
            seen = [(landmarks - own).ravel(), (physics.others(state.pos, i, n) - own).ravel()]
            if i >= self.num_adversaries:
                seen.insert(0, landmarks[state.goal] - own)
            observations[agent] = jnp.concatenate(seen)
        return observations

    def rewards(self, state: GoalMPEState, params) -> dict:
        del params
        a, n = self.num_adversaries, self.num_agents
        to_goal = jnp.linalg.norm(state.pos[:n] - state.pos[n + state.goal], axis=1)
        good = jnp.sum(to_goal[:a]) - jnp.min(to_goal[a:])
        return {agent: -to_goal[i] if i < a else good for i, agent in enumerate(self.agents)}

    def observation_space(self, params):
        size = 2 * self.num_landmarks + 2 * (self.num_agents - 1)
        return Dict({
            agent: Box(-np.inf, np.inf, (size + (2 if i >= self.num_adversaries else 0),), default_float())
            for i, agent in enumerate(self.agents)
        })  # fmt: skip

    def render(self, state, params):
        colours = [ADVERSARY_COLOUR] * self.num_adversaries + [AGENT_COLOUR] * self.num_good
        return physics.render_world(state.pos, self.bodies, colours + [LANDMARK_COLOUR] * self.num_landmarks)


class SimpleAdversaryContinuous(SimpleAdversary):
    continuous_actions = True

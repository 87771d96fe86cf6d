"""``MPE-simple_push``: a good agent heads for its goal landmark (one of two) while an
adversary, who does not know which landmark is the goal, pushes it away.

Agents ``adversary_0`` then ``agent_0``. Observations (JaxMARL's, after the MPE code): the good
agent ``[vel(2), goal - pos(2), goal colour(3), landmark - pos(2 x 2), landmark colours(6),
other agent - pos(2)]`` (19 values), the adversary ``[vel(2), landmark - pos(2 x 2), other agent
- pos(2)]`` (8). Rewards: the good agent ``-|goal - pos|``; the adversary ``min over good agents
|goal - agent| - |goal - own pos|``. Agents (radius 0.05) collide; landmarks (0.2) do not.
Actions as every MPE scenario (``Discrete(5)``, or ``Box(0, 1, (5,))`` in
``MPE-simple_push-continuous``). Never terminates; truncated after 25 steps.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs.environment import EnvParams
from ember.envs.mpe import physics
from ember.envs.mpe.particle_world import AGENT_COLOUR, GoalMPEState, ParticleWorld
from ember.envs.mpe.simple_tag import ADVERSARY_COLOUR
from ember.envs.spaces import Box, Dict, default_float

LANDMARK_COLOURS = np.array([[0.1, 0.9, 0.1], [0.1, 0.1, 0.9]])
"""The two landmarks' colours, which the good agent observes (its goal's as a one-hot-like code)."""


@struct.dataclass
class SimplePushParams(EnvParams):
    max_steps_in_episode: int = 25


class SimplePush(ParticleWorld):
    num_landmarks = 2

    def __init__(self):
        self.agents = ["adversary_0", "agent_0"]
        entities = 2 + self.num_landmarks
        self.bodies = physics.Bodies(
            radius=np.array([0.05, 0.05, 0.2, 0.2]),
            movable=np.arange(entities) < 2,
            collide=np.arange(entities) < 2,
            mass=np.ones(entities),
            max_speed=np.full(entities, np.inf),
        )
        self.accel = np.full(2, 5.0)
        self.reset_noise_words = 2 * entities + 1

    @property
    def default_params(self) -> SimplePushParams:
        return SimplePushParams()

    def reset_env(self, noise, params):
        state = self.reset_with_goal(noise, self.num_landmarks)
        return self.observation(state), state

    def observation(self, state: GoalMPEState) -> dict:
        landmarks = state.pos[2:]
        goal = landmarks[state.goal]
        goal_colour = jnp.full(3, 0.25, state.pos.dtype).at[state.goal + 1].set(0.75)
        adversary, agent = state.pos[0], state.pos[1]
        return {
            "adversary_0": jnp.concatenate([state.vel[0], (landmarks - adversary).ravel(), agent - adversary]),
            "agent_0": jnp.concatenate([
                state.vel[1], goal - agent, goal_colour, (landmarks - agent).ravel(),
                jnp.asarray(LANDMARK_COLOURS.ravel(), state.pos.dtype), adversary - agent,
            ]),
        }  # fmt: skip

    def rewards(self, state: GoalMPEState, params) -> dict:
        del params
        goal = state.pos[2 + state.goal]
        agent_distance = jnp.linalg.norm(goal - state.pos[1])
        return {"adversary_0": agent_distance - jnp.linalg.norm(goal - state.pos[0]), "agent_0": -agent_distance}

    def observation_space(self, params):
        dtype = default_float()
        return Dict({"adversary_0": Box(-np.inf, np.inf, (8,), dtype), "agent_0": Box(-np.inf, np.inf, (19,), dtype)})

    def render(self, state, params):
        landmarks = [tuple(int(255 * c) for c in colour) for colour in LANDMARK_COLOURS]
        return physics.render_world(state.pos, self.bodies, [ADVERSARY_COLOUR, AGENT_COLOUR, *landmarks])


class SimplePushContinuous(SimplePush):
    continuous_actions = True

"""``MPE-simple_reference``: two agents, three landmarks; each agent's target landmark is known
only to the other agent, so both must move and speak.

An action both moves and speaks (a word of 10): ``Discrete(50)`` (movement ``a % 5`` as every
MPE scenario, word ``a // 5`` one-hot), or in ``MPE-simple_reference-continuous`` ``Box(0, 1,
(15,))`` (movement from the first 5 values, the message the last 10). Observations (JaxMARL's):
``[vel(2), landmark - pos(3 x 2), the other agent's target colour(3: 0.75 at it, 0.25
elsewhere), the other agent's message of this step(10)]`` (21 values). Agent ``i`` is rewarded
``local_ratio * d_i + (1 - local_ratio) * mean(d)`` where ``d_i = -|other agent - its target|``.
Nothing collides. Never terminates; truncated after 25 steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs.environment import EnvParams
from ember.envs.mpe import physics
from ember.envs.mpe.particle_world import AGENT_COLOUR, GoalMPEState, ParticleWorld
from ember.envs.spaces import Box, Dict, Discrete, default_float

WORDS = 10
LANDMARK_COLOURS = [(191, 64, 64), (64, 191, 64), (64, 64, 191)]


@struct.dataclass
class ReferenceState(GoalMPEState):
    messages: jax.Array  # [2, WORDS]: what each agent said this step (zeros at reset)


@struct.dataclass
class SimpleReferenceParams(EnvParams):
    max_steps_in_episode: int = 25
    local_ratio: float = 0.5


class SimpleReference(ParticleWorld):
    num_landmarks = 3

    def __init__(self):
        self.agents = ["agent_0", "agent_1"]
        entities = 2 + self.num_landmarks
        self.bodies = physics.Bodies(
            radius=np.array([0.15, 0.15, 0.2, 0.2, 0.2]),
            movable=np.arange(entities) < 2,
            collide=np.zeros(entities, bool),
            mass=np.ones(entities),
            max_speed=np.full(entities, np.inf),
        )
        self.accel = np.full(2, 5.0)
        self.reset_noise_words = 2 * entities + 2

    @property
    def default_params(self) -> SimpleReferenceParams:
        return SimpleReferenceParams()

    def reset_env(self, noise, params):
        state = self.reset_with_goal(noise, self.num_landmarks, goals=2)
        state = ReferenceState(**vars(state), messages=jnp.zeros((2, WORDS), state.pos.dtype))
        return self.observation(state), state

    def step_env(self, noise, state, actions, params):
        chosen = [actions[agent] for agent in self.agents]
        if self.continuous_actions:
            moves = [jnp.asarray(a, jnp.float32)[:5] for a in chosen]
            messages = jnp.stack([jnp.asarray(a, state.pos.dtype)[5:] for a in chosen])
        else:
            moves = [a % 5 for a in chosen]
            messages = jax.nn.one_hot(jnp.stack([a // 5 for a in chosen]), WORDS, dtype=state.pos.dtype)
        force = self.agent_forces(moves, self.accel).astype(state.pos.dtype)
        pos, vel = physics.world_step(state.pos, state.vel, force, self.bodies)
        state = state.replace(pos=pos, vel=vel, messages=messages)
        return self.observation(state), state, self.rewards(state, params), jnp.asarray(False), {}

    def observation(self, state: ReferenceState) -> dict:
        observations = {}
        for i, agent in enumerate(self.agents):
            other = 1 - i
            target = jnp.full(3, 0.25, state.pos.dtype).at[state.goal[other]].set(0.75)
            landmarks = (state.pos[2:] - state.pos[i]).ravel()
            observations[agent] = jnp.concatenate([state.vel[i], landmarks, target, state.messages[other]])
        return observations

    def rewards(self, state: ReferenceState, params) -> dict:
        # d[i]: how far agent i's partner is from the partner's target (what agent i can tell it).
        partner = np.array([1, 0])
        d = -jnp.linalg.norm(state.pos[partner] - state.pos[2 + state.goal[partner]], axis=1)
        shared = d.mean()
        return {
            agent: params.local_ratio * d[i] + (1 - params.local_ratio) * shared for i, agent in enumerate(self.agents)
        }

    def action_space(self, params):
        space = Box(0.0, 1.0, (5 + WORDS,)) if self.continuous_actions else Discrete(5 * WORDS)
        return Dict({agent: space for agent in self.agents})

    def observation_space(self, params):
        return Dict({agent: Box(-np.inf, np.inf, (21,), default_float()) for agent in self.agents})

    def render(self, state, params):
        return physics.render_world(state.pos, self.bodies, [AGENT_COLOUR] * 2 + LANDMARK_COLOURS)


class SimpleReferenceContinuous(SimpleReference):
    continuous_actions = True

"""``MPE-simple_speaker_listener``: a speaker who sees which of three landmarks is the goal but
cannot move tells a listener who can move but cannot see it.

Agents ``speaker_0`` (immovable) and ``listener_0``. The speaker's action is its message:
``Discrete(3)`` (a one-hot word), or in ``MPE-simple_speaker_listener-continuous`` ``Box(0, 1,
(3,))`` (the word itself); the listener moves as in every MPE scenario. Observations
(JaxMARL's): the speaker the goal's colour code (3 values: 0.65 at the goal, 0.15 elsewhere);
the listener ``[vel(2), landmark - pos(3 x 2), the speaker's message of this step(3)]`` (11).
Both are rewarded ``-|listener - goal|^2``. Nothing collides. Never terminates; truncated after
25 steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs.environment import EnvParams
from ember.envs.mpe import physics
from ember.envs.mpe.particle_world import AGENT_COLOUR, GoalMPEState, ParticleWorld
from ember.envs.mpe.simple_tag import ADVERSARY_COLOUR
from ember.envs.spaces import Box, Dict, Discrete, default_float

WORDS = 3
LANDMARK_COLOURS = [(166, 38, 38), (38, 166, 38), (38, 38, 166)]


@struct.dataclass
class SpeakerListenerState(GoalMPEState):
    message: jax.Array  # [WORDS]: what the speaker said this step (zeros at reset)


@struct.dataclass
class SimpleSpeakerListenerParams(EnvParams):
    max_steps_in_episode: int = 25


class SimpleSpeakerListener(ParticleWorld):
    num_landmarks = 3

    def __init__(self):
        self.agents = ["speaker_0", "listener_0"]
        entities = 2 + self.num_landmarks
        self.bodies = physics.Bodies(
            radius=np.array([0.075, 0.075, 0.04, 0.04, 0.04]),
            movable=np.arange(entities) == 1,
            collide=np.zeros(entities, bool),
            mass=np.ones(entities),
            max_speed=np.full(entities, np.inf),
        )
        self.accel = np.full(2, 5.0)
        self.reset_noise_words = 2 * entities + 1

    @property
    def default_params(self) -> SimpleSpeakerListenerParams:
        return SimpleSpeakerListenerParams()

    def reset_env(self, noise, params):
        state = self.reset_with_goal(noise, self.num_landmarks)
        state = SpeakerListenerState(**vars(state), message=jnp.zeros(WORDS, state.pos.dtype))
        return self.observation(state), state

    def step_env(self, noise, state, actions, params):
        said = actions["speaker_0"]
        if self.continuous_actions:
            message = jnp.asarray(said, state.pos.dtype)
        else:
            message = jax.nn.one_hot(said, WORDS, dtype=state.pos.dtype)
        listener_force = self.agent_forces([actions["listener_0"]], self.accel[1:])
        force = jnp.concatenate([jnp.zeros((1, 2)), listener_force]).astype(state.pos.dtype)
        pos, vel = physics.world_step(state.pos, state.vel, force, self.bodies)
        state = state.replace(pos=pos, vel=vel, message=message)
        return self.observation(state), state, self.rewards(state, params), jnp.asarray(False), {}

    def observation(self, state: SpeakerListenerState) -> dict:
        listener = state.pos[1]
        return {
            "speaker_0": jnp.full(3, 0.15, state.pos.dtype).at[state.goal].set(0.65),
            "listener_0": jnp.concatenate([state.vel[1], (state.pos[2:] - listener).ravel(), state.message]),
        }

    def rewards(self, state: SpeakerListenerState, params) -> dict:
        del params
        reward = -jnp.sum(jnp.square(state.pos[1] - state.pos[2 + state.goal]))
        return {agent: reward for agent in self.agents}

    def action_space(self, params):
        speaker = Box(0.0, 1.0, (WORDS,)) if self.continuous_actions else Discrete(WORDS)
        return Dict({"speaker_0": speaker, "listener_0": self.movement_space()})

    def observation_space(self, params):
        dtype = default_float()
        return Dict({"speaker_0": Box(-np.inf, np.inf, (3,), dtype), "listener_0": Box(-np.inf, np.inf, (11,), dtype)})

    def render(self, state, params):
        return physics.render_world(state.pos, self.bodies, [ADVERSARY_COLOUR, AGENT_COLOUR, *LANDMARK_COLOURS])


class SimpleSpeakerListenerContinuous(SimpleSpeakerListener):
    continuous_actions = True

"""``MPE-simple_tag``: predator-prey. Slower adversaries chase faster good agents among
large obstacles.

Agents: ``adversary_0..`` then ``agent_0..``. Observation ``[vel(2), pos(2), obstacle - pos
(2 obstacles), other agents - pos (2 (N-1)), velocities of the other good agents]``
(adversaries: 16 values, the good agent: 14 with the defaults). Actions ``Discrete(5)``
(no-op, -x, +x, -y, +y; force 3 adversaries, 4 good agents; top speed 1.0 / 1.3). Each
adversary gets +10 per (adversary, good agent) contact, summed over all pairs; a good agent
gets -10 per adversary touching it and a penalty for leaving the ``[-0.9, 0.9]`` square
(``10 (|x| - 0.9)`` up to 1, then ``min(exp(2|x| - 2), 10)``, per coordinate). Never
terminates; truncated after 25 steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs import noise as noise_lib
from ember.envs.environment import EnvParams
from ember.envs.mpe import physics
from ember.envs.mpe.particle_world import AGENT_COLOUR, LANDMARK_COLOUR, MPEState, ParticleWorld
from ember.envs.spaces import Box, Dict, default_float

ADVERSARY_COLOUR = (243, 115, 115)


@struct.dataclass
class SimpleTagParams(EnvParams):
    max_steps_in_episode: int = 25


def boundary_penalty(x: jax.Array) -> jax.Array:
    """MPE's soft wall for one coordinate's absolute value ``x``."""
    return jnp.where(x < 0.9, 0.0, jnp.where(x < 1.0, (x - 0.9) * 10, jnp.minimum(jnp.exp(2 * x - 2), 10.0)))


class SimpleTag(ParticleWorld):
    def __init__(self, num_good: int = 1, num_adversaries: int = 3, num_obstacles: int = 2):
        if num_good < 1 or num_adversaries < 1 or num_obstacles < 0:
            raise ValueError(
                "SimpleTag: need >= 1 good agent and adversary and >= 0 obstacles, "
                f"got {num_good}, {num_adversaries}, {num_obstacles}"
            )
        self.num_good, self.num_adversaries, self.num_obstacles = num_good, num_adversaries, num_obstacles
        self.agents = [f"adversary_{i}" for i in range(num_adversaries)] + [f"agent_{i}" for i in range(num_good)]
        agents = num_adversaries + num_good
        is_adversary = np.arange(agents) < num_adversaries
        self.bodies = physics.Bodies(
            radius=np.concatenate([np.where(is_adversary, 0.075, 0.05), np.full(num_obstacles, 0.2)]),
            movable=np.arange(agents + num_obstacles) < agents,
            collide=np.ones(agents + num_obstacles, bool),
            mass=np.ones(agents + num_obstacles),
            max_speed=np.concatenate([np.where(is_adversary, 1.0, 1.3), np.full(num_obstacles, np.inf)]),
        )
        self.accel = np.where(is_adversary, 3.0, 4.0)
        self.reset_noise_words = 2 * (agents + num_obstacles)

    @property
    def default_params(self) -> SimpleTagParams:
        return SimpleTagParams()

    def reset_env(self, noise, params):
        n = self.num_agents
        words = noise.reshape(-1, 2)
        pos = jnp.concatenate([noise_lib.uniform(words[:n], -1.0, 1.0), noise_lib.uniform(words[n:], -0.9, 0.9)])
        state = MPEState(time=jnp.int32(0), pos=pos, vel=jnp.zeros_like(pos))
        return self.observation(state), state

    def observation(self, state: MPEState) -> dict:
        n, a = self.num_agents, self.num_adversaries
        observations = {}
        for i, agent in enumerate(self.agents):
            own = state.pos[i]
            good_others = [j for j in range(a, n) if j != i]
            observations[agent] = jnp.concatenate(
                [
                    state.vel[i],
                    own,
                    (state.pos[n:] - own).ravel(),
                    (physics.others(state.pos, i, n) - own).ravel(),
                    state.vel[np.array(good_others, dtype=int)].ravel(),
                ]
            )
        return observations

    def rewards(self, state: MPEState, params) -> dict:
        del params  # simple_tag's rewards have no parameters
        a = self.num_adversaries
        contacts = physics.colliding(state.pos, self.bodies)[a : self.num_agents, :a]  # [good, adversary]
        adversary_reward = 10.0 * contacts.sum()
        rewards = {agent: adversary_reward.astype(state.pos.dtype) for agent in self.agents[:a]}
        for g, agent in enumerate(self.agents[a:]):
            penalty = boundary_penalty(jnp.abs(state.pos[a + g])).sum()
            rewards[agent] = -10.0 * contacts[g].sum() - penalty
        return rewards

    def observation_space(self, params):
        def size(i):
            good_others = self.num_good - (0 if i < self.num_adversaries else 1)
            return 4 + 2 * self.num_obstacles + 2 * (self.num_agents - 1) + 2 * good_others

        return Dict({agent: Box(-np.inf, np.inf, (size(i),), default_float()) for i, agent in enumerate(self.agents)})

    def render(self, state, params):
        colours = [ADVERSARY_COLOUR] * self.num_adversaries + [AGENT_COLOUR] * self.num_good
        return physics.render_world(state.pos, self.bodies, colours + [LANDMARK_COLOUR] * self.num_obstacles)


class SimpleTagContinuous(SimpleTag):
    continuous_actions = True

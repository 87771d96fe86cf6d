"""MPE scenarios (simple_spread, simple_tag, simple_push, simple_adversary,
simple_speaker_listener; discrete and continuous actions) against JaxMARL's implementation: from
identical states and actions, the same velocities (forces, damping, speed limits), messages,
observations and rewards;
positions are integrated with the new velocity as in the original MPE (JaxMARL uses the
old one, a documented difference)."""

import jax
import jax.numpy as jnp
import jaxmarl
import numpy as np
import pytest

import ember.envs
from ember.envs.mpe import physics
from ember.envs.spaces import Discrete
from tests.host_random import numpy_rng
from tests.tolerances import assert_allclose

CASES = {
    "MPE-simple_spread": "MPE_simple_spread_v3",
    "MPE-simple_tag": "MPE_simple_tag_v3",
    "MPE-simple_push": "MPE_simple_push_v3",
    "MPE-simple_adversary": "MPE_simple_adversary_v3",
    "MPE-simple_speaker_listener": "MPE_simple_speaker_listener_v4",
    "MPE-simple_reference": "MPE_simple_reference_v3",
}
CASES |= {f"{ours}-continuous": reference for ours, reference in CASES.items()}


def reference_env(env_id):
    action_type = "Continuous" if env_id.endswith("-continuous") else "Discrete"
    return jaxmarl.make(CASES[env_id], action_type=action_type)


def at_reference(state, reference_state):
    """Our state holding JaxMARL's entities (and goal, and the speaker's message)."""
    fields = dict(pos=reference_state.p_pos, vel=reference_state.p_vel)
    if hasattr(state, "goal"):
        fields["goal"] = jnp.asarray(reference_state.goal, jnp.int32)
    if hasattr(state, "message"):
        fields["message"] = reference_state.c[0]
    if hasattr(state, "messages"):
        fields["messages"] = reference_state.c
    return state.replace(**fields)


def random_actions(env, params, generator, steps):
    """``steps`` action dicts drawn from each agent's space (every word and direction)."""
    spaces = env.action_space(params).spaces
    draws = []
    for _ in range(steps):
        draw = {}
        for agent, space in spaces.items():
            if isinstance(space, Discrete):
                draw[agent] = jnp.int32(generator.integers(0, space.n))
            else:
                draw[agent] = jnp.asarray(generator.uniform(0.0, 1.0, space.shape), jnp.float32)
        draws.append(draw)
    return draws


@pytest.mark.parametrize("env_id", sorted(CASES))
def test_matches_jaxmarl_physics_observations_and_rewards(env_id, rng):
    env, params = ember.envs.make(env_id)
    reference = reference_env(env_id)
    assert env.agents == reference.agents
    ours_step = jax.jit(env.step)
    # Observations and rewards of a state in one program: one compile rather than two.
    ours_obs_and_rewards = jax.jit(lambda s: (env.observation(s), env.rewards(s, params)))
    reference_step = jax.jit(reference.step_env)
    _, reference_state = jax.jit(reference.reset)(rng)  # one compile, where an eager reset compiles op by op
    # Crowd the agents so that contact forces and collision rewards are exercised.
    n = env.num_agents
    crowded = np.asarray(reference_state.p_pos).copy()
    spread = 1.5 * env.bodies.radius[:n].max()
    crowded[:n] = np.random.default_rng(n).uniform(-spread, spread, size=(n, 2))
    # ``done`` computed as step_env computes it (False here): weakly typed like step_env's, where
    # reset's jnp.array(False) is not, so reference_step compiles once rather than twice.
    done = reference_state.step >= reference.max_steps
    reference_state = reference_state.replace(p_pos=jnp.asarray(crowded), done=done)
    _, state = jax.jit(env.reset)(rng, params)
    for agent, space in env.observation_space(params).spaces.items():
        assert space.shape == reference.observation_space(agent).shape, agent
    saw_contact = False
    keys = jax.random.split(rng, 30)
    for t, actions in enumerate(random_actions(env, params, numpy_rng(rng), 30)):
        key = keys[t]
        state = at_reference(state, reference_state)
        _, next_state, _rewards, *_ = ours_step(key, state, actions, params)
        reference_obs, reference_next, reference_rewards, _, _ = reference_step(key, reference_state, actions)
        message = f"{env_id} step {t}"
        assert_allclose(next_state.vel[:n], reference_next.p_vel[:n], err_msg=message)
        expected_pos = np.asarray(reference_state.p_pos) + np.asarray(next_state.vel) * 0.1
        assert_allclose(next_state.pos, expected_pos, err_msg=message)
        # Observations and rewards as functions of the state: evaluated on JaxMARL's state.
        ours_obs, ours_rewards = ours_obs_and_rewards(at_reference(next_state, reference_next))
        for agent, value in ours_obs.items():
            assert_allclose(value, reference_obs[agent], err_msg=f"{message} obs {agent}")
        for agent, value in ours_rewards.items():
            assert_allclose(value, reference_rewards[agent], err_msg=f"{message} reward {agent}")
        saw_contact |= bool(physics.colliding(reference_next.p_pos, env.bodies)[:n, :n].any())
        reference_state = reference_next
    assert saw_contact or not env.bodies.collide[:n].any(), "the crowded start should produce collisions"


def test_multi_agent_auto_reset_and_all_key(rng):
    env, params = ember.envs.make("MPE-simple_spread", max_steps_in_episode=3)
    obs, state = jax.jit(env.reset)(rng, params)
    step = jax.jit(env.step)
    for t in range(3):
        actions = {agent: jnp.int32(t % 5) for agent in env.agents}
        obs, state, _rewards, terminated, truncated, info = step(jax.random.fold_in(rng, t), state, actions, params)
    assert bool(truncated["__all__"]) and all(bool(truncated[a]) for a in env.agents)
    assert not bool(terminated["__all__"])
    assert int(state.time) == 0
    for agent in env.agents:
        assert not np.allclose(obs[agent], info["final_observation"][agent])
    # Positions of the new episode are the reset draw: inside [-1, 1].
    assert float(jnp.abs(state.pos).max()) <= 1.0

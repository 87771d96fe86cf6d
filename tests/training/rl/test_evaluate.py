"""``evaluate`` compiles once per policy architecture: a ``make_act`` is a pytree whose parameters
are traced, so new parameters of the same network reuse the compiled program and return what the
per-call closures of before returned."""

import contextlib
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import ember.envs
from ember.models.policies import PolicyConfig
from ember.training.rl import dqn, multi_agent_ppo, ppo
from ember.training.rl.agent_view import stack_agents
from ember.training.rl.evaluate import evaluate


@contextlib.contextmanager
def compile_events() -> Iterator[list[str]]:
    """The names of JAX's compile events (tracing, lowering, XLA compile) in the ``with`` body."""
    events = []
    listener = lambda event, *_args, **_kw: events.append(event) if "/compile/" in event else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def assert_same_episodes(got, expected):
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def old_actor_act(policy, params, *, agents=None):
    """``make_act`` as it was: a closure over the parameters (the mode of the actor)."""

    def act(obs, key):
        if agents:
            obs = stack_agents(obs, agents)
        dist = policy.apply(params, obs, method=lambda module, x: module.actor(x))
        action = dist.env_action(dist.mode())
        return {agent: action[:, i] for i, agent in enumerate(agents)} if agents else action

    return act


def test_new_parameters_of_one_policy_reuse_the_compiled_evaluation(rng):
    env, env_params = ember.envs.make("CartPole-v1", max_steps_in_episode=40)
    config = ppo.PPOConfig(policy=PolicyConfig(hidden_sizes=(8,)))
    policy = ppo.make_policy(config, env, env_params)
    init_keys = jax.random.split(jax.random.fold_in(rng, 1), 2)
    params = [policy.init(k, jnp.zeros((1, 4))) for k in init_keys]

    with compile_events() as first_compiles:
        first = evaluate(ppo.make_act(policy, params[0]), env, env_params, rng, num_episodes=8)
    # a second make_policy, as `ember eval` and every make_act of the launcher build one: equal by value
    act = ppo.make_act(ppo.make_policy(config, env, env_params), params[1])
    with compile_events() as second_compiles:
        second = evaluate(act, env, env_params, rng, num_episodes=8)
    assert "/jax/core/compile/backend_compile_duration" in first_compiles
    assert second_compiles == []

    for p, got in zip(params, (first, second), strict=True):
        assert_same_episodes(got, evaluate(old_actor_act(policy, p), env, env_params, rng, num_episodes=8))
    assert not np.allclose(first[0], second[0])  # the second parameters were really used


def test_q_network_acts_share_one_compile_over_parameters_and_epsilon(rng):
    env, env_params = ember.envs.make("CartPole-v1", max_steps_in_episode=30)
    network = dqn.make_q_network(dqn.DQNConfig(policy=PolicyConfig(hidden_sizes=(8,))), env, env_params)
    init_keys = jax.random.split(jax.random.fold_in(rng, 1), 2)
    params = [network.init(k, jnp.zeros((1, 4))) for k in init_keys]

    greedy = evaluate(dqn.make_act(network, params[0]), env, env_params, rng, num_episodes=6)
    act = dqn.make_act(network, params[1], epsilon=0.5)
    with compile_events() as compiles:
        exploring = evaluate(act, env, env_params, rng, num_episodes=6)
    assert compiles == []

    for p, epsilon, got in zip(params, (0.0, 0.5), (greedy, exploring), strict=True):

        def old(obs, key, p=p, epsilon=epsilon):
            return dqn.epsilon_greedy(key, network.apply(p, obs), jnp.float32(epsilon))

        assert_same_episodes(got, evaluate(old, env, env_params, rng, num_episodes=6))


def test_multi_agent_policy_acts_with_dicts_and_compiles_once(rng):
    env, env_params = ember.envs.make("MPE-simple_spread", max_steps_in_episode=6)
    agents = list(env.agents)
    policy = multi_agent_ppo.make_policy(ppo.PPOConfig(policy=PolicyConfig(hidden_sizes=(8,))), env, env_params)
    obs = jnp.zeros((1, len(agents), env.observation_space(env_params)[agents[0]].shape[0]))
    params = [policy.init(k, obs, obs) for k in jax.random.split(jax.random.fold_in(rng, 1), 2)]

    first = evaluate(multi_agent_ppo.make_act(policy, params[0], agents), env, env_params, rng, num_episodes=3)
    act = multi_agent_ppo.make_act(policy, params[1], agents)
    with compile_events() as compiles:
        second = evaluate(act, env, env_params, rng, num_episodes=3)
    assert compiles == []

    for p, got in zip(params, (first, second), strict=True):
        old = old_actor_act(policy, p, agents=agents)
        assert_same_episodes(got, evaluate(old, env, env_params, rng, num_episodes=3))
    assert not np.allclose(first[0], second[0])


@dataclasses.dataclass
class MutableAct:
    """A callable a user might write: a mutable dataclass, so unhashable."""

    policy: object
    params: object

    def __call__(self, obs, key):
        return old_actor_act(self.policy, self.params)(obs, key)


@struct.dataclass
class ListFieldAct:
    """A pytree act whose static field cannot be hashed."""

    policy: object = struct.field(pytree_node=False)
    params: object
    unhashable: list = struct.field(pytree_node=False, default_factory=list)

    def __call__(self, obs, key):
        return old_actor_act(self.policy, self.params)(obs, key)


def test_plain_callables_still_evaluate(rng):
    """A closure or an unhashable callable object is static as a whole, and a pytree act may
    hold an unhashable static field: each evaluates as the ``make_act`` of the same policy
    does, and compiles once."""
    env, env_params = ember.envs.make("CartPole-v1", max_steps_in_episode=30)
    policy = ppo.make_policy(ppo.PPOConfig(policy=PolicyConfig(hidden_sizes=(8,))), env, env_params)
    params = policy.init(jax.random.fold_in(rng, 1), jnp.zeros((1, 4)))
    expected = evaluate(ppo.make_act(policy, params), env, env_params, rng, num_episodes=5)

    for act in (old_actor_act(policy, params), MutableAct(policy, params), ListFieldAct(policy, params)):
        assert_same_episodes(evaluate(act, env, env_params, rng, num_episodes=5), expected)
        with compile_events() as compiles:
            again = evaluate(act, env, env_params, jax.random.fold_in(rng, 2), num_episodes=5)
        assert compiles == []
        assert_same_episodes(
            again, evaluate(ppo.make_act(policy, params), env, env_params, jax.random.fold_in(rng, 2), 5)
        )

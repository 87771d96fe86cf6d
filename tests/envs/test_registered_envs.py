"""Every registered environment: reset and stepped under jit and vmap (batch 1 and 64),
batched results equal single-environment results, observations and sampled actions lie in
their spaces, invalid actions are clipped as documented, and render gives an RGB picture."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ember.envs
from ember.core.errors import ConfigError
from ember.envs import noise as noise_lib
from ember.envs import spaces
from ember.envs.multi_agent import MultiAgentEnvironment
from tests.tolerances import assert_allclose

ENV_IDS = ember.envs.registered()


@functools.cache
def compiled(env_id):
    """(env, params, jitted reset_from_noise, jitted step_from_noise), built once per id so
    the tests below share compilations."""
    env, params = ember.envs.make(env_id)
    return env, params, jax.jit(env.reset_from_noise), jax.jit(env.step_from_noise)


def test_registry_lists_ids_suggests_close_ones_and_rejects_unknown_params():
    assert {"CartPole-v1", "Pendulum-v1", "MountainCar-v0", "MountainCarContinuous-v0", "Acrobot-v1"} <= set(ENV_IDS)
    assert {"Breakout-MinAtar", "KeyDoorMaze-v0", "MPE-simple_spread", "MPE-simple_tag"} <= set(ENV_IDS)
    with pytest.raises(LookupError, match="Did you mean 'CartPole-v1'"):
        ember.envs.make("CartPol-v1")
    with pytest.raises(ValueError, match="unknown parameter"):
        ember.envs.make("CartPole-v1", gravityy=3.0)
    _env, params = ember.envs.make("CartPole-v1", gravity=3.0)
    assert params.gravity == 3.0


def test_equal_env_configs_make_one_environment_object(monkeypatch):
    """Programs compiled for an environment are keyed by the object (evaluation's), so equal
    configs share one; other settings, and an id registered again, make another."""
    config = ember.envs.EnvConfig(id="CartPole-v1", params={"max_steps_in_episode": 50})
    env, params = ember.envs.make_from_config(config)
    again, _ = ember.envs.make_from_config(ember.envs.EnvConfig(id="CartPole-v1"))
    assert again is env and params.max_steps_in_episode == 50
    flat = ember.envs.EnvConfig(id="KeyDoorMaze-v0", flatten_observation=True)
    assert (
        ember.envs.make_from_config(flat)[0]
        is not ember.envs.make_from_config(ember.envs.EnvConfig(id="KeyDoorMaze-v0"))[0]
    )
    registry = ember.envs.registry.ENVIRONMENTS
    monkeypatch.setattr(registry, "_entries", dict(registry._entries))  # the test's ids go afterwards
    ember.envs.register("TestCartPole-v0", "ember.envs.classic_control.cartpole:CartPole")
    first, _ = ember.envs.make_from_config(ember.envs.EnvConfig(id="TestCartPole-v0"))
    ember.envs.register("TestCartPole-v0", lambda: ember.envs.make("CartPole-v1")[0], overwrite=True)
    assert ember.envs.make_from_config(ember.envs.EnvConfig(id="TestCartPole-v0"))[0] is not first


def test_parameter_values_of_the_wrong_kind_or_range_are_refused_naming_the_key():
    # Before, `ember train ... env.params.max_steps_in_episode=abc` started training and failed
    # deep inside a traced comparison; `=0` trained to the end and failed in evaluation.
    cases = [
        ({"max_steps_in_episode": "abc"}, "max_steps_in_episode", "expects int"),
        ({"max_steps_in_episode": 200.5}, "max_steps_in_episode", "expects int"),
        ({"max_steps_in_episode": 0}, "max_steps_in_episode", "positive integer"),
        # Past int32 it was accepted, and the first step raised OverflowError from jit.
        ({"max_steps_in_episode": 10**10}, "max_steps_in_episode", "at most 2147483647"),
        ({"gravity": "abc"}, "gravity", "expects float"),
        ({"gravity": True}, "gravity", "expects float"),
    ]
    for overrides, key, message in cases:
        with pytest.raises(ConfigError, match=message) as raised:
            ember.envs.make("CartPole-v1", **overrides)
        assert raised.value.key == key
        with pytest.raises(ConfigError, match=message) as raised:
            ember.envs.EnvConfig(id="CartPole-v1", params=overrides)
        assert raised.value.key == f"params.{key}"
    _, params = ember.envs.make("CartPole-v1", gravity=10, max_steps_in_episode=np.int64(7))
    assert isinstance(params.gravity, float) and params.gravity == 10.0 and params.max_steps_in_episode == 7
    masses = np.array([0.1, 0.2], np.float32)  # arrays pass (parameters vmapped over)
    assert ember.envs.make("CartPole-v1", masspole=masses)[1].masspole is masses
    # ... except for a static field (it sets the action space): accepted before, then the first
    # step failed with a NumPy broadcasting error from Box.
    with pytest.raises(ConfigError, match="static field") as raised:
        ember.envs.make("Pendulum-v1", max_torque=np.array([2.0, 3.0]))
    assert raised.value.key == "max_torque"
    assert ember.envs.make("Pendulum-v1", max_torque=np.float32(3.0))[1].max_torque == 3.0


def assert_same(actual, expected):
    if jnp.issubdtype(np.asarray(actual).dtype, jnp.floating):  # np: jnp.asarray of a host array compiles
        assert_allclose(actual, expected)
    else:
        np.testing.assert_array_equal(actual, expected)


# The -continuous variants differ from their scenarios only in the action decoding: batch 64,
# whose first and last rows are checked against single-environment steps, covers them.
BATCH_CASES = [(env_id, n) for env_id in ENV_IDS for n in (1, 64) if n == 64 or not env_id.endswith("-continuous")]


@pytest.mark.parametrize(("env_id", "num_envs"), BATCH_CASES)
def test_reset_and_step_under_jit_and_vmap(env_id, num_envs, rng):
    env, params, single_reset, single_step = compiled(env_id)
    batched = ember.envs.BatchedEnv(env, num_envs)
    action_space, observation_space = env.action_space(params), env.observation_space(params)

    @jax.jit
    def run(key):
        reset_words = noise_lib.draw(key, batched.reset_noise_shape)
        obs, state = batched.reset_from_noise(reset_words, params)
        actions = jax.vmap(action_space.sample)(jax.random.split(jax.random.fold_in(key, 1), num_envs))
        step_words = noise_lib.draw(jax.random.fold_in(key, 2), batched.step_noise_shape)
        out = batched.step_from_noise(step_words, state, actions, params)
        contained = (
            jax.vmap(observation_space.contains)(obs),
            jax.vmap(action_space.contains)(actions),
            jax.vmap(observation_space.contains)(out[0]),
        )
        return reset_words, obs, state, actions, step_words, out, contained

    # Rows are cut on the host: indexing a jax array eagerly compiles a slice for each leaf shape.
    reset_words, obs, state, actions, step_words, out, contained = jax.device_get(run(rng))
    for name, flags in zip(("reset observation", "sampled action", "step observation"), contained):
        assert flags.all(), f"{env_id}: a {name} lies outside its space"
    for i in {0, num_envs - 1}:
        row = lambda tree, i=i: jax.tree.map(lambda leaf: leaf[i], tree)  # noqa: E731
        jax.tree.map(assert_same, row((obs, state)), single_reset(reset_words[i], params))
        jax.tree.map(assert_same, row(out), single_step(step_words[i], row(state), row(actions), params))


def invalid_and_clipped(space, key):
    """(an invalid action, the valid action it must behave as) for ``space``, built in NumPy
    (eager jnp ops would compile one by one)."""
    if isinstance(space, spaces.Discrete):
        return np.int32(space.n + 3), np.int32(space.n - 1)
    if isinstance(space, spaces.Box):
        nan_and_large = np.where(np.arange(np.prod(space.shape)).reshape(space.shape) % 2 == 0, np.nan, 1e6)
        middle = (space.low + space.high) / 2
        clipped = np.where(np.isnan(nan_and_large), middle, space.high)
        return nan_and_large.astype(space.dtype), clipped.astype(space.dtype)
    if isinstance(space, spaces.Dict):
        pairs = {name: invalid_and_clipped(sub, key) for name, sub in space.spaces.items()}
        return {n: p[0] for n, p in pairs.items()}, {n: p[1] for n, p in pairs.items()}
    raise AssertionError(f"no invalid action for {space!r}")


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_invalid_actions_are_clipped_and_render_gives_rgb(env_id, rng):
    env, params, reset, step = compiled(env_id)
    _, state = reset(noise_lib.draw(rng, env.reset_noise_shape), params)
    invalid, clipped = invalid_and_clipped(env.action_space(params), rng)
    words = noise_lib.draw(rng, env.step_noise_shape)
    got, expected = jax.device_get((step(words, state, invalid, params), step(words, state, clipped, params)))
    jax.tree.map(assert_same, got, expected)
    for leaf in jax.tree.leaves(got[0]):
        assert not np.isnan(leaf).any()
    frame = np.asarray(jax.jit(env.render)(state, params))
    assert frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[-1] == 3
    assert len(np.unique(frame.reshape(-1, 3), axis=0)) >= 2, "the picture shows something"
    if isinstance(env, MultiAgentEnvironment):
        assert set(got[2]) == set(env.agents)


@pytest.mark.parametrize("env_id", [env_id for env_id in ENV_IDS if env_id.endswith("-MinAtar")])
def test_a_minatar_auto_reset_keeps_the_last_action_for_sticky_actions(env_id, rng):
    # MinAtar's Environment.reset() leaves last_action as it is, so an episode's first step may
    # repeat the previous episode's last action (tests/envs/test_minatar_breakout.py shows it on
    # the package); the auto-reset set it to 0 (no-op) instead.
    env, params, reset, step = compiled(env_id)
    params = params.replace(max_steps_in_episode=1, sticky_action_prob=0.0)
    _, state = reset(noise_lib.draw(rng, env.reset_noise_shape), params)
    _, state, _, _, truncated, _ = step(noise_lib.draw(rng, env.step_noise_shape), state, np.int32(1), params)
    assert bool(truncated) and int(state.time) == 0, "the episode ended and a new one began"
    assert int(state.last_action) == 1


def space_dtypes(space: spaces.Space):
    """The dtypes of the values ``space`` describes, as a pytree like those values."""
    if isinstance(space, spaces.Dict):
        return {name: space_dtypes(sub) for name, sub in space.spaces.items()}
    return space.dtype


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_observations_have_their_space_dtype_with_x64_enabled(env_id, rng):
    # Classic control and MPE compute in JAX's default float: under jax_enable_x64 their
    # observations were float64 while their spaces said float32. Shapes only (no compilation).
    with jax.enable_x64(True):
        env, params = ember.envs.make(env_id)
        wanted = space_dtypes(env.observation_space(params))
        reset_words = jax.ShapeDtypeStruct(env.reset_noise_shape, jnp.uint32)
        obs, state = jax.eval_shape(env.reset_from_noise, reset_words, params)
        action = jax.eval_shape(env.action_space(params).sample, rng)
        step_words = jax.ShapeDtypeStruct(env.step_noise_shape, jnp.uint32)
        step_obs = jax.eval_shape(env.step_from_noise, step_words, state, action, params)[0]
    for got in (obs, step_obs):
        assert jax.tree.map(lambda leaf: leaf.dtype, got) == wanted
    if env_id.split("-")[0] in {"CartPole", "Pendulum", "MountainCar", "MountainCarContinuous", "Acrobot", "MPE"}:
        assert set(jax.tree.leaves(wanted)) == {jnp.dtype(jnp.float64)}, "they compute in the default float"


def misshapen_actions(space: spaces.Space, name: str) -> list[tuple[object, str]]:
    """``(action, what the error must name)`` pairs of the wrong shape, dtype or structure."""
    if isinstance(space, spaces.Dict):
        agent, sub = next(iter(space.spaces.items()))
        valid = {key: jnp.zeros(s.shape, s.dtype) for key, s in space.spaces.items()}
        wrong = [({**valid, agent: bad}, named) for bad, named in misshapen_actions(sub, f"{name}[{agent!r}]")]
        return [*wrong, ({key: v for key, v in valid.items() if key != agent}, f"{name} must be a dict")]
    batch = jnp.zeros((2, *space.shape), space.dtype)
    if jnp.issubdtype(space.dtype, jnp.integer):
        return [(batch, name), (jnp.zeros(space.shape, jnp.float32), name)]
    return [(batch, name), (jnp.zeros(space.shape, bool), name)]


# One -continuous id stands for the rest: their action spaces are built alike.
REFUSAL_IDS = [env_id for env_id in ENV_IDS if not env_id.endswith("-continuous")] + ["MPE-simple_spread-continuous"]


@pytest.mark.parametrize("env_id", REFUSAL_IDS)
def test_an_action_of_the_wrong_shape_or_dtype_is_refused_naming_the_argument(env_id, rng):
    env, params, reset, _ = compiled(env_id)  # the shared jitted reset: an eager one compiles op by op
    _, state = reset(noise_lib.draw(rng, env.reset_noise_shape), params)
    for action, named in misshapen_actions(env.action_space(params), "action"):
        with pytest.raises(ValueError, match=rf"\w+\.step: {re.escape(named)}"):
            env.step(rng, state, action, params)

"""Adapters against the real libraries: gymnax and JaxMARL environments behind Ember's
contract, and Ember environments as a gymnasium VectorEnv checked with gymnasium's own tools."""

import dataclasses
import sys

import gymnasium
import gymnax
import jax
import jax.numpy as jnp
import jaxmarl
import numpy as np
import pytest
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.utils.passive_env_checker import check_action_space, check_obs, check_observation_space
from gymnasium.vector import AutoresetMode

import ember.envs
from ember.core.errors import ConfigError
from ember.envs import noise as noise_lib
from ember.envs.adapters import GymnasiumVectorEnv, GymnaxEnv, JaxMARLEnv
from ember.envs.adapters.jaxmarl import UnsupportedEnvironment
from ember.envs.environment import EnvParams
from tests.tolerances import assert_allclose


def test_gymnax_env_steps_as_gymnax_and_splits_terminated_from_truncated(rng):
    gymnax_env, gymnax_params = gymnax.make("CartPole-v1")
    env = GymnaxEnv(gymnax_env, gymnax_params.replace(max_steps_in_episode=8))
    params = env.default_params
    words = noise_lib.draw(rng, (2,))
    obs, state = env.reset_from_noise(words, params)
    expected_obs, _ = gymnax_env.reset_env(noise_lib.to_key(words), params)
    assert_allclose(obs, expected_obs)
    # Same dynamics as Ember's own CartPole from the same state.
    ember_env, ember_params = ember.envs.make("CartPole-v1")
    ember_state = ember_env.reset(rng, ember_params)[1].replace(
        x=state.x, x_dot=state.x_dot, theta=state.theta, theta_dot=state.theta_dot
    )
    step = jax.jit(env.step)
    flags = []
    for t in range(16):
        action = jnp.int32(t % 2)
        key = jax.random.fold_in(rng, t)
        expected = ember_env.step(key, ember_state, action, ember_params)
        obs, state, reward, terminated, truncated, info = step(key, state, action, params)
        assert_allclose(info["final_observation"], expected[5]["final_observation"], err_msg=f"step {t}")
        assert_allclose(reward, 1.0)
        flags.append((bool(terminated), bool(truncated)))
        ember_state = expected[1].replace(x=state.x, x_dot=state.x_dot, theta=state.theta, theta_dot=state.theta_dot)
    assert flags[7] == (False, True) and flags[15] == (False, True), "time limit 8: truncated, not terminated"
    # Always pushing one way topples the pole: a termination.
    _, state = env.reset(rng, params.replace(max_steps_in_episode=500))
    for t in range(30):
        _, state, _, terminated, truncated, _ = step(
            jax.random.fold_in(rng, t), state, jnp.int32(1), params.replace(max_steps_in_episode=500)
        )
        if bool(terminated):
            break
    assert bool(terminated) and not bool(truncated)


def test_gymnax_env_terminal_on_the_last_allowed_step_is_terminated_and_truncated(rng):
    gymnax_env, gymnax_params = gymnax.make("CartPole-v1")
    params = gymnax_params.replace(max_steps_in_episode=5)
    env = GymnaxEnv(gymnax_env, params)
    _, state = env.reset(rng, params)
    # the 5th (last) step, pole past its threshold after it: gymnax 1.0 and Ember's own
    # CartPole report both flags, so GAE and the TD targets do not bootstrap through it
    state = state.replace(theta=jnp.float32(0.2094), theta_dot=jnp.float32(1.0), time=jnp.int32(4))
    _, _, _, terminated, truncated, info = env.step(rng, state, jnp.int32(1), params)
    _, _, _, expected_terminated, expected_truncated, expected = gymnax_env.step(rng, state, jnp.int32(1), params)
    assert (bool(terminated), bool(truncated)) == (bool(expected_terminated), bool(expected_truncated)) == (True, True)
    assert_allclose(info["final_observation"], expected["final_observation"])


def test_gymnax_env_runs_batched_with_log_wrapper(rng):
    env = ember.envs.BatchedEnv(ember.envs.LogWrapper(GymnaxEnv(*gymnax.make("Pendulum-v1"))), num_envs=4)
    params = env.default_params
    _obs, state = env.reset(rng, params)

    def body(state, key):
        _obs, state, reward, _terminated, _truncated, info = env.step(key, state, jnp.zeros((4, 1)), params)
        return state, (reward, info["returned_episode"], info["returned_episode_returns"])

    _, (reward, done, returns) = jax.jit(lambda s, k: jax.lax.scan(body, s, jax.random.split(k, 200)))(state, rng)
    assert bool(done[-1].all()) and not bool(done[:-1].any()), "Pendulum truncates at exactly 200 steps"
    assert_allclose(returns[-1], reward.sum(axis=0), scale=10.0)  # 200-term float32 sums


def test_jaxmarl_env_steps_as_jaxmarl(rng):
    reference = jaxmarl.make("MPE_simple_spread_v3")
    env = JaxMARLEnv(reference, max_steps=5)
    params = env.default_params
    words = noise_lib.draw(rng, (4,))
    obs, state = jax.jit(env.reset_from_noise)(words[:2], params)
    expected_obs, expected_state = reference.reset(noise_lib.to_key(words[:2]))
    actions = {agent: jnp.int32(i + 1) for i, agent in enumerate(env.agents)}
    obs, state, rewards, terminated, truncated, _info = jax.jit(env.step_from_noise)(
        jnp.concatenate([words[2:], words[:2]]), state, actions, params
    )
    expected_obs, _, expected_rewards, _, _ = jax.jit(reference.step_env)(
        noise_lib.to_key(words[2:]), expected_state, actions
    )
    for agent in env.agents:
        assert_allclose(obs[agent], expected_obs[agent])
        assert_allclose(rewards[agent], expected_rewards[agent])
    assert set(terminated) == set(env.agents) | {"__all__"}
    batched = ember.envs.BatchedEnv(env, num_envs=3)
    obs, state = jax.jit(batched.reset)(rng, params)
    step = jax.jit(batched.step)
    for t in range(5):
        actions = {agent: jnp.full((3,), t % 5, jnp.int32) for agent in env.agents}
        obs, state, rewards, terminated, truncated, _info = step(jax.random.fold_in(rng, t), state, actions, params)
    assert bool(truncated["__all__"].all()) and not bool(terminated["__all__"].any())


def test_jaxmarl_time_limit_can_only_shorten_the_environments_own():
    # Past its own max_steps (25) JaxMARL ends the episode in a `dones` that reads as a termination.
    reference = jaxmarl.make("MPE_simple_spread_v3")
    with pytest.raises(ValueError, match=r"exceeds the environment's own max_steps \(25\)"):
        JaxMARLEnv(reference, max_steps=26)
    config = ember.envs.EnvConfig(id="MPE_simple_spread_v3", source="jaxmarl", params={"max_steps_in_episode": 40})
    with pytest.raises(ConfigError, match="can only shorten") as info:
        ember.envs.make_from_config(config)
    assert info.value.key == "params.max_steps_in_episode"
    env, params = ember.envs.make_from_config(dataclasses.replace(config, params={"max_steps_in_episode": 9}))
    assert env.max_steps == params.max_steps_in_episode == 9
    # Longer params passed to step directly: the episode still ends (truncated) at the own 25
    # steps; it went on to the params' 40, past JaxMARL's end of the episode.
    env, params = JaxMARLEnv(reference), EnvParams(max_steps_in_episode=40)
    step = jax.jit(env.step)
    _, state = jax.jit(env.reset)(jax.random.key(0), params)
    actions = {agent: jnp.int32(0) for agent in env.agents}
    for t in range(25):
        _, state, _, terminated, truncated, _ = step(jax.random.key(t), state, actions, params)
        assert bool(truncated["__all__"]) == (t == 24) and not bool(terminated["__all__"])


class _EndsAfterFourSteps:
    """MPE simple_spread whose episode truly ends (not by its time limit) on its fourth step."""

    def __init__(self, env):
        self.env = env

    def __getattr__(self, name):
        return getattr(self.env, name)

    def step_env(self, key, state, actions):
        obs, state, rewards, dones, info = self.env.step_env(key, state, actions)
        return obs, state, rewards, {**dones, "__all__": state.step >= 4}, info


@pytest.mark.parametrize("max_steps", [4, 6])
def test_jaxmarl_termination_on_the_last_allowed_step_is_a_termination(rng, max_steps):
    """Under a time limit shorter than the environment's own, a true end on the limit's last
    step is still ``terminated`` (truncated too, at 4): bootstrapping must stop there."""
    env = JaxMARLEnv(_EndsAfterFourSteps(jaxmarl.make("MPE_simple_spread_v3")), max_steps=max_steps)
    flags = end_flags_of_steps(env, rng, 4, lambda terminated, truncated: (terminated["__all__"], truncated["__all__"]))
    assert flags == [(False, False)] * 3 + [(True, max_steps == 4)]


def end_flags_of_steps(env, rng, steps, read):
    """``read(terminated, truncated)`` (bool scalars), as a tuple of bools, after each of ``steps``
    jitted steps of ``env`` from a reset, every agent taking action 1."""
    params = env.default_params
    _, state = env.reset(rng, params)
    step = jax.jit(env.step)
    actions = {agent: jnp.int32(1) for agent in env.agents}
    flags = []
    for t in range(steps):
        _, state, _, terminated, truncated, _ = step(jax.random.fold_in(rng, t), state, actions, params)
        flags.append(tuple(map(bool, read(terminated, truncated))))
    return flags


class _FirstAgentEndsOnStepTwo(_EndsAfterFourSteps):
    """MPE simple_spread whose ``dones`` of every agent mark its own time limit (max_steps 25) on
    the 25th step, as SMAX's and Hanabi's end flags would, and whose ``dones["agent_0"]`` is true
    on step 2 too (and not after)."""

    def step_env(self, key, state, actions):
        obs, state, rewards, dones, info = self.env.step_env(key, state, actions)
        limit = state.step >= 25
        dones = {agent: limit | ((state.step == 2) & (agent == "agent_0")) for agent in self.env.agents}
        return obs, state, rewards, {**dones, "__all__": limit}, info


def test_jaxmarl_agent_that_ended_stays_terminated_and_the_own_limit_is_a_truncation(rng):
    """``terminated["agent_0"]`` from its end (step 2) to the episode's, its own last step (25)
    included, where JaxMARL's ``dones`` of every agent are its time limit: the others are only
    truncated there."""
    env = JaxMARLEnv(_FirstAgentEndsOnStepTwo(jaxmarl.make("MPE_simple_spread_v3")))
    flags = end_flags_of_steps(
        env, rng, 26, lambda terminated, truncated: (*(terminated[agent] for agent in env.agents), truncated["__all__"])
    )
    assert flags[0] == flags[25] == (False, False, False, False)  # step 26 is the next episode's first
    assert flags[1:24] == [(True, False, False, False)] * 23
    assert flags[24] == (True, False, False, True)


def test_gymnasium_vector_env_passes_gymnasium_checks():
    params = ember.envs.make("CartPole-v1", max_steps_in_episode=20)[1]
    envs = GymnasiumVectorEnv(
        "CartPole-v1", num_envs=6, params=params, render_mode="rgb_array", autoreset_mode=AutoresetMode.SAME_STEP
    )
    assert isinstance(envs, gymnasium.vector.VectorEnv)
    check_observation_space(envs.single_observation_space)
    check_action_space(envs.single_action_space)
    obs, info = envs.reset(seed=7)
    check_obs(obs, envs.observation_space, "reset")
    assert isinstance(info, dict)
    # Seeded resets and steps are deterministic; different seeds differ (gymnasium's checks).
    assert data_equivalence(obs, envs.reset(seed=7)[0])
    assert not data_equivalence(obs, envs.reset(seed=8)[0])
    actions = np.random.default_rng(0).integers(0, 2, size=(30, 6))
    runs = []
    for _ in range(2):
        envs.reset(seed=3)
        runs.append([envs.step(a) for a in actions])
    assert data_equivalence([r[:4] for r in runs[0]], [r[:4] for r in runs[1]])
    ended = 0
    for _t, (obs, reward, terminated, truncated, infos) in enumerate(runs[0]):
        check_obs(obs, envs.observation_space, "step")
        assert reward.shape == (6,) and reward.dtype == np.float32
        assert terminated.dtype == np.bool_ and truncated.dtype == np.bool_
        np.testing.assert_array_equal(infos["_final_obs"], terminated | truncated)
        for i in np.flatnonzero(infos["_final_obs"]):
            ended += 1
            assert envs.single_observation_space.contains(infos["final_obs"][i].astype(np.float32))
            assert np.all(np.abs(obs[i]) <= 0.05), "SAME_STEP: the returned observation starts the next episode"
    assert ended >= 6
    frames = envs.render()
    assert len(frames) == 6 and frames[0].dtype == np.uint8 and frames[0].shape[-1] == 3


def test_next_step_autoreset_works_with_gymnasium_vector_wrappers():
    envs = gymnasium.wrappers.vector.RecordEpisodeStatistics(GymnasiumVectorEnv("CartPole-v1", num_envs=4))
    assert envs.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP
    envs.reset(seed=1)
    lengths = np.zeros(4, int)
    pending = np.zeros(4, bool)
    episodes = 0
    for _ in range(60):
        obs, reward, terminated, truncated, infos = envs.step(np.ones(4, np.int64))
        # NEXT_STEP: the step after an episode's end is the reset step (reward 0, no flags).
        assert np.all(reward[pending] == 0) and not (terminated | truncated)[pending].any()
        assert np.all(np.abs(obs[pending]) <= 0.05)
        lengths[~pending] += 1
        lengths[pending] = 0
        done = terminated | truncated
        assert np.all(np.abs(obs[done, 2]) > 0.2), "the returned observation of an ending episode is its last one"
        pending = done
        if done.any():
            episodes += int(done.sum())
            np.testing.assert_array_equal(infos["_episode"], done)
            # CartPole pays 1 per step: the recorded return equals the recorded length.
            assert_allclose(infos["episode"]["r"][done], lengths[done].astype(np.float32))
            np.testing.assert_array_equal(infos["episode"]["l"][done], lengths[done])
    assert episodes >= 8


def test_integer_box_with_an_infinite_bound_converts_to_gymnasium():
    # float64 inf cast to int32 is INT_MIN: the conversion built Box(0, INT_MIN) and gymnasium refused it.
    from ember.envs.adapters.gymnasium_vector import to_gymnasium_space
    from ember.envs.spaces import Box

    space = to_gymnasium_space(Box(0, np.inf, (2,), jnp.int32))
    assert space.dtype == np.int32 and space.low.tolist() == [0, 0] and space.high.tolist() == [2**31 - 1] * 2
    space = to_gymnasium_space(Box(-1.0, 1.0, (3,)))
    assert space.dtype == np.float32 and space.high.tolist() == [1.0] * 3


@pytest.mark.parametrize("source", ["gymnax", "jaxmarl"])
def test_a_missing_library_is_a_config_error_naming_the_source(source, monkeypatch):
    # Without the library (and so without gymnasium, which gymnax requires), importing the
    # adapters failed first with ModuleNotFoundError('gymnasium'), before the ConfigError.
    for module in [name for name in sys.modules if name.startswith("ember.envs.adapters")]:
        monkeypatch.delitem(sys.modules, module)
    for library in ("gymnasium", "gymnax", "jaxmarl"):
        monkeypatch.setitem(sys.modules, library, None)
    ember.envs.config._environment.cache_clear()  # a fresh process: no environment made yet
    config = ember.envs.EnvConfig(id="CartPole-v1", source=source)
    with pytest.raises(ConfigError, match=f"{source} is not installed") as raised:
        ember.envs.make_from_config(config)
    assert raised.value.key == "source"


def test_gymnasium_vector_env_refuses_a_multi_agent_environment():
    # Accepted before; its first step raised AttributeError: 'dict' object has no attribute 'reshape'.
    with pytest.raises(ValueError, match="multi-agent environment"):
        GymnasiumVectorEnv("MPE-simple_push", num_envs=2)


@pytest.mark.parametrize(
    ("env_id", "kwargs", "limit", "steps"),
    [("SMAX", {"scenario": "3m"}, 16, 48), ("hanabi", {}, 24, 32)],  # units die; players run out of lives
)
def test_jaxmarl_masks_and_agent_ends_are_jaxmarls_own(rng, env_id, kwargs, limit, steps):
    """Random legal play in 8 environments: the adapter's ``action_masks`` of the state it
    returns (the auto-reset one where an episode ended) are JaxMARL's ``get_avail_actions`` /
    ``get_legal_moves`` of the state JaxMARL reaches (or resets to) from the same words, and
    ``terminated[agent]`` is JaxMARL's ``dones[agent]`` (a dead SMAX unit, every Hanabi player at
    the game's end). Refused before (UnsupportedEnvironment). SMAX offers its ``world_state`` as
    the global state (``global_state`` of the returned state and ``info["final_global_state"]``
    of the state reached, JaxMARL's own of the same states; the adapter dropped it before),
    Hanabi none."""
    config = ember.envs.EnvConfig(id=env_id, source="jaxmarl", kwargs=kwargs, params={"max_steps_in_episode": limit})
    env, params = ember.envs.make_from_config(config)
    reference = env.jaxmarl_env
    reference_masks = getattr(reference, {"SMAX": "get_avail_actions", "hanabi": "get_legal_moves"}[env_id])
    envs = ember.envs.BatchedEnv(env, 8)
    to_keys = jax.vmap(noise_lib.to_key)

    def step(state, key):
        masks = envs.action_masks(state, params)
        actions = {agent: jax.random.categorical(jax.random.fold_in(key, i), jnp.where(masks[agent], 0.0, -jnp.inf))
                   for i, agent in enumerate(env.agents)}  # fmt: skip
        words = envs.draw_noise(key, envs.step_noise_shape)
        _, next_state, _, terminated, truncated, info = envs.step_from_noise(words, state, actions, params)
        # JaxMARL's own transition and reset from the same words (2 per key), and its masks
        ref_obs, ref_state, _, dones, _ = jax.vmap(reference.step_env)(to_keys(words[:, :2]), state.env_state, actions)
        reset_obs, reset_state = jax.vmap(reference.reset)(to_keys(words[:, 2:]))
        ended = terminated["__all__"] | truncated["__all__"]
        expected_state, expected_obs = jax.tree.map(
            lambda r, s: jnp.where(ended.reshape(-1, *[1] * (s.ndim - 1)), r, s),
            (reset_state, reset_obs),
            (ref_state, ref_obs),
        )
        expected_masks = jax.vmap(reference_masks)(expected_state)
        assert ("final_global_state" in info) == env.has_global_state
        world_states = {}
        if env_id == "SMAX":
            world_states = {
                "global_state": envs.global_state(next_state, params),
                "expected_global_state": expected_obs["world_state"],
                "final_global_state": info["final_global_state"],
                "ref_world_state": ref_obs["world_state"],
                "get_world_state": jax.vmap(reference.get_world_state)(expected_state),
            }
        return next_state, world_states | {
            "masks": envs.action_masks(next_state, params),
            "expected_masks": {agent: expected_masks[agent].astype(bool) for agent in env.agents},
            "terminated": terminated,
            "dones": {agent: dones[agent] for agent in [*env.agents, "__all__"]},
            "final_obs": info["final_observation"],
            "ref_obs": {agent: ref_obs[agent] for agent in env.agents},
            "ended": ended,
        }

    def rollout(key):
        _, state = envs.reset(key, params)
        return jax.lax.scan(step, state, jax.random.split(key, steps))[1]

    out = jax.device_get(jax.jit(rollout)(rng))
    for agent in env.agents:
        np.testing.assert_array_equal(out["masks"][agent], out["expected_masks"][agent], err_msg=agent)
        np.testing.assert_array_equal(out["terminated"][agent], out["dones"][agent] | out["dones"]["__all__"])
        assert_allclose(out["final_obs"][agent], out["ref_obs"][agent])
    np.testing.assert_array_equal(out["terminated"]["__all__"], out["dones"]["__all__"])
    for agent, space in env.observation_space(params).spaces.items():  # Hanabi's Box shape was an int: TypeError
        assert space.shape == out["final_obs"][agent].shape[2:]
    assert out["ended"].sum() >= 8, "auto-resets were exercised"
    assert not np.all([mask.all() for mask in out["masks"].values()]), "the masks restrict"
    if env_id == "SMAX":
        alone = [out["terminated"][agent] & ~out["terminated"]["__all__"] for agent in env.agents]
        assert np.any(alone), "some unit died before its episode ended"
        assert env.has_global_state and env.global_state_space(params).shape == (72,)  # 6 units x (10 + 2)
        assert out["global_state"].shape == (steps, 8, 72)
        np.testing.assert_array_equal(out["global_state"], out["expected_global_state"])
        np.testing.assert_array_equal(out["global_state"], out["get_world_state"])
        np.testing.assert_array_equal(out["final_global_state"], out["ref_world_state"])
        # the enemies' health is in it (3 allies, then 3 enemies of 10 features each)
        assert np.unique(out["global_state"][..., 30:60:10]).size > 2, "enemies were hurt"
    else:
        assert not env.has_global_state
        with pytest.raises(ValueError, match="offers no global state"):
            env.global_state(None, params)


def test_jaxmarl_masks_of_non_discrete_actions_are_refused():
    """JaxNav and SMAX with continuous actions have masks too, which cannot restrict a Box."""
    with pytest.raises(UnsupportedEnvironment, match=r"masks are supported for Discrete action spaces only"):
        JaxMARLEnv(jaxmarl.make("SMAX", action_type="continuous"))
    config = ember.envs.EnvConfig(id="SMAX", source="jaxmarl", kwargs={"action_type": "continuous"})
    with pytest.raises(ConfigError, match="non-discrete actions") as info:
        ember.envs.make_from_config(config)
    assert info.value.key == "id"


def test_jaxmarl_kwargs_reach_the_library_and_name_smax_scenarios():
    config = ember.envs.EnvConfig(id="HeuristicEnemySMAX", source="jaxmarl", kwargs={"scenario": "2s3z"})
    env, _ = ember.envs.make_from_config(config)
    assert env.agents == [f"ally_{i}" for i in range(5)] and env.masks_actions
    with pytest.raises(ConfigError, match="no SMAX scenario 'nope'") as info:
        ember.envs.make_from_config(ember.envs.EnvConfig(id="SMAX", source="jaxmarl", kwargs={"scenario": "nope"}))
    assert info.value.key == "kwargs.scenario"
    with pytest.raises(ConfigError, match="kwargs are constructor arguments of a gymnax or JaxMARL") as info:
        ember.envs.EnvConfig(id="CartPole-v1", kwargs={"x": 1})
    assert info.value.key == "kwargs"


def test_jaxmarl_per_agent_world_states_are_not_a_global_state():
    """MPE simple_facmac's ``get_world_state`` is a dict of per-agent observations, not one flat
    array as SMAX's: it is not offered as the global state."""
    env = JaxMARLEnv(jaxmarl.make("MPE_simple_facmac_3a_v1"))
    assert not env.has_global_state
    with pytest.raises(ValueError, match=r"JaxMARLEnv\.global_state_space: this environment offers no global state"):
        env.global_state_space(env.default_params)

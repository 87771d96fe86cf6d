"""Wrappers against references: gymnasium's RunningMeanStd for the normalisers, the
unwrapped environment driven by the same random words for everything else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnasium.wrappers.utils import RunningMeanStd
from jax.experimental import checkify

import ember.envs
from ember.envs import wrappers
from tests.tolerances import assert_allclose


def paired_rollout(wrapped, plain, params, rng, steps, actions=None):
    """Steps ``wrapped`` and ``plain`` with identical keys and actions; returns the outputs
    of both: lists of (obs, reward, terminated, truncated, info), reset obs first."""
    key_reset, key = jax.random.split(rng)
    out = []
    for env in (wrapped, plain):
        obs, state = env.reset(key_reset, params)
        records = [(obs, None, None, None, None)]
        step = jax.jit(env.step)
        for t in range(steps):
            action = actions[t] if actions is not None else t % 2
            obs, state, reward, terminated, truncated, info = step(jax.random.fold_in(key, t), state, action, params)
            records.append((obs, reward, terminated, truncated, info))
        out.append(records)
    return out


def test_running_mean_var_matches_gymnasium(rng):
    stats = wrappers.RunningMeanVar.create((3,))
    reference = RunningMeanStd(shape=(3,))
    for i in range(4):
        batch = 3.0 * jax.random.normal(jax.random.fold_in(rng, i), (5 + i, 3)) + 2.0
        stats = stats.update(batch, (0,))
        reference.update(np.asarray(batch, np.float64))
    assert_allclose(stats.mean, reference.mean)
    assert_allclose(stats.var, reference.var)
    assert_allclose(stats.count, reference.count)


def test_normalize_observation_and_reward_match_gymnasium_formulas(rng):
    env, params = ember.envs.make("Pendulum-v1", max_steps_in_episode=15)
    wrapped = wrappers.NormalizeReward(wrappers.NormalizeObservation(env), gamma=0.9)
    actions = jax.random.uniform(rng, (30, 1), minval=-2.0, maxval=2.0)
    ours, plain = paired_rollout(wrapped, env, params, rng, 30, actions)
    obs_stats, return_stats = RunningMeanStd(shape=(3,)), RunningMeanStd(shape=())
    discounted = 0.0
    for t, ((obs, reward, _terminated, _, info), (raw_obs, raw_reward, raw_terminated, _, _)) in enumerate(
        zip(ours, plain)
    ):
        obs_stats.update(np.asarray(raw_obs, np.float64)[None])
        assert_allclose(obs, (raw_obs - obs_stats.mean) / np.sqrt(obs_stats.var + 1e-8), err_msg=f"obs {t}")
        if t == 0:
            continue
        discounted = discounted * 0.9 * (1 - bool(raw_terminated)) + float(raw_reward)
        return_stats.update(np.array([discounted]))
        assert_allclose(reward, raw_reward / np.sqrt(return_stats.var + 1e-8), err_msg=f"reward {t}")
        assert_allclose(info["raw_reward"], raw_reward)


def test_normalized_observations_lie_in_the_advertised_space(rng):
    # Before, the wrapper advertised the inner space: CartPole's pole angle is bounded by
    # +-0.42 rad, but a normalised angle is about +-1 (and MinAtar's 0/1 planes go negative).
    env, params = ember.envs.make("CartPole-v1")
    batch = wrappers.NormalizeObservation(ember.envs.BatchedEnv(env, 2))
    obs, _ = jax.jit(batch.reset)(rng, params)
    space = batch.observation_space(params)
    assert (space.shape, space.dtype) == ((4,), jnp.float32) and not space.bounded
    assert all(bool(space.contains(row)) for row in obs)
    assert not all(bool(env.observation_space(params).contains(row)) for row in obs)  # outside the inner space


def test_frame_stack_keeps_last_frames_and_restarts_with_reset_frame(rng):
    env, params = ember.envs.make("CartPole-v1", max_steps_in_episode=4)
    ours, plain = paired_rollout(wrappers.FrameStack(env, 3), env, params, rng, 9)
    raw = [np.asarray(record[0]) for record in plain]
    episode = [raw[0]] * 3
    assert_allclose(ours[0][0], np.stack(episode))
    for t in range(1, 10):
        obs, _, terminated, truncated, info = ours[t]
        final = [*episode[1:], np.asarray(plain[t][4]["final_observation"])]
        assert_allclose(info["final_observation"], np.stack(final), err_msg=f"step {t}")
        episode = [raw[t]] * 3 if bool(terminated | truncated) else final
        assert_allclose(obs, np.stack(episode), err_msg=f"step {t}")
    assert bool(ours[4][3]), "time limit 4 truncates at step 4"
    # A dict observation (the maze's) is refused by name; reset raised a TypeError from broadcast_to.
    maze, maze_params = ember.envs.make("KeyDoorMaze-v0")
    with pytest.raises(ValueError, match="FrameStack: the observation must be one array"):
        wrappers.FrameStack(maze, 2).reset(rng, maze_params)


def test_one_environment_wrappers_refuse_a_batch():
    # Before, FrameStack(BatchedEnv(CartPole, 4), 2) returned [2, 4, 4] stacks whose reset
    # mask broadcast over the observation axis, FlattenObservation ravelled the whole batch into
    # one [16] vector (its space said [4]), and CheckActions failed every valid batched action.
    env, _ = ember.envs.make("CartPole-v1")
    batch = wrappers.TimeLimit(ember.envs.BatchedEnv(env, 4), 10)  # found through other wrappers
    for wrap in (lambda e: wrappers.FrameStack(e, 2), wrappers.FlattenObservation, wrappers.CheckActions):
        with pytest.raises(ValueError, match=r"wraps one environment, not a batch of 4 .* BatchedEnv\("):
            wrap(batch)
        assert ember.envs.BatchedEnv(wrap(env), 4).num_envs == 4
    # NormalizeReward of a multi-agent batch failed at its first step with a TypeError on the flag dict.
    mpe, _ = ember.envs.make("MPE-simple_push")
    with pytest.raises(ValueError, match=r"NormalizeReward: .* multi-agent"):
        wrappers.NormalizeReward(ember.envs.BatchedEnv(mpe, 2))


def test_flatten_observation_and_time_limit(rng):
    env, params = ember.envs.make("Acrobot-v1")
    wrapped = wrappers.FlattenObservation(wrappers.TimeLimit(env, 5))
    ours, plain = paired_rollout(wrapped, ember.envs.wrappers.TimeLimit(env, 5), params, rng, 11)
    for (obs, *_), (raw_obs, *_) in zip(ours, plain):
        assert_allclose(obs, raw_obs)
    np.testing.assert_array_equal([bool(r[3]) for r in ours[1:]], [t % 5 == 0 for t in range(1, 12)])
    space = wrapped.observation_space(params)
    assert space.shape == (6,) and bool(space.contains(ours[3][0]))
    for bad in (0, 10**10, True):  # 10**10 was accepted, then the first step overflowed int32 under jit
        with pytest.raises(ValueError, match="max_steps must be an int in"):
            wrappers.TimeLimit(env, bad)


def test_rescale_and_clip_action_map_onto_the_inner_box(rng):
    env, params = ember.envs.make("Pendulum-v1")
    actions = jax.random.uniform(rng, (6, 1), minval=-1.0, maxval=1.0)
    rescaled, _plain = paired_rollout(wrappers.RescaleAction(env), env, params, rng, 6, actions * 1.0)
    _, scaled_plain = paired_rollout(env, env, params, rng, 6, actions * 2.0)
    for (obs, *_), (expected, *_) in zip(rescaled[1:], scaled_plain[1:]):
        assert_allclose(obs, expected)
    large = jnp.sign(actions) * (2.0 + 5.0 * jnp.abs(actions))  # every entry beyond the bounds
    clipped, _ = paired_rollout(wrappers.ClipAction(env), env, params, rng, 6, large)
    _, bounded = paired_rollout(env, env, params, rng, 6, jnp.sign(actions) * 2.0)
    for (obs, *_), (expected, *_) in zip(clipped[1:], bounded[1:]):
        assert_allclose(obs, expected)
    assert wrappers.ClipAction(env).action_space(params).bounded is False
    with pytest.raises(ValueError, match="bounded Box"):
        wrappers.RescaleAction(ember.envs.make("CartPole-v1")[0]).action_space(params)
    for low, high in ((-np.inf, 1.0), (-1.0, np.inf), (1.0, 1.0)):  # an infinite end sent every action to 0 torque
        with pytest.raises(ValueError, match="need finite low < high"):
            wrappers.RescaleAction(env, low, high)


def test_check_actions_raises_a_checkify_error_only_for_invalid_actions(rng):
    env, params = ember.envs.make("CartPole-v1")
    checked = wrappers.CheckActions(env)
    _, state = checked.reset(rng, params)
    step = jax.jit(checkify.checkify(checked.step))
    error, (obs, *_) = step(rng, state, jnp.int32(1), params)
    error.throw()
    assert_allclose(obs, env.step(rng, state, 1, params)[0])
    error, _ = step(rng, state, jnp.int32(2), params)
    with pytest.raises(checkify.JaxRuntimeError, match="outside the action space"):
        error.throw()


def test_legacy_step_returns_five_values(rng):
    env, params = ember.envs.make("CartPole-v1", max_steps_in_episode=3)
    legacy = wrappers.LegacyStep(env)
    obs, state = legacy.reset(rng, params)
    for t in range(3):
        key = jax.random.fold_in(rng, t)
        expected_obs, _, expected_reward, terminated, truncated, _ = env.step(key, state, t % 2, params)
        obs, state, reward, done, info = legacy.step(key, state, t % 2, params)
        assert_allclose(obs, expected_obs)
        assert_allclose(reward, expected_reward)
        assert bool(done) == bool(terminated | truncated)
    assert bool(done) and bool(info["truncated"]) and not bool(info["terminated"])
    assert_allclose(info["discount"], 1.0)
    assert_allclose(reward, 1.0)
    # A multi-agent environment: done is a flag dict as JaxMARL's (it raised AttributeError on the dict).
    env, params = ember.envs.make("MPE-simple_push", max_steps_in_episode=1)
    legacy = wrappers.LegacyStep(env)
    _, state = legacy.reset(rng, params)
    _, _, rewards, done, info = legacy.step(rng, state, {agent: 0 for agent in env.agents}, params)
    assert set(done) == set(env.agents) | {"__all__"} and all(bool(flag) for flag in done.values())
    assert set(rewards) == set(env.agents) and bool(info["truncated"]["__all__"])
    assert_allclose(info["discount"]["__all__"], 1.0)

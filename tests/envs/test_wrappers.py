"""Wrappers against references: gymnasium's RunningMeanStd for the normalisers, the
unwrapped environment driven by the same random words for everything else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from gymnasium.wrappers.utils import RunningMeanStd
from jax.experimental import checkify

import ember.envs
from ember.envs import EnvParams, EnvState, MultiAgentEnvironment, wrappers
from ember.envs import noise as noise_lib
from ember.envs.spaces import Box, Dict, Discrete
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


@struct.dataclass
class ScoutState(EnvState):
    obs: jax.Array  # [agents, 3]
    world: jax.Array  # [5]


class TwoScouts(MultiAgentEnvironment):
    """Two agents see 3 random values each (agent_1's around 4, agent_0's around 0) and the
    environment has a 5-value random global state; ``agent_1`` ends after its 2nd step and sees
    zeros from then on (as a dead SMAX unit). Episodes last 4 steps."""

    reset_noise_words = 11
    transition_noise_words = 11
    has_global_state = True

    def __init__(self):
        self.agents = ["agent_0", "agent_1"]

    @property
    def default_params(self):
        return EnvParams(max_steps_in_episode=4)

    def _draw(self, noise, time):
        values = noise_lib.uniform(noise[:6], -1.0, 1.0).reshape(2, 3) + jnp.array([[0.0], [4.0]])
        values = values.at[1].multiply(time < 2)
        return ScoutState(time=time, obs=values, world=noise_lib.uniform(noise[6:], -3.0, 5.0))

    def _obs(self, state):
        return {agent: state.obs[i] for i, agent in enumerate(self.agents)}

    def reset_env(self, noise, params):
        state = self._draw(noise, jnp.int32(0))
        return self._obs(state), state

    def step_env(self, noise, state, actions, params):
        state = self._draw(noise, state.time + 1)
        rewards = {agent: jnp.float32(0.0) for agent in self.agents}
        terminated = {"__all__": jnp.bool_(False), "agent_0": jnp.bool_(False), "agent_1": state.time >= 2}
        return self._obs(state), state, rewards, terminated, self.final_info(state, params)

    def global_state(self, state, params):
        return state.world

    def global_state_space(self, params):
        return Box(-3.0, 5.0, (5,))

    def observation_space(self, params):
        return Dict({agent: Box(-1.0, 5.0, (3,)) for agent in self.agents})

    def action_space(self, params):
        return Dict({agent: Discrete(2) for agent in self.agents})


def test_multi_agent_normalize_observation_shares_statistics_over_living_agents(rng):
    """Around a batch of a multi-agent environment: one set of statistics for every agent's
    observations, except an ended agent's placeholder zeros, and one for the global state (NumPy's
    mean and var of the values returned, reset and steps: agent_1's observations around 4 and
    its zeros after its end would pull the mean well off); what reset, step, ``global_state``
    and the final observations return is normalised with the statistics after that step.
    (The wrapper refused dict observations before.)"""
    env = TwoScouts()
    params = env.default_params
    plain = ember.envs.BatchedEnv(env, 3)
    wrapped = wrappers.NormalizeObservation(plain)
    space = wrapped.observation_space(params)
    assert all(not s.bounded and s.shape == (3,) for s in space.spaces.values())
    assert not wrapped.global_state_space(params).bounded

    @jax.jit
    def rollout(key):
        reset_key, key = jax.random.split(key)
        outputs = []
        for env_ in (wrapped, plain):
            obs, state = env_.reset(reset_key, params)
            steps = [(obs, env_.global_state(state, params), {}, None)]
            for t in range(6):  # an auto-reset after step 4
                actions = {agent: jnp.zeros(3, jnp.int32) for agent in env.agents}
                obs, state, _, terminated, truncated, info = env_.step(
                    jax.random.fold_in(key, t), state, actions, params
                )
                stats = getattr(state, "stats", None)
                steps.append((obs, env_.global_state(state, params), info, (terminated, truncated, stats)))
            outputs.append(steps)
        return outputs

    normalised, raw = jax.device_get(rollout(rng))
    living_obs, states = [], []
    for t, ((obs, world, info, flags), (raw_obs, raw_world, raw_info, raw_flags)) in enumerate(zip(normalised, raw)):
        for agent in env.agents:
            alive = np.ones(3, bool)
            if t > 0:
                terminated, truncated, _ = raw_flags
                alive = ~terminated[agent] | terminated["__all__"] | truncated["__all__"]
            living_obs.append(raw_obs[agent][alive])
        states.append(raw_world)
        every_obs, every_state = np.concatenate(living_obs), np.concatenate(states)
        # agents living after each step (agent_1 ends on step 2 of an episode; step 4 starts a new one)
        assert len(every_obs) == 3 * [2, 4, 5, 6, 8, 10, 11][t]
        if t == 0:
            continue
        stats = flags[2]  # (NumPy's statistics within 10x float32's tolerance: the prior weighs 1e-4)
        assert_allclose(stats.agents.mean, every_obs.mean(axis=0), scale=10)
        assert_allclose(stats.agents.var, every_obs.var(axis=0), scale=10)
        assert_allclose(stats.agents.count, 1e-4 + len(every_obs))
        assert_allclose(stats.global_state.mean, every_state.mean(axis=0), scale=10)
        assert_allclose(stats.global_state.var, every_state.var(axis=0), scale=10)
        scale = np.sqrt(stats.agents.var + 1e-8)
        for agent in env.agents:
            assert_allclose(obs[agent], (raw_obs[agent] - stats.agents.mean) / scale)
            assert_allclose(
                info["final_observation"][agent], (raw_info["final_observation"][agent] - stats.agents.mean) / scale
            )
        state_scale = np.sqrt(stats.global_state.var + 1e-8)
        assert_allclose(world, (raw_world - stats.global_state.mean) / state_scale)
        assert_allclose(
            info["final_global_state"], (raw_info["final_global_state"] - stats.global_state.mean) / state_scale
        )
    # the rollout reached an auto-reset: final observations differ from the next episode's first
    assert not np.allclose(raw[4][2]["final_observation"]["agent_0"], raw[4][0]["agent_0"])

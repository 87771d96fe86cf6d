"""The step contract of DESIGN.md section 5: auto-reset, final_observation, terminated vs
truncated, no step lost or duplicated, batched randomness, LogWrapper statistics."""

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np

import ember.envs
from ember.envs import noise as noise_lib
from tests.tolerances import assert_allclose


def rollout(env, params, key, actions):
    """Scans ``env.step`` over ``actions`` [T, ...]; returns (first obs, per-step outputs)."""
    reset_key, key = jax.random.split(key)
    obs, state = env.reset(reset_key, params)

    def body(carry, inputs):
        state = carry
        step_key, action = inputs
        obs, state, reward, terminated, truncated, info = env.step(step_key, state, action, params)
        return state, (obs, reward, terminated, truncated, info, state.time)

    _, outputs = jax.lax.scan(body, state, (jax.random.split(key, len(actions)), actions))
    return obs, outputs


def assert_same(actual, expected):
    if jnp.issubdtype(jnp.asarray(actual).dtype, jnp.floating):
        assert_allclose(actual, expected)
    else:
        np.testing.assert_array_equal(actual, expected)


def gym_cartpole_step(obs, action):
    env = gymnasium.make("CartPole-v1").unwrapped
    env.reset(seed=0)
    env.state = np.asarray(obs, np.float64)
    env.step(int(action))
    return env.state


def test_auto_reset_loses_and_duplicates_no_step(rng):
    env, params = ember.envs.make("CartPole-v1", max_steps_in_episode=9)
    actions = jax.random.randint(rng, (40,), 0, 2)
    first_obs, (obs, _reward, terminated, truncated, info, time) = jax.jit(rollout, static_argnums=0)(
        env, params, rng, actions
    )
    previous = np.asarray(first_obs)
    for t in range(len(actions)):
        # Every transition starts from the observation returned by the previous step.
        assert_allclose(info["final_observation"][t], gym_cartpole_step(previous, actions[t]), err_msg=f"step {t}")
        done = bool(terminated[t] | truncated[t])
        if done:
            assert int(time[t]) == 0
            assert np.all(np.abs(obs[t]) <= 0.05), "a reset state is drawn from [-0.05, 0.05]"
            assert not np.allclose(obs[t], info["final_observation"][t])
        else:
            assert_allclose(obs[t], info["final_observation"][t])
            assert int(time[t]) == int(time[t - 1]) + 1 if t else int(time[t]) == 1
        previous = np.asarray(obs[t])
    assert int((terminated | truncated).sum()) >= 3, "the rollout must cross several resets"


def test_truncated_exactly_at_time_limit_and_terminated_when_pole_falls(rng):
    env, params = ember.envs.make("CartPole-v1", max_steps_in_episode=5)
    _, (_, _, terminated, truncated, _, time) = rollout(env, params, rng, jnp.tile(jnp.array([0, 1]), 6))
    # Alternating pushes keep the pole up: every 5th step is a truncation, never a termination.
    np.testing.assert_array_equal(np.asarray(truncated), (np.arange(12) + 1) % 5 == 0)
    assert not bool(terminated.any())
    np.testing.assert_array_equal(np.asarray(time), (np.arange(12) + 1) % 5)

    env, params = ember.envs.make("CartPole-v1")
    _, (_, reward, terminated, truncated, info, _) = rollout(env, params, rng, jnp.ones(40, jnp.int32))
    first = int(np.argmax(np.asarray(terminated)))
    assert 5 < first < 20, "always pushing right topples the pole within ~10 steps"
    final = np.asarray(info["final_observation"][first])
    assert abs(final[2]) > params.theta_threshold_radians or abs(final[0]) > params.x_threshold
    assert not bool(truncated.any())
    assert_allclose(reward, np.ones(40))


def test_batched_env_draws_one_batch_of_words_and_matches_single_envs(rng):
    env, params = ember.envs.make("CartPole-v1", max_steps_in_episode=4)
    batched = ember.envs.BatchedEnv(env, num_envs=64)
    assert batched.step_noise_shape == (64, 4)
    obs, state = batched.reset(rng, params)
    words = noise_lib.draw_batch(rng, (64, 4))  # the one batched draw BatchedEnv.reset makes
    for i in (0, 7, 63):
        single_obs, _ = env.reset_from_noise(words[i], params)
        assert_allclose(obs[i], single_obs)
    actions = jax.random.randint(rng, (64,), 0, 2)
    state = state.replace(time=jnp.arange(64) % 4)  # some sub-environments truncate now
    step_words = noise_lib.draw(jax.random.fold_in(rng, 1), (64, 4))
    batch_out = batched.step_from_noise(step_words, state, actions, params)
    for i in (0, 3, 9):
        single = env.step_from_noise(step_words[i], jax.tree.map(lambda x, i=i: x[i], state), actions[i], params)
        jax.tree.map(lambda b, s, i=i: assert_same(b[i], s), batch_out, single)
    assert int(batch_out[4].sum()) == 16  # time 3 -> 4 == limit for envs 3, 7, ..., 63


def test_batched_env_vmapped_over_seeds_equals_separate_runs(rng):
    # 64 sub-environments take the one-call draw (noise.draw_batch); vmapping over seeds must
    # still give each seed its own key's words, bit for bit (jax.vmap(make_train(...))(keys)).
    env, params = ember.envs.make("CartPole-v1")
    batched = ember.envs.BatchedEnv(env, num_envs=64)
    keys = jax.random.split(rng, 2)
    obs, _ = jax.vmap(batched.reset, in_axes=(0, None))(keys, params)
    words = jax.vmap(lambda key: batched.draw_noise(key, batched.step_noise_shape))(keys)
    for i in range(2):
        np.testing.assert_array_equal(obs[i], batched.reset(keys[i], params)[0])
        np.testing.assert_array_equal(words[i], batched.draw_noise(keys[i], batched.step_noise_shape))
    assert not np.array_equal(obs[0], obs[1])


def test_log_wrapper_statistics_match_hand_count(rng):
    env, params = ember.envs.make("CartPole-v1", max_steps_in_episode=6)
    env = ember.envs.BatchedEnv(ember.envs.LogWrapper(env), num_envs=3)
    _obs, state = jax.jit(env.reset)(rng, params)
    step = jax.jit(env.step)  # one compile; eager, the 20 steps dispatch every op one by one
    lengths = []
    for t in range(20):
        actions = np.array([t % 2, 1, 0], np.int32)
        _obs, state, _reward, terminated, truncated, info = step(jax.random.fold_in(rng, t), state, actions, params)
        lengths.append((terminated | truncated, info))
    # Recompute returned lengths by hand: CartPole's reward is 1 per step, so return == length.
    count = np.zeros(3, int)
    last = np.zeros(3, int)
    for done, info in lengths:
        count += 1
        last = np.where(done, count, last)
        count = np.where(done, 0, count)
        np.testing.assert_array_equal(info["returned_episode_lengths"], last)
        assert_allclose(info["returned_episode_returns"], last.astype(np.float32))
        np.testing.assert_array_equal(info["returned_episode"], done)
    np.testing.assert_array_equal(info["timestep"], [20, 20, 20])
    assert int(last[0]) == 6, "alternating actions survive to the time limit"
    # LogWrapper around the batch keeps the same statistics, in a state of fixed shapes (its
    # scalars became [3] at the first step, so a lax.scan over steps raised a carry TypeError).
    outer = ember.envs.LogWrapper(ember.envs.BatchedEnv(env.env.env, num_envs=3))
    _obs, outer_state = jax.jit(outer.reset)(rng, params)
    shapes = jax.tree.map(jnp.shape, outer_state)
    _obs, outer_state, *_, outer_info = jax.jit(outer.step)(jax.random.fold_in(rng, 0), outer_state, actions, params)
    assert jax.tree.map(jnp.shape, outer_state) == shapes
    np.testing.assert_array_equal(outer_info["timestep"], [1, 1, 1])


def words_by_hand(key, size: int) -> np.ndarray:
    """``noise.draw``'s words in NumPy: MurmurHash3's 32-bit finaliser over a Weyl sequence
    (uint64 arithmetic, reduced mod 2**32 after every multiply)."""
    low32 = np.uint64(0xFFFFFFFF)

    def fmix32(h):
        h = h ^ (h >> np.uint64(16))
        h = (h * np.uint64(0x85EBCA6B)) & low32
        h = h ^ (h >> np.uint64(13))
        h = (h * np.uint64(0xC2B2AE35)) & low32
        return h ^ (h >> np.uint64(16))

    data = np.asarray(jax.random.key_data(key)).reshape(-1).astype(np.uint64)
    counters = (np.arange(size, dtype=np.uint64) * np.uint64(0x9E3779B9)) & low32
    return fmix32(data[0] ^ fmix32((data[-1] + counters) & low32)).astype(np.uint32)


def test_noise_draw_gives_the_hashed_words_eagerly_jitted_and_vmapped(rng):
    keys = jax.random.split(rng, 3)
    expected = np.stack([words_by_hand(key, 6) for key in keys]).reshape(3, 2, 3)
    np.testing.assert_array_equal(noise_lib.draw(keys[0], (2, 3)), expected[0])
    np.testing.assert_array_equal(jax.jit(noise_lib.draw, static_argnums=1)(keys[1], (2, 3)), expected[1])
    np.testing.assert_array_equal(jax.vmap(noise_lib.draw, in_axes=(0, None))(keys, (2, 3)), expected)


def test_noise_words_give_uniform_values(rng):
    for words in (noise_lib.draw(rng, (20000,)), noise_lib.draw_batch(rng, (20000,))):
        u = np.asarray(noise_lib.uniform(words, dtype=jnp.float32))
        assert u.min() >= 0.0 and u.max() < 1.0
        # Uniform[0, 1): mean 1/2, variance 1/12; 20000 draws put both within ~1%.
        assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.003
        counts = np.bincount(np.asarray(noise_lib.randint(words, 0, 5)), minlength=5)
        assert counts.min() > 3700 and counts.max() < 4300
    assert not np.array_equal(noise_lib.draw_batch(rng, (8,)), noise_lib.draw_batch(jax.random.fold_in(rng, 1), (8,)))

"""Environment throughput: steps/s of a jitted ``lax.scan`` of 1000 random-action steps
(compile excluded) for batches of 1, 64, 1024 and 8192 environments -- Ember's
``BatchedEnv``, and Ember's environment under plain ``jax.vmap`` over per-env keys, against
gymnax's same environment (``jax.vmap`` over per-env keys, gymnax's documented usage: the
same code as Ember's plain column) and against gymnasium's vector env -- for CartPole, Pendulum and
the five MinAtar games, side by side with ratios.

    python -m benchmarks.envs        # writes benchmarks/results/envs-<device>.json

Both JAX sides draw the random actions the same way (one batched ``noise.draw_batch``
call per step) and return the final state, so XLA cannot drop the dynamics. The MinAtar games run without sticky
actions on both JAX sides (gymnax has none). gymnasium's baselines run on the host with
NumPy: ``CartPoleVectorEnv`` (its vectorised NumPy CartPole); Pendulum and the MinAtar
games have no NumPy vector env in gymnasium/MinAtar, so they use ``SyncVectorEnv``
(a Python loop over environments) and are timed over fewer steps (a rate, the same
quantity). The sizes are the same on CPU and GPU.
"""

from __future__ import annotations

import time

import gymnasium
import gymnax
import jax
import numpy as np

import ember.envs
from benchmarks.harness import device_label, print_table, time_fn, write_results
from ember.envs import noise

BATCHES = (1, 64, 1024, 8192)
SCAN_STEPS = 1000
SCAN_STEPS_OF = {"Seaquest-MinAtar": 100}
"""Fewer steps per timing (the same rate) where gymnax's environment is too slow for 1000 at 8192."""
# id -> (Ember overrides, gymnax id, gymnasium id, gymnasium vectorization mode)
ENVIRONMENTS = {
    "CartPole-v1": ({}, "CartPole-v1", "CartPole-v1", "vector_entry_point"),
    "Pendulum-v1": ({}, "Pendulum-v1", "Pendulum-v1", "sync"),
    **{
        f"{game}-MinAtar": ({"sticky_action_prob": 0.0}, f"{game}-MinAtar", f"MinAtar/{game}-v1", "sync")
        for game in ("Asterix", "Breakout", "Freeway", "Seaquest", "SpaceInvaders")
    },
}
GYMNASIUM_STEP_BUDGET = {"vector_entry_point": 2_000_000, "sync": 100_000}  # env-steps per timing


def random_actions(key, space, num_envs):
    """``[num_envs, ...]`` uniformly random actions from one batched draw (the same sampler
    for both JAX sides; gymnasium's actions are sampled before its timer starts, so a cheap
    sampler keeps the comparison about the environments)."""
    discrete = type(space).__name__ == "Discrete"
    words = noise.draw_batch(key, (num_envs,) if discrete else (num_envs, *space.shape))
    if discrete:
        return noise.randint(words, 0, space.n)
    low, high = np.asarray(space.low, np.float32), np.asarray(space.high, np.float32)
    return noise.uniform(words, low, high, np.float32)


def ember_rollout(env_id, overrides, num_envs, scan_steps=SCAN_STEPS):
    env, params = ember.envs.make(env_id, **overrides)
    batched = ember.envs.BatchedEnv(env, num_envs)
    action_space = env.action_space(params)

    def rollout(key):
        _, state = batched.reset(key, params)

        def body(state, key):
            action_key, step_key = jax.random.split(key)
            actions = random_actions(action_key, action_space, num_envs)
            _, state, reward, *_ = batched.step(step_key, state, actions, params)
            return state, reward.sum()

        state, rewards = jax.lax.scan(body, state, jax.random.split(key, scan_steps))
        return state, rewards.sum()

    return jax.jit(rollout)


def gymnax_rollout(env_id, num_envs, scan_steps=SCAN_STEPS):
    return vmapped_rollout(*gymnax.make(env_id), num_envs, scan_steps)


def ember_plain_rollout(env_id, overrides, num_envs, scan_steps=SCAN_STEPS):
    """Ember's environment stepped the way gymnax users write it: ``jax.vmap(env.step)`` over
    per-environment keys (the same code as the gymnax column, so the two compare the envs)."""
    return vmapped_rollout(*ember.envs.make(env_id, **overrides), num_envs, scan_steps)


def vmapped_rollout(env, params, num_envs, scan_steps=SCAN_STEPS):
    action_space = env.action_space(params)
    vmapped_step = jax.vmap(env.step, in_axes=(0, 0, 0, None))

    def rollout(key):
        _, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, num_envs), params)

        def body(state, key):
            action_key, step_key = jax.random.split(key)
            actions = random_actions(action_key, action_space, num_envs)
            _, state, reward, *_ = vmapped_step(jax.random.split(step_key, num_envs), state, actions, params)
            return state, reward.sum()

        state, rewards = jax.lax.scan(body, state, jax.random.split(key, scan_steps))
        return state, rewards.sum()

    return jax.jit(rollout)


def jax_steps_per_second(rollout, num_envs, scan_steps=SCAN_STEPS) -> float:
    seconds = time_fn(rollout, jax.random.key(0), warmup=1, repeats=2)
    return num_envs * scan_steps / seconds


def gymnasium_steps_per_second(env_id, mode, num_envs) -> float:
    if env_id not in gymnasium.envs.registry and env_id.startswith("MinAtar/"):
        import minatar.gym

        minatar.gym.register_envs()
    envs = gymnasium.make_vec(env_id, num_envs=num_envs, vectorization_mode=mode)
    envs.reset(seed=0)
    envs.action_space.seed(0)
    steps = int(min(SCAN_STEPS, max(10, GYMNASIUM_STEP_BUDGET[mode] // num_envs)))
    actions = [envs.action_space.sample() for _ in range(steps)]
    start = time.perf_counter()
    for action in actions:
        envs.step(action)
    seconds = time.perf_counter() - start
    envs.close()
    return num_envs * steps / seconds


def main() -> None:
    if device_label() == "cpu":
        print("No GPU found: measuring on CPU (same sizes as on GPU).")
    rows = []
    for env_id, (overrides, gymnax_id, gymnasium_id, mode) in ENVIRONMENTS.items():
        for num_envs in BATCHES:
            steps = SCAN_STEPS_OF.get(env_id, SCAN_STEPS)
            ours = jax_steps_per_second(ember_rollout(env_id, overrides, num_envs, steps), num_envs, steps)
            plain = jax_steps_per_second(ember_plain_rollout(env_id, overrides, num_envs, steps), num_envs, steps)
            theirs = jax_steps_per_second(gymnax_rollout(gymnax_id, num_envs, steps), num_envs, steps)
            host = gymnasium_steps_per_second(gymnasium_id, mode, num_envs)
            rows.append(
                {
                    "env": env_id,
                    "batch": num_envs,
                    "ember_steps_per_s": ours,
                    "ember_plain_vmap_steps_per_s": plain,
                    "gymnax_steps_per_s": theirs,
                    "gymnasium_steps_per_s": host,
                    "gymnasium_vector_env": "CartPoleVectorEnv (NumPy)"
                    if mode == "vector_entry_point"
                    else "SyncVectorEnv",
                    "ember_over_gymnax": ours / theirs,
                    "ember_plain_vmap_over_gymnax": plain / theirs,
                    "ember_over_gymnasium": ours / host,
                }
            )
            print_table(
                rows[-1:],
                [
                    "env",
                    "batch",
                    "ember_steps_per_s",
                    "gymnax_steps_per_s",
                    "gymnasium_steps_per_s",
                    "ember_over_gymnax",
                    "ember_over_gymnasium",
                ],
            )
    print()
    print_table(
        rows,
        [
            "env",
            "batch",
            "ember_steps_per_s",
            "gymnax_steps_per_s",
            "gymnasium_steps_per_s",
            "ember_over_gymnax",
            "ember_plain_vmap_over_gymnax",
            "ember_over_gymnasium",
        ],
    )
    path = write_results(
        "envs", {"scan_steps": SCAN_STEPS, "scan_steps_of": SCAN_STEPS_OF, "batches": list(BATCHES), "rows": rows}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

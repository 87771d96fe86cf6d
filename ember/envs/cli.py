"""``ember envs``: list the registered environments, or record a random-policy episode.

ember envs list
ember envs show CartPole-v1 --out cartpole.gif [--seed 0] [--max-steps 300] [--fps 30]
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="action", required=True)
    commands.add_parser("list", help="print every registered environment id")
    show = commands.add_parser("show", help="record one random-policy episode as a GIF")
    show.add_argument("env_id", help="a registered environment id (see 'ember envs list')")
    show.add_argument("--out", required=True, help="path of the GIF to write")
    show.add_argument("--seed", type=int, default=0)
    show.add_argument("--max-steps", type=int, default=300, help="longest recording, in steps")
    show.add_argument("--fps", type=int, default=30)


def record_episode(env_id: str, seed: int, max_steps: int):
    """uint8 ``[frames, height, width, 3]``: the states of one random-policy episode, from
    the reset until the episode ends or ``max_steps`` steps pass."""
    import jax
    import numpy as np

    from ember.core.errors import ConfigError
    from ember.envs.multi_agent import episode_over
    from ember.envs.registry import make

    if max_steps < 1:
        raise ConfigError(f"--max-steps must be >= 1, got {max_steps}", key="--max-steps")
    env, params = make(env_id)
    action_space = env.action_space(params)

    @jax.jit
    def rollout(key):
        _, state = env.reset(jax.random.fold_in(key, 0), params)

        def body(state, key):
            action_key, step_key = jax.random.split(key)
            _, next_state, _, terminated, truncated, _ = env.step(
                step_key, state, action_space.sample(action_key), params
            )
            return next_state, (env.render(state, params), episode_over(terminated, truncated))

        _, (frames, done) = jax.lax.scan(body, state, jax.random.split(jax.random.fold_in(key, 1), max_steps))
        return frames, done

    frames, done = rollout(jax.random.key(seed))
    done = np.asarray(done)
    length = int(np.argmax(done)) + 1 if done.any() else max_steps
    return np.asarray(frames[:length])


def run(args: argparse.Namespace) -> int:
    from ember.core.errors import ConfigError
    from ember.envs.registry import registered

    if args.action == "list":
        for env_id in registered():
            print(env_id)
        return 0
    from ember.envs.rendering import save_gif

    if args.fps < 1:
        raise ConfigError(f"--fps must be >= 1, got {args.fps}", key="--fps")
    frames = record_episode(args.env_id, args.seed, args.max_steps)  # an unknown id: UnknownNameError
    path = save_gif(frames, args.out, fps=args.fps)
    print(f"wrote {len(frames)} frames of {args.env_id} to {path}")
    return 0

"""``ember eval RUN_DIR [--episodes N] [--gif out.gif]``: run a saved policy (``ember.training.eval_command``
dispatches an RL run here).

Loads the run's ``config.yaml`` and final checkpoint (with the observation statistics of a
run trained with ``ppo.normalize_observations``, applied frozen), runs ``N`` episodes,
prints the mean return (``--json`` prints the whole summary) and optionally records one
episode as a GIF.
"""

from __future__ import annotations

import argparse
import json

from ember.core.errors import ConfigError
from ember.training.rl.experiment import (
    check_recordable,
    evaluate_params,
    format_summary,
    load_run,
    record_episode,
)

OPTIONS = {"episodes": "--episodes", "seed": "--seed", "stochastic": "--stochastic", "gif": "--gif"}
"""The options of a policy's evaluation: ``{args attribute: flag}``; each defaults to None, which
tells an option left out from one given (a language model refuses them)."""
DEFAULT_EPISODES = 100


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--episodes", type=int, default=None, help="number of evaluation episodes (default 100)")
    group.add_argument("--seed", type=int, default=None, help="PRNG seed of the evaluation (default 0)")
    group.add_argument(
        "--stochastic", action="store_true", default=None, help="sample actions instead of the greedy action"
    )
    group.add_argument("--gif", default=None, help="also record one episode to this GIF file")


def run(args: argparse.Namespace) -> int:
    episodes = DEFAULT_EPISODES if args.episodes is None else args.episodes
    seed = 0 if args.seed is None else args.seed
    if episodes < 1:
        raise ConfigError(f"--episodes must be a positive integer, got {episodes}", key="--episodes")
    config, params, obs_stats = load_run(args.model)
    if args.gif:  # before the evaluation, which may take a while
        check_recordable(config.env)
    deterministic = False if args.stochastic else None
    summary = evaluate_params(config, params, episodes, seed=seed, deterministic=deterministic, obs_stats=obs_stats)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    if args.gif:
        from ember.envs import save_gif

        frames = record_episode(config, params, seed=seed, deterministic=deterministic, obs_stats=obs_stats)
        path = save_gif(list(frames), args.gif)
        print(f"wrote {path} ({len(frames)} frames)")
    return 0

"""``ember eval RUN_DIR --episodes N [--gif out.gif]``: run a saved policy.

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory written by 'ember train'")
    parser.add_argument("--episodes", type=int, default=100, help="number of evaluation episodes (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed of the evaluation")
    parser.add_argument("--stochastic", action="store_true", help="sample actions instead of the greedy action")
    parser.add_argument("--gif", default=None, help="also record one episode to this GIF file")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    if args.episodes < 1:
        raise ConfigError(f"--episodes must be a positive integer, got {args.episodes}", key="--episodes")
    config, params, obs_stats = load_run(args.run_dir)
    if args.gif:  # before the evaluation, which may take a while
        check_recordable(config.env)
    deterministic = False if args.stochastic else None
    summary = evaluate_params(
        config, params, args.episodes, seed=args.seed, deterministic=deterministic, obs_stats=obs_stats
    )
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    if args.gif:
        from ember.envs import save_gif

        frames = record_episode(config, params, seed=args.seed, deterministic=deterministic, obs_stats=obs_stats)
        path = save_gif(list(frames), args.gif)
        print(f"wrote {path} ({len(frames)} frames)")
    return 0

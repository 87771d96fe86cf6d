"""An RL run from a config: train, log, checkpoint, evaluate (what ``ember train`` calls for
``kind: rl``), and the evaluation of a finished run (``ember eval``).

A run directory holds:

    config.yaml       the resolved config (every default filled in)
    metrics.jsonl     one record per update: step (env steps), update, episode_return, losses...
    tensorboard/      the same metrics as TensorBoard event files
    checkpoints/      the final parameters (``ember.core.checkpoint``): ``{"params": ...}``, plus
                      ``"obs_stats"`` when ``ppo.normalize_observations``: ``{mean, var, count}``
                      (ppo), ``{"agents": {mean, var, count}, "global_state": {...}}`` (ippo,
                      mappo; ``global_state`` only for an environment that has one)
    eval.json         the final evaluation: mean_return, std_return, episodes, ...
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ember.core.checkpoint import CheckpointManager
from ember.core.config import load_config, run_kind, to_yaml
from ember.core.errors import ConfigError, EmberError, PathNotFoundError
from ember.core.files import write_text_atomic
from ember.envs.config import EnvConfig, make_from_config
from ember.envs.environment import Environment
from ember.envs.wrappers import MultiAgentObsStats, RunningMeanVar, Wrapper
from ember.training.launcher import DEFAULT_KIND
from ember.training.metrics import MetricsWriter
from ember.training.rl import dqn, multi_agent_ppo, ppo, pqn, sac
from ember.training.rl.config import RLConfig
from ember.training.rl.evaluate import evaluate, record

CONFIG_FILE = "config.yaml"
EVAL_FILE = "eval.json"
CHECKPOINT_DIR = "checkpoints"

#: A run's frozen observation statistics: ppo's, or ippo's and mappo's (agents and global state).
ObsStats = RunningMeanVar | MultiAgentObsStats


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """How the runner drives one algorithm.

    Attributes:
      section: ``config -> the algorithm's config section``.
      make_train: ``(section, env, env_params, on_update) -> train(rng)``.
      steps_per_update: ``section -> env steps per update`` (the metrics' x axis).
      num_updates: ``section -> number of updates``.
      make_act: ``(section, env, env_params, params, deterministic, obs_stats) -> act(obs, key)``;
        ``obs_stats`` are the frozen observation statistics of the run (``None`` without).
    """

    section: Callable[[RLConfig], Any]
    make_train: Callable[..., Callable]
    steps_per_update: Callable[[Any], int]
    num_updates: Callable[[Any], int]
    make_act: Callable[..., Callable]


def _without_obs_stats(make_act: Callable[..., Callable]) -> Callable[..., Callable]:
    """``make_act`` of an algorithm that never normalises observations: refuses ``obs_stats``."""

    def checked(section, env, env_params, params, deterministic, obs_stats):
        if obs_stats is not None:
            raise ValueError("obs_stats: only algos 'ppo', 'ippo' and 'mappo' train with normalised observations")
        return make_act(section, env, env_params, params, deterministic)

    return checked


def _multi_agent(centralised_critic: bool) -> Algorithm:
    return Algorithm(
        section=lambda config: config.ppo,
        make_train=lambda section, env, env_params, on_update: multi_agent_ppo.make_train(
            section, env, env_params, centralised_critic=centralised_critic, on_update=on_update
        ),
        steps_per_update=lambda section: section.num_envs * section.num_steps,
        num_updates=lambda section: section.num_updates,
        make_act=lambda section, env, env_params, params, deterministic, obs_stats: multi_agent_ppo.make_act(
            multi_agent_ppo.make_policy(section, env, env_params),
            params,
            list(env.agents),
            deterministic=deterministic,
            obs_stats=obs_stats,
        ),
    )


def _sac(multi_agent: bool) -> Algorithm:
    """SAC, or with ``multi_agent`` ISAC (one actor and critics shared by the env's agents)."""
    agents = lambda env: list(env.agents) if multi_agent else None  # noqa: E731
    return Algorithm(
        section=lambda config: config.sac,
        make_train=lambda section, env, env_params, on_update: sac.make_train(
            section, env, env_params, agents=agents(env), on_update=on_update
        ),
        steps_per_update=lambda section: section.num_envs * section.log_every,
        num_updates=lambda section: section.num_updates,
        make_act=_without_obs_stats(
            lambda section, env, env_params, params, deterministic: sac.make_act(
                sac.make_actor(section, env, env_params, agents(env)),
                params,
                deterministic=bool(deterministic),
                agents=agents(env),
            )
        ),
    )


ALGORITHMS: dict[str, Algorithm] = {
    "ppo": Algorithm(
        section=lambda config: config.ppo,
        make_train=lambda section, env, env_params, on_update: ppo.make_train(
            section, env, env_params, on_update=on_update
        ),
        steps_per_update=lambda section: section.num_envs * section.num_steps,
        num_updates=lambda section: section.num_updates,
        make_act=lambda section, env, env_params, params, deterministic, obs_stats: ppo.make_act(
            ppo.make_policy(section, env, env_params), params, deterministic=deterministic, obs_stats=obs_stats
        ),
    ),
    "dqn": Algorithm(
        section=lambda config: config.dqn,
        make_train=lambda section, env, env_params, on_update: dqn.make_train(
            section, env, env_params, on_update=on_update
        ),
        steps_per_update=lambda section: section.num_envs * section.log_every,
        num_updates=lambda section: section.num_updates,
        make_act=_without_obs_stats(
            lambda section, env, env_params, params, deterministic: dqn.make_act(
                dqn.make_q_network(section, env, env_params),
                params,
                epsilon=0.0 if deterministic else section.epsilon_end,
            )
        ),
    ),
    "pqn": Algorithm(
        section=lambda config: config.pqn,
        make_train=lambda section, env, env_params, on_update: pqn.make_train(
            section, env, env_params, on_update=on_update
        ),
        steps_per_update=lambda section: section.num_envs * section.num_steps,
        num_updates=lambda section: section.num_updates,
        make_act=_without_obs_stats(
            lambda section, env, env_params, params, deterministic: dqn.make_act(
                dqn.make_q_network(section, env, env_params, algo="PQN"),
                params,
                epsilon=0.0 if deterministic else section.epsilon_end,
            )
        ),
    ),
    "sac": _sac(multi_agent=False),
    "ippo": _multi_agent(centralised_critic=False),
    "mappo": _multi_agent(centralised_critic=True),
    "isac": _sac(multi_agent=True),
}


def run_experiment(config: RLConfig, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Trains ``config.algo`` on ``config.env``, writes the run directory (module docstring)
    and returns the evaluation summary written to ``eval.json``.

    An RL run is one compiled program with no intermediate checkpoints, so ``resume`` is
    refused: rerun it (CartPole takes seconds). A rerun into the ``run_dir`` of a run that stopped
    before its checkpoint starts afresh (its metrics replace the stopped run's); one that stopped
    in its final evaluation, with this same config, only evaluates the saved policy.
    """
    from tqdm.auto import tqdm

    run_dir = Path(config.run_dir)
    if resume:
        raise EmberError(
            "RL runs are one compiled program without intermediate checkpoints and cannot --resume; rerun instead"
        )
    if (run_dir / CHECKPOINT_DIR).is_dir() and any((run_dir / CHECKPOINT_DIR).iterdir()):
        return _finish_evaluation(config, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / CONFIG_FILE, to_yaml(config))
    algorithm = ALGORITHMS[config.algo]
    section = algorithm.section(config)
    env, env_params = make_from_config(config.env)
    num_updates = algorithm.num_updates(section)

    bar = tqdm(total=num_updates, desc=f"{config.algo} {config.env.id}", unit="update", disable=not progress)

    def on_update(metrics):
        bar.update(1)
        if int(metrics["episodes"]) > 0:
            bar.set_postfix(episode_return=f"{float(metrics['episode_return']):.1f}")

    train = jax.jit(algorithm.make_train(section, env, env_params, on_update))
    result = jax.block_until_ready(train(jax.random.key(config.seed)))
    bar.close()

    steps_per_update = algorithm.steps_per_update(section)
    metrics = jax.tree.map(np.asarray, result["metrics"])
    writer = MetricsWriter(run_dir, resume_step=0)  # a fresh start: drops a stopped attempt's records
    for update in range(num_updates):
        record = {name: values[update].item() for name, values in metrics.items()}
        if record["episodes"] == 0:  # no episode ended in this update: no return to report
            record.pop("episode_return")
            record.pop("episode_length")
        writer.write((update + 1) * steps_per_update, {"update": update + 1, **record})
    writer.close()

    obs_stats = result.get("obs_stats")
    saved = {"params": result["params"]}
    if obs_stats is not None:
        saved["obs_stats"] = _saved_stats(obs_stats)
    with CheckpointManager(run_dir / CHECKPOINT_DIR, max_to_keep=1) as manager:
        manager.save(num_updates, saved, extra={"algo": config.algo, "env_id": config.env.id})
    return _evaluate_run(config, run_dir, result["params"], obs_stats)


def _evaluate_run(config: RLConfig, run_dir: Path, params: Any, obs_stats: ObsStats | None) -> dict[str, Any]:
    """The run's final evaluation, written to ``eval.json``; returns its summary and ``run_dir``."""
    summary = evaluate_params(config, params, config.eval.episodes, seed=config.seed + 1, obs_stats=obs_stats)
    write_text_atomic(run_dir / EVAL_FILE, json.dumps(summary, indent=2) + "\n")
    return {**summary, "run_dir": str(run_dir)}


def _finish_evaluation(config: RLConfig, run_dir: Path) -> dict[str, Any]:
    """A rerun into ``run_dir``, which holds a trained run: evaluates its saved policy when the run
    stopped in its final evaluation (no ``eval.json``) and was trained with ``config``.

    Raises:
      EmberError: the run finished, or was trained with another config."""
    if (run_dir / EVAL_FILE).is_file():
        raise EmberError(f"run_dir {run_dir} already holds a finished run; choose another run_dir")
    saved = run_dir / CONFIG_FILE
    if not saved.is_file() or saved.read_text() != to_yaml(config):
        raise EmberError(
            f"run_dir {run_dir} holds a trained run whose final evaluation did not finish (no {EVAL_FILE}), trained "
            f"with another config than this one; 'ember eval {run_dir}' evaluates it, or choose another run_dir"
        )
    _, params, obs_stats = load_run(run_dir)
    return _evaluate_run(config, run_dir, params, obs_stats)


def _saved_stats(stats: ObsStats) -> dict[str, Any]:
    """How a checkpoint holds ``stats`` (module docstring): nested dicts of arrays, no ``None``."""
    if isinstance(stats, MultiAgentObsStats):
        saved = {"agents": _saved_stats(stats.agents)}
        if stats.global_state is not None:
            saved["global_state"] = _saved_stats(stats.global_state)
        return saved
    return {"mean": stats.mean, "var": stats.var, "count": stats.count}


def _restored_stats(saved: dict[str, Any]) -> ObsStats:
    """The inverse of :func:`_saved_stats`."""
    if "agents" in saved:
        global_state = saved.get("global_state")
        return MultiAgentObsStats(
            _restored_stats(saved["agents"]), None if global_state is None else _restored_stats(global_state)
        )
    return RunningMeanVar(**{k: jnp.asarray(v) for k, v in saved.items()})


def load_run(run_dir: str | Path) -> tuple[RLConfig, Any, ObsStats | None]:
    """The config, final parameters and frozen observation statistics (``None`` for runs
    without ``ppo.normalize_observations``, and for runs saved before it existed; a
    ``MultiAgentObsStats`` for ippo and mappo) of a finished run."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise PathNotFoundError(f"{run_dir} is not a run directory: it has no {CONFIG_FILE}")
    kind = run_kind(run_dir, default=DEFAULT_KIND)
    if kind != "rl":
        raise EmberError(
            f"{run_dir} is a {kind!r} run, not an RL one (kind: rl); 'ember eval {run_dir}' gives a language "
            f"model's loss on a text, 'ember generate --checkpoint {run_dir} --prompt TEXT' samples it"
        )
    config = load_config(RLConfig, run_dir / CONFIG_FILE)
    state = CheckpointManager(run_dir / CHECKPOINT_DIR, read_only=True).restore().state
    saved_stats = state.get("obs_stats")
    obs_stats = None if saved_stats is None else _restored_stats(saved_stats)
    normalized = getattr(ALGORITHMS[config.algo].section(config), "normalize_observations", False)
    if obs_stats is None and normalized:
        raise EmberError(
            f"{run_dir} was trained with ppo.normalize_observations but its checkpoint holds no "
            "observation statistics (obs_stats); its policy cannot be evaluated without them"
        )
    return config, state["params"], obs_stats


def _make_act(config: RLConfig, env, env_params, params: Any, deterministic: bool | None, obs_stats) -> Callable:
    algorithm = ALGORITHMS[config.algo]
    deterministic = config.eval.deterministic if deterministic is None else deterministic
    return algorithm.make_act(algorithm.section(config), env, env_params, params, deterministic, obs_stats)


def evaluate_params(
    config: RLConfig,
    params: Any,
    episodes: int,
    *,
    seed: int,
    deterministic: bool | None = None,
    obs_stats: ObsStats | None = None,
) -> dict[str, Any]:
    """Runs the policy ``params`` of ``config`` for ``episodes`` episodes; a JSON-ready summary.
    ``obs_stats``: the run's observation statistics, applied frozen (see :func:`load_run`)."""
    env, env_params = make_from_config(config.env)
    deterministic = config.eval.deterministic if deterministic is None else deterministic
    act = _make_act(config, env, env_params, params, deterministic, obs_stats)
    returns, lengths = evaluate(act, env, env_params, jax.random.key(seed), episodes)
    returns, lengths = np.asarray(returns, np.float64), np.asarray(lengths)
    return {
        "env_id": config.env.id,
        "algo": config.algo,
        "episodes": int(episodes),
        "deterministic": bool(deterministic),
        "mean_return": float(returns.mean()),
        "std_return": float(returns.std()),
        "min_return": float(returns.min()),
        "max_return": float(returns.max()),
        "mean_length": float(lengths.mean()),
    }


def record_episode(
    config: RLConfig,
    params: Any,
    *,
    seed: int,
    deterministic: bool | None = None,
    obs_stats: ObsStats | None = None,
) -> np.ndarray:
    """Frames ``[time, height, width, 3]`` (uint8) of one episode of the policy, from the
    first observation to the last state before the episode ended.

    Raises:
      ConfigError: the environment draws no frames (see :func:`check_recordable`).
    """
    check_recordable(config.env)
    env, env_params = make_from_config(config.env)
    act = _make_act(config, env, env_params, params, deterministic, obs_stats)
    return record(act, env, env_params, jax.random.key(seed))


def check_recordable(env_config: EnvConfig) -> None:
    """Raises ``ConfigError`` (key ``env.source``) when the environment has no ``render``: the
    gymnax and JaxMARL adapters draw no frames."""
    env, _ = make_from_config(env_config)
    if type(env.unwrapped if isinstance(env, Wrapper) else env).render is Environment.render:
        raise ConfigError(
            f"env.source: {env.name} has no render (a {env_config.source} environment draws no frames); "
            "only Ember's own environments can be recorded",
            key="env.source",
        )


def format_summary(summary: dict[str, Any]) -> str:
    mean, std = summary["mean_return"], summary["std_return"]
    spread = "" if math.isnan(std) else f" +- {std:.2f}"
    return (
        f"{summary['algo']} on {summary['env_id']}: mean return {mean:.2f}{spread} over {summary['episodes']} episodes"
    )


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "check_recordable",
    "evaluate_params",
    "format_summary",
    "load_run",
    "record_episode",
    "run_experiment",
]

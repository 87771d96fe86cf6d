"""The schema of RL experiment configs (``configs/rl/*.yaml``), read by ``ember train``.

    kind: rl
    algo: ppo                  # ppo | dqn | ippo | mappo
    run_dir: runs/ppo_cartpole
    seed: 0
    env: {id: CartPole-v1}
    ppo: {total_timesteps: 150000, learning_rate: 1.0e-3}
    eval: {episodes: 100}

Only the section of ``algo`` is used (``ippo`` and ``mappo`` read ``ppo:``); setting the
other section is an error, since its keys would silently do nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ember.training.rl.dqn import DQNConfig
from ember.training.rl.ppo import PPOConfig

ALGORITHMS = ("ppo", "dqn", "ippo", "mappo")
ENV_SOURCES = ("ember", "gymnax", "jaxmarl")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Which environment: ``id`` in the ``source`` library and overrides of its default
    parameters (``params: {max_steps_in_episode: 200}``). ``source: ember`` (the default)
    uses ``ember.envs.make``; ``gymnax`` runs ``gymnax.make(id)`` and ``jaxmarl`` runs
    ``jaxmarl.make(id)`` through Ember's adapters.
    ``flatten_observation`` wraps the env in ``ember.envs.wrappers.FlattenObservation``
    (for pytree observations such as the maze's ``{view, has_key}``)."""

    id: str = "CartPole-v1"
    source: str = "ember"
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    flatten_observation: bool = False

    def __post_init__(self):
        if self.source not in ENV_SOURCES:
            raise ValueError(f"env.source must be one of {ENV_SOURCES}, got {self.source!r}")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The final evaluation: ``episodes`` whole episodes with the greedy (``deterministic``)
    or sampled policy."""

    episodes: int = 100
    deterministic: bool = True

    def __post_init__(self):
        if self.episodes < 1:
            raise ValueError(f"eval.episodes must be a positive integer, got {self.episodes}")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """An RL experiment: algorithm, environment, run directory, seed and the algorithm's section."""

    kind: str = "rl"
    algo: str = "ppo"
    run_dir: str = "runs/rl"
    seed: int = 0
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    dqn: DQNConfig = dataclasses.field(default_factory=DQNConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    def __post_init__(self):
        if self.kind != "rl":
            raise ValueError(f"kind must be 'rl' for an RL config, got {self.kind!r}")
        if self.algo not in ALGORITHMS:
            raise ValueError(f"algo must be one of {ALGORITHMS}, got {self.algo!r}")
        unused = "ppo" if self.algo == "dqn" else "dqn"
        section = getattr(self, unused)
        if section != type(section)():
            used = "dqn" if unused == "ppo" else "ppo"
            raise ValueError(
                f"algo {self.algo!r} reads the {used}: section, not {unused}:; the {unused}: settings given "
                f"would have no effect (remove them, or choose an algo that uses them)"
            )


__all__ = ["ALGORITHMS", "ENV_SOURCES", "EnvConfig", "EvalConfig", "RLConfig"]

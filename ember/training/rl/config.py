"""The schema of RL experiment configs (``configs/rl/*.yaml``), read by ``ember train``.

    kind: rl
    algo: ppo                  # ppo | dqn | pqn | sac | ippo | mappo | isac
    run_dir: runs/ppo_cartpole
    seed: 0
    env: {id: CartPole-v1}
    ppo: {total_timesteps: 150000, learning_rate: 1.0e-3}
    eval: {episodes: 100}

Only the section of ``algo`` is used (``ippo`` and ``mappo`` read ``ppo:``, ``isac``
``sac:``); setting another
algorithm's section is an error, since its keys would silently do nothing. Every value, and
whether ``algo`` can train an Ember ``env`` at all, is checked when the config is built:
errors are ``ConfigError``s keyed by the full path (``ppo.num_envs``).
"""

from __future__ import annotations

import dataclasses

from ember.core.errors import ConfigError
from ember.envs.config import ENV_SOURCES, EnvConfig, make_from_config
from ember.envs.multi_agent import is_multi_agent
from ember.training.rl import multi_agent_ppo
from ember.training.rl.dqn import DQNConfig
from ember.training.rl.ppo import PPOConfig
from ember.training.rl.pqn import PQNConfig
from ember.training.rl.sac import SACConfig, make_actor, warm_replay_items

SECTION_OF = {"ppo": "ppo", "dqn": "dqn", "pqn": "pqn", "sac": "sac", "ippo": "ppo", "mappo": "ppo", "isac": "sac"}
"""The config section each algorithm reads."""
ALGORITHMS = tuple(SECTION_OF)
MULTI_AGENT_ALGORITHMS = ("ippo", "mappo", "isac")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The final evaluation: ``episodes`` whole episodes with the greedy (``deterministic``)
    or sampled policy."""

    episodes: int = 100
    deterministic: bool = True

    def __post_init__(self):
        if self.episodes < 1:
            raise ConfigError(f"episodes must be a positive integer, got {self.episodes}", key="episodes")


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
    pqn: PQNConfig = dataclasses.field(default_factory=PQNConfig)
    sac: SACConfig = dataclasses.field(default_factory=SACConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    def __post_init__(self):
        if self.kind != "rl":
            raise ConfigError(f"kind must be 'rl' for an RL config, got {self.kind!r}", key="kind")
        if self.algo not in ALGORITHMS:
            raise ConfigError(f"algo must be one of {', '.join(ALGORITHMS)}, got {self.algo!r}", key="algo")
        used = SECTION_OF[self.algo]
        for unused in sorted(set(SECTION_OF.values()) - {used}):
            section = getattr(self, unused)
            if section != type(section)():
                raise ConfigError(
                    f"algo {self.algo!r} reads the {used}: section, not {unused}:; the {unused}: settings given "
                    f"would have no effect (remove them, or choose an algo that uses them)",
                    key=unused,
                )
        if self.algo in MULTI_AGENT_ALGORITHMS and used == "ppo":  # IPPO, MAPPO
            try:
                multi_agent_ppo.check_config(self.ppo)
            except ConfigError as error:
                raise ConfigError(f"ppo.{error} (algo {self.algo!r})", key=f"ppo.{error.key}") from None
        if self.env.source == "ember":
            self._check_env_fits_algo()

    def _check_env_fits_algo(self) -> None:
        """The algorithm can drive the (Ember) environment: one agent or many (homogeneous
        ones, for a shared policy), one observation array for a single agent (a dict of them
        needs env.flatten_observation), discrete actions for DQN and PQN, continuous ones for SAC and ISAC.
        Other sources are checked when their library makes the env."""
        env, env_params = make_from_config(self.env)
        multi_agent = is_multi_agent(env)
        if multi_agent != (self.algo in MULTI_AGENT_ALGORITHMS):
            wanted = ", ".join(MULTI_AGENT_ALGORITHMS) if multi_agent else "ppo, dqn, pqn, sac"
            raise ConfigError(
                f"algo {self.algo!r} cannot train env.id {self.env.id!r}, a "
                f"{'multi' if multi_agent else 'single'}-agent environment; use algo {wanted}",
                key="algo",
            )
        if multi_agent:
            try:
                if self.algo == "isac":
                    make_actor(self.sac, env, env_params, list(env.agents))
                else:
                    multi_agent_ppo.make_policy(self.ppo, env, env_params)
            except ConfigError as error:
                message = f"algo {self.algo!r} cannot train env.id {self.env.id!r}: {error}"
                raise ConfigError(message, key="env.id") from None
            if self.algo == "isac":
                try:
                    warm_replay_items(self.sac, list(env.agents))
                except ConfigError as error:
                    raise ConfigError(f"sac.{error}", key=f"sac.{error.key}") from None
        observations = env.observation_space(env_params)
        if not multi_agent and observations.shape is None:  # a Dict or Tuple of arrays
            raise ConfigError(
                f"algo {self.algo!r} needs observations that are one array; env.id {self.env.id!r} gives "
                f"{observations!r}: set env.flatten_observation: true",
                key="env.flatten_observation",
            )
        # Agents share one network, so (checked above) one observation shape: the first agent's.
        shape = observations[env.agents[0]].shape if multi_agent else observations.shape
        section = SECTION_OF[self.algo]
        torso = getattr(getattr(self, section).policy, "torso", None)
        wanted = {"mlp": 1, "cnn": 3}.get(torso)
        if wanted is not None and shape is not None and len(shape) != wanted:
            raise ConfigError(
                f"{section}.policy.torso {torso!r} takes observations of {wanted} dimension(s) ("
                f"{'[obs_dim]' if torso == 'mlp' else '[height, width, channels]'}); env.id {self.env.id!r} gives "
                f"{shape}: use {section}.policy.torso: {'cnn' if len(shape) == 3 else 'mlp'}",
                key=f"{section}.policy.torso",
            )
        space = env.action_space(env_params)
        if self.algo in ("dqn", "pqn") and not hasattr(space, "n"):
            raise ConfigError(
                f"algo {self.algo!r} needs discrete actions; env.id {self.env.id!r} has {space!r}", key="algo"
            )
        if self.algo == "sac" and hasattr(space, "n"):
            raise ConfigError(f"algo 'sac' needs continuous actions; env.id {self.env.id!r} has {space!r}", key="algo")


__all__ = ["ALGORITHMS", "ENV_SOURCES", "MULTI_AGENT_ALGORITHMS", "EnvConfig", "EvalConfig", "RLConfig"]

"""IPPO and MAPPO with parameter sharing over the multi-agent dict API (JaxMARL convention).

    env, env_params = ember.envs.make("MPE-simple_spread")
    train = jax.jit(make_train(PPOConfig(...), env, env_params, centralised_critic=True))  # MAPPO

All agents share one actor (and one critic). Agents must be homogeneous: the same
observation shape and the same action space. Per-agent arrays are stacked along an agent
axis, so a rollout is ``[T, num_envs, agents, ...]`` and GAE and the PPO loss
(:mod:`.gae`, :mod:`.losses`) run on it unchanged:

- **IPPO**: the critic sees the agent's own observation;
- **MAPPO**: the critic sees the global state, plus a one-hot agent id so that per-agent
  rewards stay predictable: the environment's own where it offers one (``global_state``,
  ``ember.envs.multi_agent``; SMAX's ``world_state`` of every unit, enemies included, as
  JaxMARL's MAPPO feeds its critic), otherwise every agent's observation concatenated (MPE).

Agents may end one by one and act under masks (``ember.envs.multi_agent``: SMAX, Hanabi
through ``JaxMARLEnv``): each agent's GAE stops at its own ``terminated`` (a dead unit does not
bootstrap past its death; its later steps, with the only action left to it, carry no policy
gradient), and with ``action_masks`` the actions are sampled from the logits of the legal
actions only, the masks stored with the rollout so the PPO loss recomputes log-probabilities
and entropy under the same masks. (JaxMARL's own SMAX baselines cut GAE at the episode's end
instead, so rewards a team earns after a unit died still reach that unit's earlier actions.)
The ``episode_return`` metric is the return per agent (the episode's rewards averaged over
agents, summed over time: ``LogWrapper``'s multi-agent statistics).

With ``normalize_observations`` the learner's environments are wrapped in
``NormalizeObservation`` as for one agent: every agent's observation is normalised with one
set of running statistics of all living agents' observations (the shared actor sees them all),
and the global state MAPPO's critic reads with statistics of its own; ``train`` returns both
as ``obs_stats``, a :class:`~ember.envs.wrappers.MultiAgentObsStats`, and :func:`make_act`
applies the agents' statistics frozen. The update loop is
PPO's own (:func:`.ppo.make_ppo_train`); this module gives it the :func:`~.agent_view.multi_agent_view`
of stacked agents (:func:`make_view`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ember.core.errors import ConfigError
from ember.envs.multi_agent import has_global_state, masks_actions
from ember.envs.wrappers import MultiAgentObsStats
from ember.models.policies import CentralisedActorCritic
from ember.training.rl.agent_view import AgentView, multi_agent_view, shared_action_head
from ember.training.rl.policy_act import PolicyAct
from ember.training.rl.ppo import PPOConfig, make_ppo_train

#: Per-agent rewards are a dict: ``NormalizeReward`` scales one reward per environment.
UNSUPPORTED_OPTIONS = ("normalize_rewards",)


def check_config(config: PPOConfig) -> None:
    """Raises ``ConfigError`` (keyed within the ``ppo:`` section) for the options that only
    single-agent PPO supports."""
    for option in UNSUPPORTED_OPTIONS:
        if getattr(config, option):
            raise ConfigError(
                f"{option} is not supported for multi-agent training (ippo, mappo); it is available for algo: ppo",
                key=option,
            )


def make_policy(config: PPOConfig, env, env_params) -> CentralisedActorCritic:
    """The shared actor-critic of ``env``'s (homogeneous) agents."""
    return CentralisedActorCritic(shared_action_head(env, env_params, config.policy), config.policy)


def make_view(env, *, centralised_critic: bool) -> AgentView:
    """How PPO's loop sees ``env``'s agents (:func:`.agent_view.multi_agent_view`): acting under
    its ``action_masks`` where it has them, and, with ``centralised_critic`` (MAPPO), the critic
    on its ``global_state`` where it offers one."""
    return multi_agent_view(
        list(env.agents),
        centralised_critic=centralised_critic,
        action_masks=masks_actions(env),
        global_state=has_global_state(env),
    )


def make_train(
    config: PPOConfig,
    env,
    env_params,
    *,
    centralised_critic: bool = False,
    on_update: Callable[[Any], None] | None = None,
) -> Callable[..., dict[str, Any]]:
    """``train(rng, hyperparams=None) -> {"params", "obs_stats", "metrics"}`` as
    :func:`.ppo.make_train` (the same loop), for a multi-agent environment;
    ``centralised_critic`` selects MAPPO over IPPO. ``obs_stats`` is ``None``, or with
    ``normalize_observations`` a :class:`~ember.envs.wrappers.MultiAgentObsStats`: ``agents``
    (mean and var of one agent's observation shape, over every agent) and ``global_state``
    (of the global state's shape; ``None`` for an environment without one)."""
    check_config(config)
    policy = make_policy(config, env, env_params)
    view = make_view(env, centralised_critic=centralised_critic)
    return make_ppo_train(config, env, env_params, policy, view, on_update=on_update)


def make_act(
    policy: CentralisedActorCritic,
    params: Any,
    agents: list[str],
    *,
    deterministic: bool = True,
    obs_stats: MultiAgentObsStats | None = None,
) -> PolicyAct:
    """``act(obs_dict, key, legal_actions=None) -> actions_dict`` for a batch of environments
    (``obs_dict`` values ``[batch, obs_dim]``; ``legal_actions`` the environment's
    ``action_masks``, ``{agent: bool [batch, num_actions]}``): the shared actor's mode, or a
    sample, among the legal actions (a :class:`.PolicyAct`). A policy trained with
    ``normalize_observations`` needs the run's ``obs_stats``: every agent's raw observation is
    normalised with its ``agents`` statistics, frozen (the actor never reads the global state)."""
    if obs_stats is not None and not isinstance(obs_stats, MultiAgentObsStats):
        raise ValueError(
            f"obs_stats: a multi-agent policy takes the MultiAgentObsStats its training returned, got "
            f"{type(obs_stats).__name__}"
        )
    agent_stats = None if obs_stats is None else obs_stats.agents
    return PolicyAct(policy, params, agent_stats, deterministic=deterministic, agents=tuple(agents))


__all__ = ["check_config", "make_act", "make_policy", "make_train", "make_view"]

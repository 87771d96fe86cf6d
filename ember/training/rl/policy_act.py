"""``act(obs, key, legal_actions=None) -> env_action`` of a trained actor, as a pytree for
:func:`ember.training.rl.evaluate.evaluate`: its parameters (and observation statistics) are
the pytree's leaves, the network and flags its static part, so a new policy of the same
network reuses the compiled evaluation.

    act = PolicyAct(policy, params, obs_stats=result["obs_stats"])   # what ppo.make_act builds
    actions = act(obs, key)                                          # [N, *obs_shape] -> [N, ...]
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
from flax import struct

from ember.envs.wrappers import RunningMeanVar
from ember.models.policies import Actor
from ember.training.rl.agent_view import stack_agents, unstack_agents


def _actor_of(module: nn.Module, obs: jax.Array) -> Any:
    """The ``method`` of an actor-critic's ``apply`` that runs its actor alone."""
    return module.actor(obs)


@struct.dataclass
class PolicyAct:
    """An actor's action for a batch of observations: the distribution's mode when
    ``deterministic``, otherwise a sample; as the environment takes it (``env_action``).

    Attributes:
      network: an :class:`~ember.models.policies.Actor`, or an actor-critic
        (``ActorCritic``, ``CentralisedActorCritic``) whose ``actor`` is run alone. Static.
      params: the network's variables (a pytree of arrays).
      obs_stats: observation statistics the observations are normalised with, frozen
        (PPO's ``normalize_observations``; with ``agents``, the statistics every agent's
        observation shares, ``MultiAgentObsStats.agents``); ``None`` for raw observations.
      deterministic: the mode (True) or a sample from ``key`` (False). Static.
      agents: a multi-agent environment's agents (static): observations and actions are
        dicts ``{agent: [N, ...]}``, stacked to ``[N, agents, ...]`` for the shared network.
    """

    network: nn.Module = struct.field(pytree_node=False)
    params: Any
    obs_stats: RunningMeanVar | None = None
    deterministic: bool = struct.field(pytree_node=False, default=True)
    agents: tuple[str, ...] | None = struct.field(pytree_node=False, default=None)

    def __call__(self, obs: Any, key: jax.Array, legal_actions: Any = None) -> Any:
        """Actions ``[N, ...]`` (a dict of them with ``agents``) for observations ``[N, ...]``;
        among the ``legal_actions`` only where given (bool ``[N, num_actions]``, a dict of them
        with ``agents``: a multi-agent environment's ``action_masks``)."""
        if self.agents:
            obs = stack_agents(obs, self.agents)
        if self.obs_stats is not None:
            obs = self.obs_stats.normalize(obs)
        method = None if isinstance(self.network, Actor) else _actor_of
        dist = self.network.apply(self.params, obs, method=method)
        if legal_actions is not None:
            dist = dist.restricted(stack_agents(legal_actions, self.agents) if self.agents else legal_actions)
        action = dist.env_action(dist.mode() if self.deterministic else dist.sample(key))
        if self.agents:
            return unstack_agents(action, self.agents)
        return action


__all__ = ["PolicyAct"]

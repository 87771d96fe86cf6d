"""How the RL training loops see an environment's agents: one agent as it is, or several
(JaxMARL's dict API) stacked along an agent axis for a policy shared by all of them.

    view = multi_agent_view(list(env.agents), centralised_critic=False)   # IPPO, ISAC
    obs = view.observe(obs_dict)                                         # [N, agents, ...]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ember.core.errors import ConfigError
from ember.models.policies import PolicyConfig, action_head


@dataclasses.dataclass(frozen=True)
class AgentView:
    """How a training loop (PPO's :func:`.ppo.make_ppo_train`, SAC's :func:`.sac.make_train`)
    sees an environment's agents and its policy's inputs. The defaults are one agent;
    :func:`multi_agent_view` stacks agents along an axis.

    Attributes:
      observe: the environment's observation -> the policy's observation ``[N, ...]``.
      env_action: the policy's action ``[N, ...]`` -> the environment's action.
      step_arrays: ``(reward, terminated, truncated)`` of a step -> three arrays of one shape
        (``[N]``, or ``[N, agents]``): the learner's reward and episode ends.
      policy_inputs: observations ``[..., *obs_shape]`` -> the policy's positional inputs.
      value_inputs: observations -> the inputs of the policy's ``value`` method.
      legal_actions: ``(envs, env_state, env_params)`` -> bool ``[N, ..., num_actions]``, the
        legal actions of the observation that goes with ``env_state`` (an environment's
        ``action_masks``, stacked as the observations); ``None`` where every action is legal.
    """

    observe: Callable[[Any], Any] = lambda obs: obs
    env_action: Callable[[jax.Array], Any] = lambda action: action
    step_arrays: Callable[..., tuple[jax.Array, jax.Array, jax.Array]] = lambda reward, terminated, truncated: (
        reward.astype(jnp.float32),
        terminated,
        truncated,
    )
    policy_inputs: Callable[[Any], tuple] = lambda obs: (obs,)
    value_inputs: Callable[[Any], tuple] = lambda obs: (obs,)
    legal_actions: Callable[[Any, Any, Any], jax.Array] | None = None


def stack_agents(per_agent: dict[str, Any], agents: list[str]) -> Any:
    """A dict ``{agent: x [batch, ...]}`` as one array ``[batch, agents, ...]`` (in ``agents`` order)."""
    return jnp.stack([per_agent[agent] for agent in agents], axis=1)


def unstack_agents(stacked: Any, agents: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The inverse of :func:`stack_agents`: ``[batch, agents, ...]`` as ``{agent: [batch, ...]}``."""
    return {agent: stacked[:, i] for i, agent in enumerate(agents)}


def global_state(obs: jax.Array) -> jax.Array:
    """MAPPO's critic input ``[..., agents, agents * obs_dim + agents]`` from stacked
    observations ``[..., agents, obs_dim]``: all observations plus a one-hot agent id."""
    *batch, agents, obs_dim = obs.shape
    everyone = jnp.broadcast_to(obs.reshape(*batch, 1, agents * obs_dim), (*batch, agents, agents * obs_dim))
    identity = jnp.broadcast_to(jnp.eye(agents, dtype=obs.dtype), (*batch, agents, agents))
    return jnp.concatenate([everyone, identity], axis=-1)


def multi_agent_view(agents: list[str], *, centralised_critic: bool, action_masks: bool = False) -> AgentView:
    """The view of a multi-agent environment: observations, rewards, actions and each agent's
    own ``terminated`` stacked along an agent axis (``[N, agents, ...]``; ``truncated`` is the
    episode's); the critic sees :func:`global_state` (MAPPO) or the agent's own observation
    (IPPO). With ``action_masks`` the policy acts under the environment's ``action_masks``
    (``ember.envs.multi_agent``)."""
    critic_input = global_state if centralised_critic else (lambda obs: obs)

    def step_arrays(rewards, terminated, truncated):
        reward = stack_agents(rewards, agents).astype(jnp.float32)  # [N, A]
        truncated = jnp.broadcast_to(truncated["__all__"][:, None], reward.shape)
        return reward, stack_agents(terminated, agents), truncated

    def legal_actions(envs, env_state, env_params):
        return stack_agents(envs.action_masks(env_state, env_params), agents)

    return AgentView(
        observe=lambda obs: stack_agents(obs, agents),
        env_action=lambda action: unstack_agents(action, agents),
        step_arrays=step_arrays,
        policy_inputs=lambda obs: (obs, critic_input(obs)),
        value_inputs=lambda obs: (critic_input(obs),),
        legal_actions=legal_actions if action_masks else None,
    )


def shared_action_head(env, env_params, policy: PolicyConfig) -> Any:
    """The action head of a policy shared by all of ``env``'s agents, which must have one
    observation shape and one action space (``ConfigError`` keyed ``env.id`` otherwise)."""
    observation_spaces = env.observation_space(env_params)
    action_spaces = env.action_space(env_params)
    shapes = {tuple(observation_spaces[agent].shape) for agent in env.agents}
    heads = {action_head(action_spaces[agent], policy) for agent in env.agents}
    if len(shapes) != 1 or len(heads) != 1:
        raise ConfigError(
            f"parameter sharing needs agents with one observation shape and one action space; got shapes {shapes} "
            f"and action heads {heads}",
            key="env.id",
        )
    return heads.pop()


__all__ = ["AgentView", "global_state", "multi_agent_view", "shared_action_head", "stack_agents", "unstack_agents"]

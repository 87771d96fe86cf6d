"""How the RL training loops see an environment's agents: one agent as it is, or several
(JaxMARL's dict API) stacked along an agent axis for a policy shared by all of them.

    view = multi_agent_view(list(env.agents), centralised_critic=False)   # IPPO, ISAC
    obs = view.observation(obs_dict, envs, env_state, env_params)        # [N, agents, ...]
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
      reads_global_state: the policy reads the environment's global state (MAPPO's critic,
        ``ember.envs.multi_agent``) as well: what the loop keeps of an observation, and gives
        ``policy_inputs``/``value_inputs``, is then the pair ``(observe(obs), global_state
        [N, state_dim])`` (:meth:`observation`, :meth:`final_observation`).
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
    reads_global_state: bool = False

    def observation(self, obs: Any, envs: Any, env_state: Any, env_params: Any) -> Any:
        """What the loop keeps of ``obs``, the (batched) environment's observation that goes
        with ``env_state`` (as a reset or step returns them)."""
        seen = self.observe(obs)
        return (seen, envs.global_state(env_state, env_params)) if self.reads_global_state else seen

    def final_observation(self, info: dict[str, Any]) -> Any:
        """What the loop keeps of the observation a step reached before any auto-reset (its
        ``info["final_observation"]`` and ``info["final_global_state"]``), to bootstrap from."""
        seen = self.observe(info["final_observation"])
        return (seen, info["final_global_state"]) if self.reads_global_state else seen


def stack_agents(per_agent: dict[str, Any], agents: list[str]) -> Any:
    """A dict ``{agent: x [batch, ...]}`` as one array ``[batch, agents, ...]`` (in ``agents`` order)."""
    return jnp.stack([per_agent[agent] for agent in agents], axis=1)


def unstack_agents(stacked: Any, agents: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The inverse of :func:`stack_agents`: ``[batch, agents, ...]`` as ``{agent: [batch, ...]}``."""
    return {agent: stacked[:, i] for i, agent in enumerate(agents)}


def with_agent_ids(state: jax.Array, agents: int) -> jax.Array:
    """A critic input per agent ``[..., agents, state_dim + agents]`` from one state of all
    of them ``[..., state_dim]``: the state, then the agent's one-hot id (so that a critic
    shared by the agents can predict each one's own rewards)."""
    *batch, state_dim = state.shape
    everyone = jnp.broadcast_to(state[..., None, :], (*batch, agents, state_dim))
    identity = jnp.broadcast_to(jnp.eye(agents, dtype=state.dtype), (*batch, agents, agents))
    return jnp.concatenate([everyone, identity], axis=-1)


def concatenated_observations(obs: jax.Array) -> jax.Array:
    """MAPPO's critic input ``[..., agents, agents * obs_dim + agents]`` from stacked
    observations ``[..., agents, obs_dim]`` of an environment without a global state: all
    observations plus a one-hot agent id."""
    *batch, agents, obs_dim = obs.shape
    return with_agent_ids(obs.reshape(*batch, agents * obs_dim), agents)


def multi_agent_view(
    agents: list[str], *, centralised_critic: bool, action_masks: bool = False, global_state: bool = False
) -> AgentView:
    """The view of a multi-agent environment: observations, rewards, actions and each agent's
    own ``terminated`` stacked along an agent axis (``[N, agents, ...]``; ``truncated`` is the
    episode's). The critic sees the agent's own observation (IPPO) or, centralised (MAPPO), the
    environment's global state where it offers one (``global_state``; ``ember.envs.multi_agent``)
    with :func:`with_agent_ids`, otherwise :func:`concatenated_observations`. With
    ``action_masks`` the policy acts under the environment's ``action_masks``."""
    reads_global_state = centralised_critic and global_state
    if reads_global_state:  # the loop keeps (observations, global state) pairs

        def actor_input(seen):
            return seen[0]

        def critic_input(seen):
            return with_agent_ids(seen[1], len(agents))
    else:

        def actor_input(seen):
            return seen

        critic_input = concatenated_observations if centralised_critic else actor_input

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
        policy_inputs=lambda seen: (actor_input(seen), critic_input(seen)),
        value_inputs=lambda seen: (critic_input(seen),),
        legal_actions=legal_actions if action_masks else None,
        reads_global_state=reads_global_state,
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


__all__ = [
    "AgentView",
    "concatenated_observations",
    "multi_agent_view",
    "shared_action_head",
    "stack_agents",
    "unstack_agents",
    "with_agent_ids",
]

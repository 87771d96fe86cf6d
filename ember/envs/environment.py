"""The single-agent environment contract (DESIGN.md section 5; the gymnax 1.0 contract).

    env, params = ember.envs.make("CartPole-v1")
    obs, state = env.reset(key, params)
    obs, state, reward, terminated, truncated, info = env.step(key, state, action, params)

Everything is a pure function of explicit pytrees, so ``jit``, ``vmap`` and ``lax.scan``
apply directly.

``step`` semantics (stable; algorithms rely on them):
  * **Auto-reset**: when the transition ends the episode (``terminated | truncated``), the
    returned ``obs`` and ``state`` are those of a fresh episode, and
    ``info["final_observation"]`` holds the observation the transition reached (before the
    reset). When the episode goes on, ``info["final_observation"]`` equals ``obs``. So a
    value target bootstraps from ``final_observation`` on truncation and not at all on
    termination.
  * ``reward``, ``terminated`` and ``truncated`` belong to the transition just taken.
  * ``terminated``: the MDP reached a terminal state. ``truncated``: the time limit
    ``params.max_steps_in_episode`` was reached (``state.time`` counts steps, incremented
    here). As in gymnasium's ``TimeLimit``, both can be true on the same step.
  * An action of the wrong shape or dtype (a float for a discrete action, a batch where one
    action is due) raises ``ValueError`` naming the argument: ``action_space(params).check``.
  * Actions go through ``action_space(params).clip`` first: an out-of-range discrete action
    is clipped to the nearest valid one; a continuous action is clipped to its bounds and a
    NaN entry becomes the bounds' midpoint. Wrap the environment in
    ``ember.envs.wrappers.CheckActions`` to get a ``checkify`` error instead.

Randomness: an environment consumes a fixed number of uint32 words per reset and per
transition (see ``ember.envs.noise``). ``reset``/``step`` draw them from the key;
``reset_from_noise``/``step_from_noise`` take them directly, which is what
``ember.envs.BatchedEnv`` uses to draw a whole batch's words in one call.

Subclasses implement ``default_params``, ``reset_env``, ``step_env``, the two spaces and
``render``, and set ``reset_noise_words`` / ``transition_noise_words``; ``carry_over`` (what
an auto-reset keeps from the ended episode: nothing by default) is optional.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from ember.envs import noise as noise_lib
from ember.envs.spaces import Space


@struct.dataclass
class EnvState:
    """Base of every environment state. ``time``: steps taken in the current episode
    (int32 scalar). Subclasses add their own fields (all pytree leaves)."""

    time: jax.Array


@struct.dataclass
class EnvParams:
    """Base of every environment's parameters. Subclasses add fields, all with defaults;
    fields that fix array shapes are declared ``struct.field(pytree_node=False)``."""

    max_steps_in_episode: int = 500


def select_tree(condition: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``jnp.where(condition, a, b)`` leaf by leaf over two pytrees of the same structure
    (``condition`` is a scalar, or broadcasts against every leaf)."""
    return jax.tree.map(lambda a, b: jnp.where(condition, a, b), on_true, on_false)


class Environment:
    """A single-agent environment. See the module docstring for the contract."""

    #: uint32 words consumed by one ``reset_env``.
    reset_noise_words: int = 0
    #: uint32 words consumed by one ``step_env`` (not counting the auto-reset).
    transition_noise_words: int = 0

    # --- the public contract -------------------------------------------------------
    @property
    def default_params(self) -> EnvParams:
        raise NotImplementedError

    @property
    def reset_noise_shape(self) -> tuple[int, ...]:
        """Shape of the uint32 words ``reset_from_noise`` takes."""
        return (self.reset_noise_words,)

    @property
    def step_noise_shape(self) -> tuple[int, ...]:
        """Shape of the uint32 words ``step_from_noise`` takes (transition + auto-reset)."""
        return (self.transition_noise_words + self.reset_noise_words,)

    def reset(self, key: jax.Array, params: EnvParams | None = None) -> tuple[Any, EnvState]:
        """``(obs, state)`` of a new episode."""
        return self.reset_from_noise(self.draw_noise(key, self.reset_noise_shape), self._params(params))

    def step(self, key: jax.Array, state: EnvState, action: Any, params: EnvParams | None = None):
        """``(obs, state, reward, terminated, truncated, info)``; auto-resets (module docstring)."""
        return self.step_from_noise(self.draw_noise(key, self.step_noise_shape), state, action, self._params(params))

    def draw_noise(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """The uint32 words ``reset``/``step`` pass on (``BatchedEnv`` draws them in one call)."""
        return noise_lib.draw(key, shape)

    def reset_from_noise(self, noise: jax.Array, params: EnvParams) -> tuple[Any, EnvState]:
        """``reset`` with its random words given: ``noise`` is uint32 ``reset_noise_shape``."""
        return self.reset_env(noise, params)

    def step_from_noise(self, noise: jax.Array, state: EnvState, action: Any, params: EnvParams):
        """``step`` with its random words given: ``noise`` is uint32 ``step_noise_shape``
        (the transition's words first, then the auto-reset's)."""
        transition_noise = noise[: self.transition_noise_words]
        reset_noise = noise[self.transition_noise_words :]
        space = self.action_space(params)
        space.check(action, f"{type(self).__name__}.step: action")
        action = space.clip(action)
        obs, next_state, reward, terminated, info = self.step_env(transition_noise, state, action, params)
        next_state = next_state.replace(time=state.time + 1)
        truncated = next_state.time >= params.max_steps_in_episode
        reset_obs, reset_state = self.reset_env(reset_noise, params)
        reset_state = self.carry_over(next_state, reset_state)
        done = self.episode_terminated(terminated) | truncated
        info = {**info, "final_observation": obs, **self.final_info(next_state, params)}
        reward, terminated, truncated = self.transition_outputs(reward, terminated, truncated)
        return (
            select_tree(done, reset_obs, obs),
            select_tree(done, reset_state, next_state),
            reward,
            terminated,
            truncated,
            info,
        )

    def final_info(self, next_state: EnvState, params: EnvParams) -> dict[str, Any]:
        """What ``step`` adds to ``info`` about the state the transition reached, kept past an
        auto-reset as ``info["final_observation"]`` is: nothing here; a multi-agent environment
        with a global state adds ``"final_global_state"`` (``ember.envs.multi_agent``)."""
        return {}

    def episode_terminated(self, terminated: Any) -> jax.Array:
        """The episode's termination (bool scalar) from ``step_env``'s ``terminated``;
        multi-agent environments override this to read it from per-agent flags."""
        return jnp.asarray(terminated, jnp.bool_)

    def transition_outputs(self, reward: Any, terminated: Any, truncated: jax.Array):
        """How ``step`` returns the transition's reward and its end flags, from ``step_env``'s
        reward and ``terminated`` and the time limit's (scalar) ``truncated``; multi-agent
        environments override this to give per-agent dicts."""
        return jnp.asarray(reward), self.episode_terminated(terminated), truncated

    def observation_space(self, params: EnvParams) -> Space:
        raise NotImplementedError

    def action_space(self, params: EnvParams) -> Space:
        raise NotImplementedError

    def render(self, state: EnvState, params: EnvParams) -> jax.Array:
        """An RGB picture of ``state``: uint8 ``[height, width, 3]``."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        return type(self).__name__

    # --- what subclasses implement --------------------------------------------------
    def reset_env(self, noise: jax.Array, params: EnvParams) -> tuple[Any, EnvState]:
        """``(obs, state)`` of a new episode from ``noise`` (uint32 ``[reset_noise_words]``)."""
        raise NotImplementedError

    def carry_over(self, state: EnvState, reset_state: EnvState) -> EnvState:
        """The state an auto-reset in ``step`` starts the next episode from, given the ended
        episode's last ``state`` and ``reset_env``'s ``reset_state``: ``reset_state`` itself,
        unless the environment keeps something across episodes (MinAtar's last action)."""
        return reset_state

    def step_env(self, noise: jax.Array, state: EnvState, action: Any, params: EnvParams):
        """One transition without time limit or reset: ``(obs, next_state, reward,
        terminated, info)``. ``action`` is already clipped into the action space;
        ``noise`` is uint32 ``[transition_noise_words]``; ``state.time`` is advanced by
        the caller."""
        raise NotImplementedError

    def _params(self, params: EnvParams | None) -> EnvParams:
        return self.default_params if params is None else params

    def __repr__(self) -> str:
        return f"{self.name}()"


__all__ = ["EnvParams", "EnvState", "Environment", "select_tree"]

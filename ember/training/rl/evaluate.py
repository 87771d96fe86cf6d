"""Evaluation: run a policy for N whole episodes in parallel, jitted.

    act = make_act(policy, params)   # ppo.make_act, dqn.make_act, ...: obs [N, ...] -> actions [N, ...]
    returns, lengths = evaluate(act, env, env_params, key, num_episodes=100)
    frames = record(act, env, env_params, key)   # one episode's pictures [time, H, W, 3]

Each of the ``num_episodes`` environments runs exactly one episode: the scan lasts as long
as the longest time limit of ``env`` (``env_params.max_steps_in_episode``, or a longer
``TimeLimit`` wrapper's: ``ember.envs.wrappers.max_episode_steps``), so every episode ends
by then, and a sub-environment stops counting reward once its first episode has ended
(auto-reset starts a second one, which is ignored). For multi-agent environments (reward
dicts) the return is the mean over agents of their returns, and an episode ends with
``terminated/truncated["__all__"]``; where its agents act under masks
(``ember.envs.multi_agent.masks_actions``), ``act`` is called as
``act(obs, key, legal_actions=masks)`` with the environment's ``action_masks`` of the state
that goes with ``obs`` (the ``make_act`` of IPPO/MAPPO take them; a plain callable must too).

Every call runs through one module-level jitted program, compiled once per policy
architecture: ``act`` is split like a pytree (Equinox's ``filter_jit``), its array leaves
(parameters, observation statistics) are traced arguments, and the rest (the network, flags,
a plain function) is static. The ``make_act`` of every algorithm returns such a pytree, so
evaluating new parameters of the same network -- several seeds, a trained and an untrained
policy -- compiles once for a given ``env`` object, ``num_episodes`` and episode cap
(``env_params`` are traced too). A plain closure ``act`` works as well, but is static as a
whole: each new closure compiles again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ember.envs.batched import BatchedEnv
from ember.envs.multi_agent import episode_over, masks_actions
from ember.envs.wrappers import max_episode_steps


def evaluate(
    act: Callable[[Any, jax.Array], Any],
    env,
    env_params,
    key: jax.Array,
    num_episodes: int,
    *,
    max_steps: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Undiscounted returns and lengths of ``num_episodes`` episodes.

    Args:
      act: ``act(obs, key) -> env_action`` for a batch ``[num_episodes, ...]`` of observations:
        an algorithm's ``make_act`` (a pytree; new parameters reuse the compiled program) or
        any callable (static: a new one compiles again).
      env, env_params: an Ember environment and its parameters (concrete: the episode cap is
        read from ``env_params.max_steps_in_episode`` and the ``TimeLimit`` wrappers of
        ``env``, see ``max_episode_steps``, before ``env_params`` enter the compiled program
        as traced values).
      key: PRNG key for resets, the environment and ``act``.
      num_episodes: how many episodes (run side by side).
      max_steps: overrides the episode cap (for environments without a time limit).

    Returns:
      ``(returns, lengths)``: float32 ``[num_episodes]`` and int32 ``[num_episodes]``.
    """
    if not isinstance(num_episodes, int) or num_episodes < 1:
        raise ValueError(f"num_episodes must be a positive integer, got {num_episodes!r}")
    steps = max_episode_steps(env, env_params) if max_steps is None else int(max_steps)
    if steps < 1:
        raise ValueError(f"max_steps must be a positive integer, got {steps}")
    arrays, static = _split_arrays(act)
    return _run(arrays, static, _static_leaf(env), env_params, key, num_episodes=num_episodes, steps=steps)


@functools.partial(jax.jit, static_argnames=("static", "env", "num_episodes", "steps"))
def _run(arrays: list, static: _Static, env, env_params, key: jax.Array, *, num_episodes: int, steps: int):
    """:func:`evaluate`'s program: ``act`` rebuilt from its array leaves (traced) and the rest."""
    act = static.combine(arrays)
    envs = BatchedEnv(_ByIdentity.unwrap(env), num_episodes)
    reset_key, key = jax.random.split(key)
    obs, state = envs.reset(reset_key, env_params)

    def step(carry, key):
        obs, state, running, returns, lengths = carry
        act_key, env_key = jax.random.split(key)
        action = act(obs, act_key, **_legal_actions(envs, state, env_params))
        obs, state, reward, terminated, truncated, _ = envs.step(env_key, state, action, env_params)
        if isinstance(reward, dict):  # multi-agent: the mean over agents of their returns
            reward = jnp.stack(list(reward.values())).mean(axis=0)
        returns = returns + jnp.where(running, reward.astype(jnp.float32), 0.0)
        lengths = lengths + running.astype(jnp.int32)
        running = running & ~episode_over(terminated, truncated)
        return (obs, state, running, returns, lengths), None

    init = (obs, state, jnp.ones(num_episodes, bool), jnp.zeros(num_episodes), jnp.zeros(num_episodes, jnp.int32))
    (_, _, _, returns, lengths), _ = jax.lax.scan(step, init, jax.random.split(key, steps))
    return returns, lengths


def record(act: Callable[[Any, jax.Array], Any], env, env_params, key: jax.Array) -> np.ndarray:
    """Frames ``[time, height, width, 3]`` (uint8) of one episode of ``act`` on ``env``, from
    the first observation to the last state before the episode ended (``env.render`` of each
    state). ``act`` takes a batch of one observation, as for :func:`evaluate`, and is compiled
    the same way: new parameters of the same network reuse the program."""
    steps = max_episode_steps(env, env_params)
    arrays, static = _split_arrays(act)
    frames, shown = _record(arrays, static, _static_leaf(env), env_params, key, steps=steps)
    return np.asarray(frames)[np.asarray(shown)]


@functools.partial(jax.jit, static_argnames=("static", "env", "steps"))
def _record(arrays: list, static: _Static, env, env_params, key: jax.Array, *, steps: int):
    """:func:`record`'s program: ``(frames [steps, H, W, 3], shown [steps])``."""
    act, env = static.combine(arrays), _ByIdentity.unwrap(env)
    reset_key, key = jax.random.split(key)
    obs, state = env.reset(reset_key, env_params)

    def step(carry, key):
        obs, state, running = carry
        act_key, env_key = jax.random.split(key)
        frame = env.render(state, env_params)
        masks = jax.tree.map(lambda m: m[None], _legal_actions(env, state, env_params))
        action = jax.tree.map(lambda a: a[0], act(jax.tree.map(lambda o: o[None], obs), act_key, **masks))
        obs, state, _, terminated, truncated, _ = env.step(env_key, state, action, env_params)
        return (obs, state, running & ~episode_over(terminated, truncated)), (frame, running)

    _, (frames, shown) = jax.lax.scan(step, (obs, state, True), jax.random.split(key, steps))
    return frames, shown


def _legal_actions(env, state, env_params) -> dict[str, Any]:
    """``act``'s keyword argument ``legal_actions`` (the masks of ``state``) where ``env``'s
    agents act under masks; none otherwise, so ``act(obs, key)`` is called as ever."""
    return {"legal_actions": env.action_masks(state, env_params)} if masks_actions(env) else {}


def _is_array(leaf: Any) -> bool:
    """Whether ``leaf`` is a traced argument of :func:`_run` (as Equinox's ``is_array``)."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


@dataclasses.dataclass(frozen=True)
class _Static:
    """The non-array part of a pytree, hashable (a static argument of ``jax.jit``): its
    treedef and its other leaves, ``None`` where an array leaf was."""

    treedef: Any
    leaves: tuple

    def combine(self, arrays: list) -> Any:
        """The pytree again, with ``arrays`` in the places of its array leaves."""
        arrays = iter(arrays)
        leaves = [next(arrays) if leaf is None else _ByIdentity.unwrap(leaf) for leaf in self.leaves]
        return jax.tree.unflatten(self.treedef, leaves)


@dataclasses.dataclass(frozen=True, eq=False)
class _ByIdentity:
    """An unhashable leaf (a mutable callable object, say), static by identity."""

    value: Any

    def __eq__(self, other):
        return isinstance(other, _ByIdentity) and other.value is self.value

    def __hash__(self):
        return id(self.value)

    @staticmethod
    def unwrap(leaf: Any) -> Any:
        return leaf.value if isinstance(leaf, _ByIdentity) else leaf


def _static_leaf(leaf: Any) -> Any:
    """``leaf`` as a static argument of ``jax.jit``: itself if hashable, else by identity."""
    try:
        hash(leaf)
    except TypeError:
        return _ByIdentity(leaf)
    return leaf


def _split_arrays(tree: Any) -> tuple[list, _Static]:
    """``(array leaves, the rest)`` of ``tree``; ``_Static.combine`` puts them together again.
    (A treedef hashes its structure only and compares the static fields of its nodes with
    ``==``, so those need not be hashable.)"""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [leaf for leaf in leaves if _is_array(leaf)]
    return arrays, _Static(treedef, tuple(None if _is_array(leaf) else _static_leaf(leaf) for leaf in leaves))


__all__ = ["evaluate", "record"]

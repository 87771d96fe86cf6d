"""The environment registry: ``make(id, **overrides) -> (env, params)``, ``register``, ``registered``.

Built-in environments are registered by import path, so ``import ember.envs`` imports no
environment module until one is made.
"""

from __future__ import annotations

import dataclasses
import importlib
import numbers
from collections.abc import Callable

import jax
import numpy as np

from ember.core.errors import ConfigError
from ember.core.integers import is_integer
from ember.core.registry import Registry
from ember.envs.environment import Environment, EnvParams

EntryPoint = str | Callable[[], Environment]

ENVIRONMENTS: Registry[EntryPoint] = Registry("environment")

#: The largest ``max_steps_in_episode``: ``EnvState.time`` counts steps in int32.
MAX_EPISODE_STEPS = np.iinfo(np.int32).max

_BUILTIN = {
    "CartPole-v1": "ember.envs.classic_control.cartpole:CartPole",
    "Pendulum-v1": "ember.envs.classic_control.pendulum:Pendulum",
    "MountainCar-v0": "ember.envs.classic_control.mountain_car:MountainCar",
    "MountainCarContinuous-v0": "ember.envs.classic_control.mountain_car:MountainCarContinuous",
    "Acrobot-v1": "ember.envs.classic_control.acrobot:Acrobot",
    "Asterix-MinAtar": "ember.envs.minatar.asterix:AsterixMinAtar",
    "Breakout-MinAtar": "ember.envs.minatar.breakout:BreakoutMinAtar",
    "Freeway-MinAtar": "ember.envs.minatar.freeway:FreewayMinAtar",
    "Seaquest-MinAtar": "ember.envs.minatar.seaquest:SeaquestMinAtar",
    "SpaceInvaders-MinAtar": "ember.envs.minatar.space_invaders:SpaceInvadersMinAtar",
    "KeyDoorMaze-v0": "ember.envs.maze:KeyDoorMaze",
    "MPE-simple_spread": "ember.envs.mpe.simple_spread:SimpleSpread",
    "MPE-simple_tag": "ember.envs.mpe.simple_tag:SimpleTag",
    "MPE-simple_push": "ember.envs.mpe.simple_push:SimplePush",
    "MPE-simple_adversary": "ember.envs.mpe.simple_adversary:SimpleAdversary",
    "MPE-simple_speaker_listener": "ember.envs.mpe.simple_speaker_listener:SimpleSpeakerListener",
    "MPE-simple_reference": "ember.envs.mpe.simple_reference:SimpleReference",
    # Continuous actions (JaxMARL's): Box(0, 1, (5,)) per moving agent, force accel * (a2 - a1, a4 - a3).
    "MPE-simple_spread-continuous": "ember.envs.mpe.simple_spread:SimpleSpreadContinuous",
    "MPE-simple_tag-continuous": "ember.envs.mpe.simple_tag:SimpleTagContinuous",
    "MPE-simple_push-continuous": "ember.envs.mpe.simple_push:SimplePushContinuous",
    "MPE-simple_adversary-continuous": "ember.envs.mpe.simple_adversary:SimpleAdversaryContinuous",
    "MPE-simple_speaker_listener-continuous": "ember.envs.mpe.simple_speaker_listener:SimpleSpeakerListenerContinuous",
    "MPE-simple_reference-continuous": "ember.envs.mpe.simple_reference:SimpleReferenceContinuous",
}


def register(env_id: str, entry_point: EntryPoint, *, overwrite: bool = False) -> None:
    """Registers ``entry_point`` (a zero-argument callable returning an ``Environment``, or
    a ``"module:attribute"`` string naming one) under ``env_id``."""
    if not (callable(entry_point) or (isinstance(entry_point, str) and ":" in entry_point)):
        raise ValueError(f"entry_point must be a callable or a 'module:attribute' string, got {entry_point!r}")
    ENVIRONMENTS.register(env_id, entry_point, overwrite=overwrite)


def registered() -> list[str]:
    """Every registered environment id, sorted."""
    return ENVIRONMENTS.names()


def make(env_id: str, **overrides) -> tuple[Environment, EnvParams]:
    """``(env, params)`` for ``env_id``; ``overrides`` replace fields of the default params
    (``make("CartPole-v1", max_steps_in_episode=200)``).

    Raises:
      UnknownNameError: unknown ``env_id`` (the message lists the closest ids).
      ConfigError: an override names no field of the environment's params, or gives one a value
        of the wrong kind or range (``key``: its name; see ``with_overrides``).
    """
    entry_point = ENVIRONMENTS.get(env_id)
    if isinstance(entry_point, str):
        module_name, attribute = entry_point.split(":")
        entry_point = getattr(importlib.import_module(module_name), attribute)
    env = entry_point()
    return env, with_overrides(env.default_params, overrides, env_id)


def with_overrides(params: EnvParams, overrides: dict, env_id: str) -> EnvParams:
    """``params`` with the fields named in ``overrides`` replaced; ``ConfigError`` (``key``:
    the field's name) for a name that is not a field (the first unknown one), a value of the
    wrong kind for its field (a string, or a float where the default is an int) and a
    ``max_steps_in_episode`` below 1. A field whose default is a Python bool, int or float takes
    a value of that kind (an int where a float is due becomes a float) or an array of a matching
    dtype (parameters vmapped over), except a static field (``pytree_node=False``: it fixes
    shapes), which takes one value; other fields take any value."""
    fields = sorted(field.name for field in dataclasses.fields(params))
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(
            f"{env_id}: unknown parameter(s) {unknown}; {type(params).__name__} has {fields}", key=unknown[0]
        )
    checked = {name: _checked_value(env_id, name, value, getattr(params, name)) for name, value in overrides.items()}
    static = {field.name for field in dataclasses.fields(params) if not field.metadata.get("pytree_node", True)}
    for name in sorted(static & set(checked)):
        if isinstance(checked[name], (np.ndarray, jax.Array)):  # unhashable, and it fixes shapes: one value
            raise ConfigError(
                f"{env_id}: parameter {name} fixes the spaces' shapes (a static field) and takes one value, "
                f"not an array; got {checked[name]!r}",
                key=name,
            )
    return params.replace(**checked)


def _checked_value(env_id: str, name: str, value, default):
    """``value`` for the field ``name`` whose default is ``default`` (see ``with_overrides``)."""
    if isinstance(default, bool):
        kind, fits = "bool", isinstance(value, (bool, np.bool_))
    elif is_integer(default):
        kind, fits = "int", is_integer(value)
    elif isinstance(default, float):
        kind, fits = "float", isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
        if fits and not isinstance(value, np.floating):
            value = float(value)
    else:
        return value
    if not fits and hasattr(value, "dtype"):  # an array: its dtype must match the field's kind
        wanted = {"bool": np.bool_, "int": np.integer, "float": np.number}[kind]
        fits = np.issubdtype(value.dtype, wanted)
    if not fits:
        raise ConfigError(
            f"{env_id}: parameter {name} expects {kind} (default {default!r}), got {value!r} ({type(value).__name__})",
            key=name,
        )
    if name == "max_steps_in_episode" and is_integer(value) and not 1 <= value <= MAX_EPISODE_STEPS:
        # Compared with the int32 step counter: a larger Python int overflows at the first step.
        raise ConfigError(
            f"{env_id}: parameter {name} must be a positive integer of at most {MAX_EPISODE_STEPS} (int32), "
            f"got {value}",
            key=name,
        )
    return value


for _env_id, _entry_point in _BUILTIN.items():
    register(_env_id, _entry_point)

__all__ = ["ENVIRONMENTS", "make", "register", "registered", "with_overrides"]

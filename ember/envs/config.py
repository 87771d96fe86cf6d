"""An environment described by a config section (``env:`` of an RL config), and the
``(env, params)`` it names.

    env: {id: CartPole-v1, params: {max_steps_in_episode: 200}}
    env: {id: CartPole-v1, source: gymnax}
    env: {id: MPE_simple_spread_v3, source: jaxmarl}
    env: {id: HeuristicEnemySMAX, source: jaxmarl, kwargs: {scenario: 3m}}

    env, env_params = make_from_config(EnvConfig(id="CartPole-v1"))
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ember.core.errors import ConfigError, UnknownNameError
from ember.envs.environment import Environment, EnvParams
from ember.envs.registry import ENVIRONMENTS, make, with_overrides
from ember.envs.wrappers import FlattenObservation

ENV_SOURCES = ("ember", "gymnax", "jaxmarl")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Which environment: ``id`` in the ``source`` library and overrides of its default
    parameters (``params: {max_steps_in_episode: 200}``). ``source: ember`` (the default)
    uses ``ember.envs.make``; ``gymnax`` runs ``gymnax.make(id)`` and ``jaxmarl`` runs
    ``jaxmarl.make(id)`` through Ember's adapters.
    ``kwargs`` are the library's constructor arguments (``jaxmarl.make(id, **kwargs)``; for
    ``source: jaxmarl`` a ``scenario`` named by a string is JaxMARL's SMAX map of that name,
    ``map_name_to_scenario``: ``3m``, ``2s3z``, ...); Ember environments take ``params`` only.
    ``flatten_observation`` wraps the env in ``ember.envs.wrappers.FlattenObservation``
    (for pytree observations such as the maze's ``{view, has_key}``).

    An Ember ``id`` and its ``params`` names are checked when the config is built (an
    unknown one is a ``ConfigError`` keyed ``id`` or ``params.NAME``); those of the other
    sources when the environment is made, since that imports their library."""

    id: str = "CartPole-v1"
    source: str = "ember"
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    flatten_observation: bool = False

    def __post_init__(self):
        if self.source not in ENV_SOURCES:
            raise ConfigError(f"source must be one of {', '.join(ENV_SOURCES)}, got {self.source!r}", key="source")
        if self.kwargs and self.source == "ember":
            raise ConfigError(
                "kwargs are constructor arguments of a gymnax or JaxMARL environment; an Ember environment "
                "takes params",
                key="kwargs",
            )
        if self.source == "ember":
            make_from_config(self)


def make_from_config(config: EnvConfig) -> tuple[Environment, EnvParams]:
    """``(env, env_params)`` of an :class:`EnvConfig`. Equal configs get the same ``env``
    object: programs compiled for an environment (``ember.training.rl.evaluate``'s, keyed by
    the object) are then reused by later calls, e.g. a second ``evaluate_params`` in a notebook.

    Raises:
      ConfigError: an unknown Ember ``id`` (key ``id``, with the closest ids) or parameter
        name (key ``params.NAME``); a JaxMARL ``params.max_steps_in_episode`` above the
        environment's own ``max_steps``; ``flatten_observation`` for a multi-agent environment.
    """
    # JaxMARL's time limit is the adapter's (an argument, not a parameter), so part of the object.
    time_limit = config.params.get("max_steps_in_episode") if config.source == "jaxmarl" else None
    if not isinstance(time_limit, (int, type(None))):
        raise ConfigError(
            f"params.max_steps_in_episode must be an integer, got {time_limit!r}", key="params.max_steps_in_episode"
        )
    # An Ember id's entry point is part of the key: register(..., overwrite=True) makes a new object.
    entry_point = None
    if config.source == "ember":
        try:
            entry_point = ENVIRONMENTS.get(config.id)
        except UnknownNameError as error:
            raise ConfigError(f"id: {error}", key="id") from None
    kwargs = tuple(sorted((name, _hashable(value)) for name, value in config.kwargs.items()))
    env = _environment(config.source, config.id, entry_point, time_limit, config.flatten_observation, kwargs)
    try:
        env_params = with_overrides(env.default_params, dict(config.params), config.id)
    except ConfigError as error:
        raise ConfigError(f"params.{error.key}: {error}", key=f"params.{error.key}") from None
    return env, env_params


def _hashable(value: Any) -> Any:
    """A config value as a key of ``_environment``'s cache (YAML lists as tuples)."""
    return tuple(_hashable(item) for item in value) if isinstance(value, (list, tuple)) else value


@functools.cache
def _environment(
    source: str,
    env_id: str,
    entry_point: Any,
    time_limit: int | None,
    flatten_observation: bool,
    kwargs: tuple[tuple[str, Any], ...] = (),
) -> Environment:
    """The environment object of a config (made once per distinct arguments; environments hold
    no state, everything they change is in the ``state`` pytree)."""
    # The library first: its ConfigError when it is missing, before the adapters import gymnasium.
    if source == "gymnax":
        library_env = _make_in_library(source, env_id, dict(kwargs))
        from ember.envs.adapters import GymnaxEnv

        env = GymnaxEnv(*library_env)
    elif source == "jaxmarl":
        library_env = _make_in_library(source, env_id, dict(kwargs))
        from ember.envs.adapters.jaxmarl import JaxMARLEnv, UnsupportedEnvironment

        try:  # the adapter's time limit may only shorten the environment's own
            env = JaxMARLEnv(library_env, max_steps=time_limit)
        except UnsupportedEnvironment as error:
            raise ConfigError(f"id: {error}", key="id") from None
        except ValueError as error:
            raise ConfigError(f"params.max_steps_in_episode: {error}", key="params.max_steps_in_episode") from None
    else:
        env, _ = make(env_id)
    if flatten_observation:
        try:
            env = FlattenObservation(env)
        except ValueError as error:  # a multi-agent environment
            raise ConfigError(f"flatten_observation: {error}", key="flatten_observation") from None
    return env


def _make_in_library(source: str, env_id: str, kwargs: dict[str, Any]) -> Any:
    """``gymnax.make(env_id, **kwargs)`` or ``jaxmarl.make(env_id, **kwargs)``; ``ConfigError``
    when the library is not installed (key ``source``), does not know ``env_id`` (key ``id``)
    or refuses ``kwargs`` (key ``kwargs``)."""
    import importlib

    try:
        library = importlib.import_module(source)
    except ImportError:
        raise ConfigError(f"source: {source} is not installed (pip install {source})", key="source") from None
    if source == "jaxmarl" and isinstance(kwargs.get("scenario"), str):
        from jaxmarl.environments.smax import map_name_to_scenario

        try:
            kwargs = {**kwargs, "scenario": map_name_to_scenario(kwargs["scenario"])}
        except KeyError:
            raise ConfigError(
                f"kwargs.scenario: JaxMARL has no SMAX scenario {kwargs['scenario']!r}", key="kwargs.scenario"
            ) from None
    try:
        return library.make(env_id, **kwargs)
    except (KeyError, ValueError) as error:  # how both libraries refuse an unknown id
        raise ConfigError(f"id: {source} cannot make {env_id!r}: {error}", key="id") from None
    except TypeError as error:  # a constructor argument the environment does not take
        raise ConfigError(f"kwargs: {source} cannot make {env_id!r} with {kwargs}: {error}", key="kwargs") from None


__all__ = ["ENV_SOURCES", "EnvConfig", "make_from_config"]

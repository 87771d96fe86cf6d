"""Typed configs: frozen dataclass schemas filled from YAML files and ``key=value`` overrides.

OmegaConf does the parsing and merging; this module adds what users need on top of it:
errors that name the exact key path (with the valid keys and the closest match for an
unknown key, the expected type for a wrong one), ``base:`` inheritance between YAML files,
and an exact YAML round trip.

    @dataclasses.dataclass(frozen=True)
    class TrainConfig:
        steps: int = 100
        lr: float = 3e-4

    @dataclasses.dataclass(frozen=True)
    class ExperimentConfig:
        run_dir: str = "runs/default"
        train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    config = load_config(ExperimentConfig, "configs/exp.yaml", ["train.steps=20"])

A YAML file may start with ``base: other.yaml`` (a path relative to the file): the base is
loaded first (recursively) and the file's keys override it. A section may do the same for
itself — ``model: {base: ../models/tiny.yaml, num_layers: 4}`` fills ``model`` from that file
(whose keys are the section's keys) and then applies ``num_layers``. Later sources override
earlier ones: schema defaults, then the base chain, then the file, then the overrides.

A path a config names as a value (a dataset directory, a base model, a prompts file), whether on
the command line or in a YAML file, is relative to the current directory of the command that
loads it (only ``base:`` is relative to its file); the schemas make such values absolute on load
(:func:`absolute_path`), so the config a run saves still names them from any other directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf import errors as omegaconf_errors

from ember.core.errors import ConfigError
from ember.core.integers import is_integer

T = TypeVar("T")

BASE_KEY = "base"
_OVERRIDE_PATTERN = re.compile(r"^(?P<key>[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*)=(?P<value>.*)$", re.S)
_OVERRIDE_FORM = "key.sub=value (for example train.steps=100 or optim.lr=3e-4)"


def load_config(
    schema: type[T],
    source: str | Path | Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
) -> T:
    """Builds a ``schema`` instance from defaults, a YAML file or mapping, and overrides.

    Args:
      schema: a (frozen) dataclass type; nested dataclass fields become nested sections.
      source: a YAML file path, a mapping of values, or ``None`` for defaults only.
      overrides: command-line style ``key.sub=value`` strings, applied last.

    Returns:
      An instance of ``schema``.

    Raises:
      ConfigError: naming the key path for unknown keys, wrong types, malformed overrides,
        missing required values and invalid values rejected by the schema itself.
    """
    _require_dataclass(schema)
    layers: list[tuple[str, DictConfig]] = []
    if isinstance(source, (str, Path)):
        layers.extend(_load_yaml_chain(Path(source)))
    elif isinstance(source, Mapping):
        layers.append(("the given mapping", _as_dictconfig(dict(source), "the given mapping")))
    elif source is not None:
        raise ConfigError(f"config source must be a YAML path or a mapping, got {type(source).__name__}")
    if overrides:
        layers.append(("command-line overrides", parse_overrides(overrides)))

    merged = OmegaConf.structured(schema)
    for origin, layer in layers:
        data = OmegaConf.to_container(layer, resolve=False)
        check_keys(schema, data, origin=origin)
        _check_bools(schema, data, origin=origin)
        try:
            merged = OmegaConf.merge(merged, layer)
        except (omegaconf_errors.OmegaConfBaseException, TypeError) as error:  # TypeError: a list for a dict
            raise _translate_error(error, schema, layer, origin) from None
    return _instantiate(schema, merged)


def absolute_path(path: str) -> str:
    """``path``, a path a config field names, made absolute: ``~`` expanded and a relative path
    taken from the current directory, then normalised (symbolic links kept). An empty value and
    OmegaConf's ``???`` (a value still to be given) are returned as they are."""
    if not path or path == MISSING:
        return path
    return os.path.abspath(os.path.expanduser(path))


def read_key(source: str | Path, key: str, overrides: Sequence[str] = (), default: Any = None) -> Any:
    """The value of top-level ``key`` in a YAML file (after ``base:`` files and overrides),
    read without a schema — for choosing the schema, e.g. by a ``kind:`` key."""
    merged = OmegaConf.create({})
    for _, layer in _load_yaml_chain(Path(source)):
        merged = OmegaConf.merge(merged, layer)
    if overrides:
        merged = OmegaConf.merge(merged, parse_overrides(overrides))
    return OmegaConf.to_container(merged, resolve=False).get(key, default)


def run_kind(run_dir: str | Path, default: Any = None) -> Any:
    """The ``kind:`` of the run in Ember run directory ``run_dir`` (read from its ``config.yaml``):
    ``lm``, ``finetune``, ``grpo``, ``linearize``, ``rl``, ``quantized`` ...; ``default`` when the
    directory has no ``config.yaml`` or the file names no kind."""
    path = Path(run_dir) / "config.yaml"
    return read_key(path, "kind", default=default) if path.is_file() else default


def from_yaml(schema: type[T], text: str) -> T:
    """Builds a ``schema`` instance from YAML text (the inverse of :func:`to_yaml`)."""
    data = OmegaConf.create(text)
    if not isinstance(data, DictConfig):
        raise ConfigError("YAML text must hold a mapping of config keys at the top level")
    return load_config(schema, OmegaConf.to_container(data, resolve=False))


def to_yaml(config: Any) -> str:
    """Serialises a config dataclass instance to YAML; ``from_yaml`` gives it back exactly (a
    string holding ``${`` is written escaped, so it is read back as itself, not interpolated)."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"to_yaml expects a config dataclass instance, got {type(config).__name__}")
    return OmegaConf.to_yaml(OmegaConf.create(_escape_interpolations(to_dict(config))))


def to_dict(config: Any) -> dict[str, Any]:
    """A config dataclass instance as nested plain dicts (for JSON and logging); its strings
    as they are (a config instance holds values, never interpolations)."""
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=False)


def _escape_interpolations(value: Any) -> Any:
    """``value`` with every ``${`` in its strings escaped as OmegaConf reads it back literally:
    ``\\${`` (the backslashes just before it doubled, as OmegaConf unescapes those too)."""
    if isinstance(value, str):
        return re.sub(r"(\\*)\$\{", lambda match: match.group(1) * 2 + "\\${", value)
    if isinstance(value, Mapping):
        return {key: _escape_interpolations(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_escape_interpolations(item) for item in value]
    return value


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """Parses ``key.sub=value`` strings into a config tree; values are typed by YAML rules."""
    for item in overrides:
        if not isinstance(item, str) or not _OVERRIDE_PATTERN.match(item):
            raise ConfigError(f"malformed override {item!r}: expected {_OVERRIDE_FORM}")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except omegaconf_errors.OmegaConfBaseException as error:
        raise ConfigError(
            f"could not parse overrides {list(overrides)}: {error.msg}; expected {_OVERRIDE_FORM}"
        ) from None
    except yaml.YAMLError:  # a value YAML cannot read: name the override
        for item in overrides:
            try:
                OmegaConf.from_dotlist([item])
            except yaml.YAMLError as error:
                key, _, value = item.partition("=")
                problem = getattr(error, "problem", None) or str(error).splitlines()[0]
                raise ConfigError(
                    f"override {item!r}: the value {value!r} is not valid YAML ({problem}); a mapping needs "
                    "a space after each colon ({a: 1}), a list its closing bracket, a quote its closing quote",
                    key=key,
                ) from None
        raise


def check_keys(schema: type, data: Any, *, origin: str = "config", prefix: str = "") -> None:
    """Raises ``ConfigError`` for the first key in ``data`` that ``schema`` does not define.

    The message names the full key path, where it came from, the valid keys at that level
    and the closest match.
    """
    if not isinstance(data, Mapping):
        return
    hints = _field_types(schema)
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in hints:
            valid = sorted(hints)
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
            hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown config key '{path}' (from {origin}).{hint} "
                f"Valid keys{' under ' + repr(prefix[:-1]) if prefix else ''}: {', '.join(valid)}",
                key=path,
            )
        nested = _dataclass_type(hints[key])
        if nested is not None and isinstance(value, Mapping):
            check_keys(nested, value, origin=origin, prefix=f"{path}.")


def _check_bools(schema: type, data: Any, *, origin: str, prefix: str = "") -> None:
    """Raises ``ConfigError`` for an integer other than 0 or 1 (or a string holding one) given
    for a bool field: OmegaConf reads any nonzero integer as true, so ``flag=2`` or ``flag=-1``
    would silently turn a feature on. The other spellings OmegaConf takes (true/false, yes/no,
    on/off, y/n, 1/0) stay accepted, and those it refuses it refuses itself."""
    if not isinstance(data, Mapping):
        return
    hints = _field_types(schema)
    for key, value in data.items():
        path, hint = f"{prefix}{key}", hints.get(key)
        nested = _dataclass_type(hint)
        if nested is not None and isinstance(value, Mapping):
            _check_bools(nested, value, origin=origin, prefix=f"{path}.")
        elif _is_bool_hint(hint) and _integer_of(value) not in (None, 0, 1):
            raise _wrong_type(path, origin, _type_name(hint), value)


def _is_bool_hint(hint: Any) -> bool:
    """Whether ``hint`` is ``bool`` or ``bool | None``."""
    return {arg for arg in typing.get_args(hint) or (hint,) if arg is not type(None)} == {bool}


def _integer_of(value: Any) -> int | None:
    """The integer OmegaConf reads in a value for a bool field (an int, or a string ``int()``
    parses), or ``None``."""
    if is_integer(value):
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _wrong_type(key: str, origin: str, expected: str, value: Any) -> ConfigError:
    """The error for a value of the wrong type at ``key``; a bool field's says what it takes."""
    allowed = "; write true or false" if "bool" in expected.split(" or ") else ""
    return ConfigError(
        f"config key '{key}' (from {origin}) expects {expected}, got {value!r} ({type(value).__name__}){allowed}",
        key=key,
    )


def _load_yaml_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[str, DictConfig]]:
    """The layers of a YAML file and its ``base:`` ancestors, base first."""
    path = path.expanduser()
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    resolved = path.resolve()
    if resolved in seen:
        chain = " -> ".join(str(p) for p in (*seen, resolved))
        raise ConfigError(f"'base:' files form a cycle: {chain}")
    try:
        layer = OmegaConf.load(path)
    except Exception as error:  # yaml.YAMLError and OmegaConf's own
        raise ConfigError(f"could not parse YAML file {path}: {error}") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of config keys at the top level")
    layers: list[tuple[str, DictConfig]] = []
    if BASE_KEY in layer:
        base = layer[BASE_KEY]
        if not isinstance(base, str):
            raise ConfigError(f"'base:' in {path} must be a path string, got {base!r}", key=BASE_KEY)
        layers.extend(_load_yaml_chain(path.parent / base, (*seen, resolved)))
        layer = OmegaConf.masked_copy(layer, [k for k in layer if k != BASE_KEY])
    layers.append((str(path), _expand_section_bases(layer, path, (*seen, resolved))))
    return layers


def _expand_section_bases(node: DictConfig, path: Path, seen: tuple[Path, ...]) -> DictConfig:
    """Replaces every nested section holding ``base: FILE`` with FILE's content (itself fully
    resolved) overridden by the section's other keys. ``path`` is the file ``node`` came from."""
    for key in list(node.keys()):
        if OmegaConf.is_missing(node, key):  # ``???``: a value the command line must give
            continue
        value = node[key]
        if not isinstance(value, DictConfig):
            continue
        value = _expand_section_bases(value, path, seen)
        if BASE_KEY in value:
            base = value[BASE_KEY]
            if not isinstance(base, str):
                raise ConfigError(
                    f"'base:' of section '{key}' in {path} must be a path string, got {base!r}", key=f"{key}.base"
                )
            merged = OmegaConf.create({})
            for _, layer in _load_yaml_chain(path.parent / base, seen):
                merged = OmegaConf.merge(merged, layer)
            value = OmegaConf.merge(merged, OmegaConf.masked_copy(value, [k for k in value if k != BASE_KEY]))
        node[key] = value
    return node


def _as_dictconfig(data: dict, origin: str) -> DictConfig:
    try:
        return OmegaConf.create(data)
    except omegaconf_errors.OmegaConfBaseException as error:
        raise ConfigError(f"could not read config from {origin}: {error.msg}") from None


def _instantiate(schema: type[T], merged: DictConfig) -> T:
    try:
        return OmegaConf.to_object(merged)
    except omegaconf_errors.MissingMandatoryValue as error:
        raise ConfigError(f"config key '{error.full_key}' is required but was not set", key=error.full_key) from None
    except Exception as error:  # narrowed below: anything but a validation error propagates unchanged
        invalid = error
        if isinstance(error, omegaconf_errors.OmegaConfBaseException):
            cause = error.__cause__ or error.__context__
            if not isinstance(cause, ValueError):
                raise ConfigError(f"invalid config: {error.msg}", key=getattr(error, "full_key", None)) from None
            invalid = cause
        if not isinstance(invalid, ValueError):  # a schema's own bug, not the user's config
            raise
        raise _in_section(invalid, _failing_section(schema, merged)) from None


def _failing_section(schema: type, node: DictConfig, prefix: str = "") -> str:
    """The dotted path (``"ppo.policy."``, ``""`` for the top level) of the innermost section
    of ``node`` whose own validation (``__post_init__``) fails."""
    for name, hint in _field_types(schema).items():
        nested = _dataclass_type(hint)
        child = node.get(name) if nested is not None else None
        if not isinstance(child, DictConfig):
            continue
        try:
            OmegaConf.to_object(child)
        except Exception:  # this section fails: look inside it
            return _failing_section(nested, child, f"{prefix}{name}.")
    return prefix


def _in_section(error: ValueError, prefix: str) -> ConfigError:
    """``error`` of the section at ``prefix`` as a ``ConfigError`` keyed by its full path.

    A section names its keys relative to itself (``num_envs``) or under its usual name
    (``rope.theta``): the full key is ``prefix`` up to where that name starts, then the key
    (the key alone when it already names the section, as ``optim.schedule.kind`` does); a
    message that opens with the key opens with the full key instead."""
    key = getattr(error, "key", None) if isinstance(error, ConfigError) else None
    if not key:
        message = str(error) if isinstance(error, ConfigError) else f"invalid config: {error}"
        return ConfigError(message, key=prefix[:-1] or None)
    parts = prefix.split(".")[:-1]
    overlap = next((i for i in range(len(parts)) if key.startswith(".".join(parts[i:]) + ".")), len(parts))
    if overlap == len(parts) and parts and parts[-1] in key.split(".")[:-1]:
        overlap = 0  # the key spells the section under a name of its own (``optim.schedule.kind``)
    full_key = ".".join([*parts[:overlap], key])
    message = str(error)
    if message.startswith(key):
        message = full_key + message[len(key) :]
    return ConfigError(message, key=full_key)


def _translate_error(error: Exception, schema: type, layer: DictConfig, origin: str) -> ConfigError:
    key = getattr(error, "full_key", None) or _failing_key(schema, layer) or ""
    expected = _expected_type_at(schema, key)
    value = _value_at(layer, key)
    if isinstance(error, (omegaconf_errors.ValidationError, TypeError)) and expected is not None:
        return _wrong_type(key, origin, expected, value)
    return ConfigError(f"config key '{key}' (from {origin}): {getattr(error, 'msg', error)}", key=key or None)


def _expected_type_at(schema: type, key: str) -> str | None:
    """The declared type of the field at dotted ``key`` (or of the list holding it)."""
    current: Any = schema
    hint: Any = None
    for part in key.split("."):
        section = _dataclass_type(current)
        if section is None:
            break
        hint = current = _field_types(section).get(part)
        if hint is None:
            return None
    return None if hint is None else _type_name(hint)


def _failing_key(schema: type, layer: DictConfig) -> str | None:
    """The dotted key of the first value of ``layer`` that does not merge into ``schema`` on its
    own, for the errors in which OmegaConf names no key (an element of a tuple field that does
    not convert: ``policy.hidden_sizes=[64,abc]``)."""

    def leaves(node: Any, section: type | None, prefix: str = ""):
        """The values of ``node`` by dotted key, down to the fields of the schema's sections
        (a mapping given for a field that is no section is one value)."""
        for name, value in node.items():
            inner = None if section is None else _dataclass_type(_field_types(section).get(name))
            if isinstance(value, Mapping) and value and inner is not None:
                yield from leaves(value, inner, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", value

    for key, value in leaves(OmegaConf.to_container(layer, resolve=False), schema):
        single: Any = value
        for part in reversed(key.split(".")):
            single = {part: single}
        try:
            OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.create(single))
        except (omegaconf_errors.OmegaConfBaseException, TypeError):
            return key
    return None


def _value_at(layer: DictConfig, key: str) -> Any:
    node: Any = OmegaConf.to_container(layer, resolve=False)
    for part in key.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(hint))
    if origin is not None:
        args = ", ".join(_type_name(arg) for arg in typing.get_args(hint) if arg is not Ellipsis)
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))


def _field_types(schema: type) -> dict[str, Any]:
    names = {field.name for field in dataclasses.fields(schema)}
    return {name: hint for name, hint in typing.get_type_hints(schema).items() if name in names}


def _dataclass_type(hint: Any) -> type | None:
    """The dataclass inside ``hint`` (``X``, ``Optional[X]``), or ``None``."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                return arg
    return None


def _require_dataclass(schema: Any) -> None:
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        raise TypeError(f"config schema must be a dataclass type, got {schema!r}")


__all__ = [
    "ConfigError",
    "absolute_path",
    "check_keys",
    "from_yaml",
    "load_config",
    "parse_overrides",
    "read_key",
    "run_kind",
    "to_dict",
    "to_yaml",
]

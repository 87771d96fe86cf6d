"""Trainable-parameter masks: which parameters a run updates, and the sub-tree they form.

A mask is a nested dict of Python bools shaped like the parameters (Flax params are nested
dicts; any non-dict value counts as one leaf, so boxed ``nn.Partitioned`` parameters,
shardings and ``ShapeDtypeStruct``s work alike):

    mask = trainable_mask(params, freeze=("^embed/", "group_0/"))   # regexes on "a/b/kernel"
    trainable = select(params, mask)      # only the True leaves (empty dicts pruned)
    params = merge(params, trainable)     # the full tree with those leaves replaced

The trainer differentiates and optimizes ``select(params, mask)`` only, so frozen
parameters get neither gradient buffers nor optimizer state; checkpoints hold all params.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ember.core.errors import ConfigError
from ember.core.tree import map_paths, param_paths

Mask = Any
"""A nested dict of bools shaped like the parameters."""


def trainable_mask(
    params: Mapping[str, Any], *, freeze: Sequence[str] = (), base: Mask | None = None, key: str = "train.freeze"
) -> Mask:
    """The mask of ``params``: ``base`` (all True when ``None``) with every parameter whose
    ``/``-joined path matches one of the ``freeze`` regular expressions (``re.search``) set
    to False.

    Raises:
      ConfigError: a pattern is not a valid regular expression, matches no parameter, or
        the mask leaves nothing to train (``key`` names the config entry).
    """
    patterns = []
    for index, pattern in enumerate(freeze):
        try:
            patterns.append(re.compile(pattern))
        except re.error as error:
            raise ConfigError(f"{key}[{index}] is not a regular expression ({error}): {pattern!r}", key=key) from None
    paths = param_paths(params)
    for index, pattern in enumerate(patterns):
        if not any(pattern.search(path) for path in paths):
            raise ConfigError(
                f"{key}[{index}] ({pattern.pattern!r}) matches no parameter; parameter paths look like "
                f"{', '.join(sorted(paths)[:4])}",
                key=key,
            )
    base_flat = param_paths(base) if base is not None else {}
    mask = map_paths(
        lambda path, _: bool(base_flat.get(path, True)) and not any(p.search(path) for p in patterns), params
    )
    if not any(param_paths(mask).values()):
        raise ConfigError(f"{key} freezes every parameter; nothing is left to train", key=key)
    return mask


def select(tree: Mapping[str, Any], mask: Mask) -> dict[str, Any]:
    """The leaves of ``tree`` where ``mask`` is True, as a nested dict (empty dicts dropped)."""
    result = {}
    for key, value in tree.items():
        flag = mask[key]
        if isinstance(flag, Mapping):
            sub = select(value, flag)
            if sub:
                result[key] = sub
        elif flag:
            result[key] = value
    return result


def merge(tree: Mapping[str, Any], subset: Mapping[str, Any]) -> dict[str, Any]:
    """``tree`` with the leaves present in ``subset`` (a :func:`select` result) replaced."""
    result = dict(tree)
    for key, value in subset.items():
        result[key] = merge(tree[key], value) if isinstance(value, Mapping) else value
    return result


__all__ = ["Mask", "map_paths", "merge", "param_paths", "select", "trainable_mask"]

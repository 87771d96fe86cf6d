"""Pytree helpers: parameter counts, byte sizes and a readable per-module summary.

print(summary(params, depth=2))

module                      params      bytes  dtypes
--------------------------  ----------  -------  --------
decoder/layers              1,234,560   4.7 MiB  float32
...
total                       1,300,000   5.0 MiB
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from ember.core.byte_sizes import format_bytes


def leaves_with_paths(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
    """``(path names, leaf)`` for the array leaves of ``tree`` (boxes unboxed), in ``jax.tree.leaves`` order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(tree))
    return [(tuple(_key_name(k) for k in path), leaf) for path, leaf in flat if hasattr(leaf, "shape")]


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def param_count(tree: Any) -> int:
    """Number of scalar entries over all array leaves of ``tree``."""
    return sum(int(np.prod(leaf.shape)) for _, leaf in leaves_with_paths(tree))


def param_bytes(tree: Any) -> int:
    """Bytes held by the array leaves of ``tree`` (``ShapeDtypeStruct`` leaves count too)."""
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for _, leaf in leaves_with_paths(tree))


def summary_rows(tree: Any, depth: int = 2) -> list[dict[str, Any]]:
    """Per-module totals, grouping leaves by the first ``depth`` path components."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    groups: dict[str, dict[str, Any]] = defaultdict(lambda: {"params": 0, "bytes": 0, "dtypes": set()})
    for path, leaf in leaves_with_paths(tree):
        name = "/".join(path[: min(depth, max(len(path) - 1, 1))]) or "(root)"
        size = int(np.prod(leaf.shape))
        group = groups[name]
        group["params"] += size
        group["bytes"] += size * np.dtype(leaf.dtype).itemsize
        group["dtypes"].add(np.dtype(leaf.dtype).name)
    return [{"module": name, **values, "dtypes": sorted(values["dtypes"])} for name, values in groups.items()]


def summary(tree: Any, depth: int = 2) -> str:
    """A table of parameter counts and bytes per module, with a total line."""
    rows = summary_rows(tree, depth)
    table = [(r["module"], f"{r['params']:,}", format_bytes(r["bytes"]), ",".join(r["dtypes"])) for r in rows]
    table.append(("total", f"{param_count(tree):,}", format_bytes(param_bytes(tree)), ""))
    headers = ("module", "params", "bytes", "dtypes")
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    align = ("<", ">", ">", "<")

    def line(cells):
        return "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(cells, align, widths)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in table[:-1]), rule, line(table[-1])])


def param_paths(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a/b/kernel": leaf}`` for every leaf of the nested dict ``tree`` (any non-dict value,
    a boxed ``nn.Partitioned`` parameter included, is one leaf)."""
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(param_paths(value, path + "/"))
        else:
            flat[path] = value
    return flat


def tree_from_paths(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`param_paths`: ``{"a/b": 1, "a/c": 2}`` -> ``{"a": {"b": 1, "c": 2}}``."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, name = path.split("/")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = value
    return tree


def map_paths(fn: Callable[[str, Any], Any], tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``tree`` with every leaf replaced by ``fn(path, leaf)`` (paths as in :func:`param_paths`)."""
    return {
        key: map_paths(fn, value, f"{prefix}{key}/") if isinstance(value, Mapping) else fn(f"{prefix}{key}", value)
        for key, value in tree.items()
    }


__all__ = [
    "leaves_with_paths",
    "map_paths",
    "param_bytes",
    "param_count",
    "param_paths",
    "summary",
    "summary_rows",
    "tree_from_paths",
]

"""How a weight maps inputs to outputs, read from its logical axes or its name.

    layout = weight_layout("layers/block_0/attn/o/kernel", leaf)   # lead 1, in_dims 2, out_dims 1

Adapters attach to these matrices (``ember.models.adapters``) and matrix optimizers (Muon,
GaLore: ``ember.training.optimizers``) orthogonalise or project them from input to output.
Leading stacking axes (``layers``, ``expert``) hold independent matrices.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import flax.linen as nn
import numpy as np

from ember.core.errors import ConfigError

LEAD_AXES = frozenset({"layers", "expert"})
"""Logical axes that stack independent weights (each gets its own adapter)."""
TARGETS: dict[str, str] = {
    "q": r"(^|/)attn/q/kernel$",
    "k": r"(^|/)attn/k/kernel$",
    "v": r"(^|/)attn/v/kernel$",
    "o": r"(^|/)attn/o/kernel$",
    "gate": r"(^|/)(mlp|shared)/gate$",
    "up": r"(^|/)(mlp|shared)/up$",
    "down": r"(^|/)(mlp|shared)/down$",
    "experts": r"(^|/)experts/(gate|up|down)$",
}
"""The linear maps by name and the parameter paths they select (adapter targets, quantized weights)."""
_LAYOUTS = (
    (r"attn/o/kernel$", None, 1),
    (r"attn/(q|k|v)/kernel$", 1, None),
    (r"attn/(z|x|B|C|dt)/kernel$", 1, None),
    (r"(mlp|shared|experts)/(gate|up|down)$", 1, 1),
)
"""``(path pattern, input dims, output dims)`` of weights whose tree carries no logical axes
(None: the dimensions left after the stacking axes and the other side; attention's q/k/v are
``[embed, heads, head_dim]``, CCA's ``[embed, latent]``; a Mamba-2 mixer's in-projections
``z x B C dt`` go from ``embed`` too)."""
_STACKED = (r"(^|/)layers/", r"(^|/)experts/")
"""Path parts that put a stacking axis in front of an unboxed weight (scanned layers, experts)."""


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """A weight's dimensions: ``lead`` stacking axes, then ``in_dims`` input and ``out_dims``
    output ones; ``names`` its logical axes (None when the tree carries none)."""

    lead: int
    in_dims: int
    out_dims: int
    names: tuple[str | None, ...] | None = None

    def split(self, shape):
        lead, rest = shape[: self.lead], shape[self.lead :]
        return lead, rest[: self.in_dims], rest[self.in_dims :]


def weight_layout(path: str, leaf: Any) -> WeightLayout:
    """How ``leaf`` at ``path`` maps inputs to outputs: from its logical axes when boxed (the
    residual-stream axis ``embed`` is its input when first, its output when last), else from
    the weight's name and its place in the tree (a ``layers/`` or ``experts/`` path stacks one
    leading axis each), as ``/``-joined from the root of the parameter tree.

    Raises:
      ConfigError: the weight's layout cannot be told (not a matrix into or out of ``embed``).
    """
    shape = np.shape(leaf_value(leaf))
    if isinstance(leaf, nn.Partitioned):
        names = tuple(leaf.names)
        lead = 0
        while lead < len(names) and names[lead] in LEAD_AXES:
            lead += 1
        rest = names[lead:]
        if len(rest) >= 2 and rest[0] == "embed":
            return WeightLayout(lead, 1, len(rest) - 1, names)
        if len(rest) >= 2 and rest[-1] == "embed":
            return WeightLayout(lead, len(rest) - 1, 1, names)
    else:
        lead = stacked_axes(path)
        for pattern, in_dims, out_dims in _LAYOUTS:
            if re.search(pattern, path):
                rest = len(shape) - lead
                in_dims, out_dims = in_dims or rest - out_dims, out_dims or rest - (in_dims or 0)
                if in_dims >= 1 and out_dims >= 1 and in_dims + out_dims == rest:
                    return WeightLayout(lead, in_dims, out_dims)
    raise ConfigError(
        f"adapter target {path!r} (shape {shape}) is not a weight an adapter can attach to: "
        "a matrix into or out of the model width (embed)",
        key="adapter.targets",
    )


def stacked_axes(path: str) -> int:
    """How many leading axes stack the weight at ``path`` (a ``layers/`` or ``experts/`` path
    stacks one each), as ``/``-joined from the root of the parameter tree."""
    return sum(1 for stacked in _STACKED if re.search(stacked, path))


def leaf_value(leaf: Any) -> Any:
    """A parameter's array, unboxed when it is an ``nn.Partitioned``."""
    return leaf.value if isinstance(leaf, nn.Partitioned) else leaf


def rebox(like: Any, value: Any) -> Any:
    """``value`` in ``like``'s logical-axis box when ``like`` is boxed, else as it is."""
    return like.replace_boxed(value) if isinstance(like, nn.Partitioned) else value


__all__ = ["LEAD_AXES", "TARGETS", "WeightLayout", "leaf_value", "rebox", "stacked_axes", "weight_layout"]

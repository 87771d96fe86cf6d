"""Which leaves of a parameter tree belong to adapters, and the trees made from them.

Adapter leaves are named ``<weight>_<part>`` (``up_lora_a``; see ``lowrank``), plus a MixLoRA
router ``mixlora_router_top<k>``; everything else is the base model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ember.core.errors import ConfigError
from ember.core.tree import param_paths, tree_from_paths
from ember.models.adapters.lowrank import MIXLORA_ROUTER, TRAINED_PARTS


def adapter_mask(params: Mapping[str, Any]) -> dict[str, Any]:
    """The trainable mask of an adapter fine-tune: True on ``A``, ``B`` and DoRA magnitudes."""
    flat = param_paths(params)
    if not any(_is_adapter_leaf(p) for p in flat):
        raise ConfigError("the parameters carry no adapters to train", key="adapter")
    return tree_from_paths({p: adapter_part(p) in TRAINED_PARTS for p in flat})


def adapter_leaves(params: Mapping[str, Any]) -> dict[str, Any]:
    """Only the adapter leaves of ``params`` (as a nested dict)."""
    return tree_from_paths({p: v for p, v in param_paths(params).items() if _is_adapter_leaf(p)})


def without_adapters(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with every adapter leaf removed (the base weights as they are)."""
    return tree_from_paths({p: v for p, v in param_paths(params).items() if not _is_adapter_leaf(p)})


def adapted_paths(params: Mapping[str, Any]) -> list[str]:
    """The paths of the weights that carry an adapter (or MixLoRA's stacked expert adapters)."""
    return [p[: -len("_lora_a")] for p in param_paths(params) if p.endswith("_lora_a")]


def adapter_part(path: str) -> str | None:
    """``"attn/q/kernel_lora_a"`` -> ``"lora_a"`` (a MixLoRA router: ``"mixlora_router"``);
    None for a path that is not an adapter leaf."""
    if MIXLORA_ROUTER.match(path.rsplit("/", 1)[-1]):
        return "mixlora_router"
    found = re.search(r"_(lora_[a-z0-9]+)$", path)
    return found.group(1) if found else None


def _is_adapter_leaf(path: str) -> bool:
    return adapter_part(path) is not None


__all__ = ["adapted_paths", "adapter_leaves", "adapter_mask", "adapter_part", "without_adapters"]

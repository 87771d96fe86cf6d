"""Which leaves of a parameter tree belong to adapters, and the trees made from them.

Adapter leaves are named ``<weight>_<part>`` (``up_lora_a``; see ``lowrank``), plus a MixLoRA
router ``mixlora_router_top<k>``; everything else is the base model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ember.core.errors import ConfigError
from ember.core.tree import param_paths, tree_from_paths
from ember.models.adapters.lowrank import MIXLORA_ROUTER, TRAINED_PARTS, part_name


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


def factors_on_original_base(flat: Mapping[str, Any], weight: str, lead_dims: int = 0) -> tuple[jax.Array, jax.Array]:
    """``(A, B)`` of the adapter on ``weight`` in the flat unboxed tree ``flat``, expressed against
    the weight the model had before the adapter was added. PiSSA and LoRA-GA replaced it by
    ``W - scale A0 B0`` (they keep ``lora_a0`` / ``lora_b0``): their factors become rank ``2r``,
    ``A' = [A, A0]``, ``B' = [B; -B0]``, so that ``W + scale A' B' = W - scale A0 B0 + scale A B``
    (PEFT's PiSSA conversion). Other adapters' factors are returned as they are."""
    a, b = flat[part_name(weight, "lora_a")], flat[part_name(weight, "lora_b")]
    if part_name(weight, "lora_a0") not in flat:
        return a, b
    a0, b0 = flat[part_name(weight, "lora_a0")], flat[part_name(weight, "lora_b0")]
    return jnp.concatenate([a, a0], axis=-1), jnp.concatenate([b, -b0], axis=lead_dims)


def adapter_part(path: str) -> str | None:
    """``"attn/q/kernel_lora_a"`` -> ``"lora_a"`` (a MixLoRA router: ``"mixlora_router"``);
    None for a path that is not an adapter leaf."""
    if MIXLORA_ROUTER.match(path.rsplit("/", 1)[-1]):
        return "mixlora_router"
    found = re.search(r"_(lora_[a-z0-9]+)$", path)
    return found.group(1) if found else None


def _is_adapter_leaf(path: str) -> bool:
    return adapter_part(path) is not None


__all__ = [
    "adapted_paths",
    "adapter_leaves",
    "adapter_mask",
    "adapter_part",
    "factors_on_original_base",
    "without_adapters",
]

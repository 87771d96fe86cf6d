"""LoRA-GA initialisation: adapters whose first step follows full fine-tuning's gradient.

    grads = average_gradients(loss_of_params, params, batches)   # full-weight gradients
    params = lora_ga_init(params, grads, gamma=16)               # params from add_lora

LoRA-GA (Wang et al. 2024) takes the SVD of each target weight's averaged gradient ``G = U S
V^T`` (Ember layout ``[in, out]``) and sets ``A = U[:, :r] c``, ``B = V[:, r:2r]^T c`` with
``c = d_out^(1/4) / sqrt(gamma)`` (the paper's "stable" scale, direction "ArB2r"), then
keeps ``W - scale A B`` as the base so that the adapted model starts equal to the base. The
initial factors are kept as ``lora_a0`` / ``lora_b0`` for export against the original base
(see ``ember.models.hf.peft``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ember.core.sharding import unbox
from ember.core.tree import param_paths, tree_from_paths
from ember.models.adapters.layout import leaf_value, rebox, weight_layout
from ember.models.adapters.leaves import adapted_paths
from ember.models.adapters.lowrank import LowRank, low_rank_product, part_name


def average_gradients(loss: Callable[[Any, Any], jax.Array], params: Any, batches: Iterable[Any]) -> Any:
    """The mean over ``batches`` of ``grad(loss)(params, batch)`` (one jitted gradient)."""
    grad = jax.jit(jax.grad(loss))
    total, count = None, 0
    for batch in batches:
        g = grad(params, batch)
        total = g if total is None else jax.tree.map(jnp.add, total, g)
        count += 1
    if total is None:
        raise ValueError("average_gradients needs at least one batch")
    return jax.tree.map(lambda g: g / count, total)


def lora_ga_init(params: Mapping[str, Any], gradients: Mapping[str, Any], *, gamma: float = 16.0) -> dict[str, Any]:
    """``params`` (with adapters from ``add_lora``) re-initialised by LoRA-GA from the
    full-weight ``gradients`` (a tree with at least every adapted weight's gradient)."""
    flat, grads = param_paths(params), param_paths(unbox(gradients))
    updates = {}
    for path in adapted_paths(params):
        layout = weight_layout(path, flat[path])
        kernel = leaf_value(flat[path])
        rank = leaf_value(flat[part_name(path, "lora_a")]).shape[-1]
        scale = leaf_value(flat[part_name(path, "lora_scale")])
        lead, in_shape, out_shape = layout.split(kernel.shape)
        if 2 * rank > min(math.prod(in_shape), math.prod(out_shape)):
            raise ValueError(f"LoRA-GA needs 2 * rank ({2 * rank}) <= the smaller side of {path} {kernel.shape}")
        g = jnp.asarray(grads[path], jnp.float32).reshape(-1, math.prod(in_shape), math.prod(out_shape))
        u, _, vt = jnp.linalg.svd(g, full_matrices=False)
        c = math.prod(out_shape) ** 0.25 / math.sqrt(gamma)
        a = (u[:, :, :rank] * c).reshape(*lead, *in_shape, rank)
        b = (vt[:, rank : 2 * rank, :] * c).reshape(*lead, rank, *out_shape)
        residual = kernel.astype(jnp.float32) - low_rank_product(LowRank(a, b, scale), layout.lead)
        for part, value in (("", residual), ("lora_a", a), ("lora_b", b), ("lora_a0", a), ("lora_b0", b)):
            name = path if not part else part_name(path, part)
            like = flat.get(name, flat[part_name(path, part[:-1])] if part.endswith("0") else None)
            updates[name] = rebox(like, value.astype(leaf_value(flat[path]).dtype))
    return tree_from_paths({**flat, **updates})


__all__ = ["average_gradients", "lora_ga_init"]

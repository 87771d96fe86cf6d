"""The layer side of low-rank adapters: how a layer finds its adapter and applies it.

An adapted weight ``W`` (a kernel ``[*in_shape, *out_shape]``, with optional leading
``[layers]`` / ``[experts]`` axes in the tree) has sibling parameters in the same module:

- ``<w>_lora_a [*in_shape, rank]`` and ``<w>_lora_b [rank, *out_shape]`` (trained);
- ``<w>_lora_scale []`` f32: ``alpha / rank`` (``alpha / sqrt(rank)`` with rsLoRA), frozen;
- ``<w>_lora_magnitude [*out_shape]`` (DoRA's magnitude vector, trained), optional;
- ``<w>_lora_dropout []`` f32, the dropout rate on the adapter's input, optional, frozen.

The adapted map is ``x W + scale * (x A) B``; with DoRA it is ``m / ||W + scale A B|| * (x W
+ scale (x A) B)``, the norm taken over the input dimensions per output channel and treated
as a constant in the backward pass (DoRA's section 4.3, as PEFT does). Dropout applies to
the adapter path only and only when the caller passes a ``dropout`` RNG to ``apply``; with
DoRA that path is PEFT's ``(m / ||W + scale A B|| - 1) d(x) W + m / ||W + scale A B|| *
scale (d(x) A) B`` added to ``x W`` (``d``: dropout), which is the formula above without it.

A layer reads its adapter with :func:`read_low_rank` and computes with
:func:`adapted_matmul`; the base model's code does not fork per adapter type. The tree
surgery that adds these parameters is ``ember.models.adapters.lora``.

**Several adapters at once** (serving): ``A [adapters, *in_shape, rank]`` and ``B
[adapters, rank, *out_shape]`` with the scale folded into ``B``, and ``adapter_ids
[batch, seq]`` (``-1``: no adapter) choose each token's adapter; the deltas are computed by
grouping tokens by adapter with ``grouped_matmul`` (S-LoRA), never by merging weights.
Stacked DoRA adapters hold their factors ``m / ||W + scale A B||`` ``[adapters,
*out_shape]`` in ``<w>_lora_magnitude`` (precomputed: the base weight is fixed when serving).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.kernels_pallas.grouped_matmul import grouped_matmul
from ember.models.quantization.stored import QuantizedWeight, quantized_dot

PARTS: tuple[str, ...] = ("lora_a", "lora_b", "lora_scale", "lora_magnitude", "lora_dropout")
"""The suffixes of an adapter's parameters (``<weight>_<part>``)."""
TRAINED_PARTS: tuple[str, ...] = ("lora_a", "lora_b", "lora_magnitude", "mixlora_router")
"""The parts an adapter fine-tune trains (the scale and dropout rate are constants)."""
MIXLORA_ROUTER = re.compile(r"^mixlora_router_top(\d+)$")
"""A MixLoRA router's parameter name in its MLP (``ember.models.layers.mixlora_mlp``); the
number is its top-k, which the layer needs statically."""


def part_name(weight: str, part: str) -> str:
    """The parameter name of ``part`` of the adapter on ``weight``: ``up`` -> ``up_lora_a``."""
    return f"{weight}_{part}"


class LowRank(NamedTuple):
    """One weight's adapter as a layer sees it (see the module docstring for shapes)."""

    a: jax.Array
    b: jax.Array
    scale: jax.Array
    magnitude: jax.Array | None = None
    dropout: jax.Array | None = None


def read_low_rank(module: nn.Module, weight: str) -> LowRank | None:
    """The adapter on ``module``'s parameter ``weight``, or None when it has none."""
    if not module.has_variable("params", part_name(weight, "lora_a")):
        return None

    def get(part):
        name = part_name(weight, part)
        return module.get_variable("params", name) if module.has_variable("params", name) else None

    return LowRank(get("lora_a"), get("lora_b"), get("lora_scale"), get("lora_magnitude"), get("lora_dropout"))


def low_rank_product(adapter: LowRank, lead_dims: int = 0) -> jax.Array:
    """``scale * A B`` ``[*lead, *in_shape, *out_shape]`` in f32: the adapter's change of the
    weight, for adapters with ``lead_dims`` leading batch axes (stacked layers or experts)."""
    a, b = adapter.a.astype(jnp.float32), adapter.b.astype(jnp.float32)
    lead, in_shape, out_shape = a.shape[:lead_dims], a.shape[lead_dims:-1], b.shape[lead_dims + 1 :]
    rank = a.shape[-1]
    product = jnp.matmul(a.reshape(-1, _size(in_shape), rank), b.reshape(-1, rank, _size(out_shape)))
    scale = jnp.broadcast_to(adapter.scale.astype(jnp.float32), lead).reshape(-1, 1, 1)
    return (scale * product).reshape(*lead, *in_shape, *out_shape)


def weight_norm(kernel: jax.Array, in_dims: int, lead_dims: int = 0) -> jax.Array:
    """``||W||`` over the ``in_dims`` input dimensions after ``lead_dims`` leading ones:
    ``[*lead, *out_shape]`` (DoRA's per-output-channel norm)."""
    axes = tuple(range(lead_dims, lead_dims + in_dims))
    return jnp.sqrt(jnp.sum(jnp.square(kernel.astype(jnp.float32)), axis=axes))


def dora_factor(kernel: jax.Array, adapter: LowRank, in_dims: int, lead_dims: int = 0) -> jax.Array:
    """``m / ||W + scale A B||`` ``[*lead, *out_shape]``, the norm a constant for the gradient."""
    adapted = kernel.astype(jnp.float32) + low_rank_product(adapter, lead_dims)
    norm = jax.lax.stop_gradient(weight_norm(adapted, in_dims, lead_dims))
    return adapter.magnitude.astype(jnp.float32) / norm


def adapted_weight(kernel: jax.Array, adapter: LowRank | None, in_dims: int, lead_dims: int = 0) -> jax.Array:
    """The merged weight ``W + scale A B`` (DoRA: ``m / ||W + scale A B|| * (W + scale A B)``)
    in ``kernel``'s dtype, ``[*lead, *in_shape, *out_shape]``; ``kernel`` when no adapter."""
    if adapter is None:
        return kernel
    merged = kernel.astype(jnp.float32) + low_rank_product(adapter, lead_dims)
    if adapter.magnitude is not None:
        factor = dora_factor(kernel, adapter, in_dims, lead_dims)
        merged = merged * jnp.expand_dims(factor, tuple(range(lead_dims, lead_dims + in_dims)))
    return merged.astype(kernel.dtype)


def adapted_matmul(
    module: nn.Module,
    x: jax.Array,
    kernel: jax.Array | QuantizedWeight,
    adapter: LowRank | None,
    *,
    in_dims: int = 1,
    adapter_ids: jax.Array | None = None,
    quantized_impl: str = "auto",
) -> jax.Array:
    """``x [..., *in_shape] @ kernel [*in_shape, *out_shape]`` plus ``adapter``'s delta.

    ``module`` supplies the ``dropout`` RNG (when the caller passed one). ``adapter_ids``
    ``[*x.shape[:-in_dims]]`` int32: each token's adapter in a stacked adapter (several at
    once, see the module docstring); None for a single adapter (a stacked one then adds nothing).
    A quantized ``kernel`` (``ember.models.quantization``, QLoRA's frozen base) is multiplied
    without being dequantised (``quantized_matmul`` with ``impl=quantized_impl``, the model's
    ``quantized_impl``); DoRA needs the float weight's norms and refuses it.
    """
    if isinstance(kernel, QuantizedWeight):
        if adapter is not None and adapter.magnitude is not None:
            raise ValueError("DoRA needs a float base weight; this one is quantized (use LoRA for QLoRA)")
        y = quantized_dot(x, kernel, in_dims, impl=quantized_impl)
    else:
        y = jnp.tensordot(x, kernel.astype(x.dtype), axes=in_dims)
    if adapter is None or (adapter.scale is None and adapter_ids is None):
        return y  # stacked adapters (no scale leaf) without ids: no token names an adapter
    if adapter_ids is not None:
        out = y + grouped_low_rank_delta(x, adapter, adapter_ids, in_dims).astype(y.dtype)
        if adapter.magnitude is None:
            return out
        # Stacked DoRA adapters carry their factors m / ||W + scale A B|| [adapters, *out_shape].
        factors = jnp.where(
            (adapter_ids >= 0).reshape(*adapter_ids.shape, *(1,) * (adapter.magnitude.ndim - 1)),
            adapter.magnitude[jnp.maximum(adapter_ids, 0)],
            1.0,
        )
        return (factors * out.astype(jnp.float32)).astype(y.dtype)
    h = x
    dropped = adapter.dropout is not None and module.has_rng("dropout")
    if dropped:
        rate = adapter.dropout.astype(jnp.float32)
        keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rate, x.shape)
        h = jnp.where(keep, x / (1.0 - rate).astype(x.dtype), jnp.zeros_like(x))
    low = jnp.tensordot(h, adapter.a.astype(x.dtype), axes=in_dims)
    delta = jnp.tensordot(low, adapter.b.astype(x.dtype), axes=1) * adapter.scale.astype(x.dtype)
    if adapter.magnitude is None:
        return y + delta
    factor = dora_factor(kernel, adapter, in_dims)
    if not dropped:
        return (factor * (y + delta).astype(jnp.float32)).astype(y.dtype)
    # DoRA's change of the base output, (m / ||W + scale A B|| - 1) x W, is on the adapter path and
    # sees the dropped input too, as in PEFT and the DoRA authors' code.
    base_dropped = jnp.tensordot(h, kernel.astype(x.dtype), axes=in_dims).astype(jnp.float32)
    return (y.astype(jnp.float32) + (factor - 1.0) * base_dropped + factor * delta.astype(jnp.float32)).astype(y.dtype)


def grouped_low_rank_delta(x: jax.Array, adapter: LowRank, adapter_ids: jax.Array, in_dims: int) -> jax.Array:
    """Each token's delta ``(x A[i]) B[i]`` for its adapter ``i = adapter_ids[token]`` (0 where
    ``-1``), computed on tokens sorted by adapter with two grouped matmuls.

    ``adapter.a [adapters, *in_shape, rank]``, ``adapter.b [adapters, rank, *out_shape]``
    (scale folded in).
    """
    lead = x.shape[: x.ndim - in_dims]
    num_adapters, rank = adapter.a.shape[0], adapter.a.shape[-1]
    out_shape = adapter.b.shape[2:]
    flat = x.reshape(-1, _size(x.shape[x.ndim - in_dims :]))
    ids = adapter_ids.reshape(-1)
    # Tokens without an adapter sort last, past the groups' sum: grouped_matmul gives them zeros.
    order = jnp.argsort(jnp.where(ids < 0, num_adapters, ids), stable=True)
    group_sizes = jnp.bincount(jnp.where(ids < 0, num_adapters, ids), length=num_adapters + 1)[:num_adapters]
    group_sizes = group_sizes.astype(jnp.int32)
    a = adapter.a.reshape(num_adapters, -1, rank).astype(x.dtype)
    b = adapter.b.reshape(num_adapters, rank, -1).astype(x.dtype)
    h = grouped_matmul(flat[order], a, group_sizes)
    delta_sorted = grouped_matmul(h, b, group_sizes)
    delta = jnp.zeros_like(delta_sorted).at[order].set(delta_sorted)
    return delta.reshape(*lead, *out_shape)


def _size(shape) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


__all__ = [
    "MIXLORA_ROUTER",
    "PARTS",
    "TRAINED_PARTS",
    "LowRank",
    "adapted_matmul",
    "adapted_weight",
    "dora_factor",
    "grouped_low_rank_delta",
    "low_rank_product",
    "part_name",
    "read_low_rank",
    "weight_norm",
]

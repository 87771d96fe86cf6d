"""How a quantized weight sits in the parameter tree, and how a layer reads it.

A quantized weight replaces its float leaf (``.../attn/q/kernel``, ``.../mlp/up``, shaped
``[*lead, *in_shape, *out_shape]``) with a dict whose first key names the format; the
input dimensions are flattened to ``K`` (``lead``: stacked layers):

- int8: ``{"int8": int8 [*lead, K, *out], "scales": f32 [*lead, 1, *out]}``
- int4: ``{"int4": uint8 [*lead, K // 2, *out], "scales": f32 [*lead, K // group, *out]}``
- nf4:  ``{"nf4": uint8 [*lead, K // 2, *out], "absmax": float8_e4m3fn [*lead, K // 64, *out],
  "absmax_scale": f32 [*lead, blocks], "absmax_mean": f32 [*lead]}`` -- QLoRA's double
  quantisation: the blocks' absmax values, less their mean, stored as 8-bit floats in
  blocks of 256 with one f32 scale each.

A layer calls :func:`read_quantized` before ``self.param`` (a dict would fail Linen's shape
check) and multiplies with :func:`quantized_dot`, which runs ``quantized_matmul``: the
weight stays quantized on the device. :func:`record_input` sows each weight's input Gram
matrix for GPTQ's calibration (:func:`record_gram` one computed by the layer: the routed
experts' own, ``[experts, K, K]``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.sharding import constrain, per_shard
from ember.kernels_pallas.quantized_formats import FORMATS, QuantizedMatrix, dequantize
from ember.kernels_pallas.quantized_matmul import quantized_matmul
from ember.models.layers.kernel_shards import unshared_with

ABSMAX_BLOCK = 256
"""Block of the double quantisation (absmax values sharing one f32 scale)."""
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)
CALIBRATION = "calibration"
"""The collection :func:`record_input` sows Gram matrices into (``<weight>_gram``)."""


def stored_format(value) -> str | None:
    """The format of a stored quantized weight (a dict keyed by its format), else None."""
    if isinstance(value, Mapping):
        return next((fmt for fmt in FORMATS if fmt in value), None)
    return None


def stored_weight_paths(flat: Mapping[str, Any]) -> list[str]:
    """The paths of the stored quantized weights in ``flat``, in its order: ``flat`` is a tree's
    ``param_paths``, which lists each stored weight's parts (``.../kernel/int8``, ``.../kernel/scales``)."""
    return list(dict.fromkeys(path.rsplit("/", 1)[0] for path in flat if path.rsplit("/", 1)[-1] in FORMATS))


def double_quantize(absmax: jax.Array) -> dict[str, jax.Array]:
    """f32 absmax ``[groups, n]`` -> ``absmax`` (f8), ``absmax_scale [blocks]``, ``absmax_mean []``."""
    mean = jnp.mean(absmax)
    flat = (absmax - mean).reshape(-1)
    blocks = math.ceil(flat.size / ABSMAX_BLOCK)
    padded = jnp.pad(flat, (0, blocks * ABSMAX_BLOCK - flat.size)).reshape(blocks, ABSMAX_BLOCK)
    scale = jnp.max(jnp.abs(padded), axis=1) / FP8_MAX
    scale = jnp.where(scale > 0, scale, 1.0)
    codes = (padded / scale[:, None]).astype(jnp.float8_e4m3fn).reshape(-1)[: flat.size]
    return {"absmax": codes.reshape(absmax.shape), "absmax_scale": scale, "absmax_mean": mean}


def absmax_values(parts: Mapping[str, jax.Array]) -> jax.Array:
    """f32 ``[groups, *out]``: the absmax values a double-quantised NF4 weight stores.

    Each value's block is found from its own index (row-major, as :func:`double_quantize`
    flattened them), not by flattening the codes: a weight split over its columns decodes
    where it lies (flattening had XLA gather the codes, and on a mesh scatter the result)."""
    codes = parts["absmax"]
    strides = [math.prod(codes.shape[dim + 1 :]) for dim in range(codes.ndim)]
    index = sum(jax.lax.broadcasted_iota(jnp.int32, codes.shape, dim) * stride for dim, stride in enumerate(strides))
    scale = parts["absmax_scale"].astype(jnp.float32)[index // ABSMAX_BLOCK]
    return codes.astype(jnp.float32) * scale + parts["absmax_mean"].astype(jnp.float32)


def store_matrix(matrix: QuantizedMatrix, out_shape: tuple[int, ...]) -> dict[str, jax.Array]:
    """One layer's stored dict from a 2-D ``QuantizedMatrix`` ``[K, prod(out_shape)]``."""
    values = matrix.values.reshape(matrix.values.shape[0], *out_shape)
    scales = matrix.scales.reshape(matrix.scales.shape[0], *out_shape)
    if matrix.format == "nf4":
        return {"nf4": values, **double_quantize(scales)}
    return {matrix.format: values, "scales": scales}


def as_matrix(parts: Mapping[str, jax.Array]) -> QuantizedMatrix:
    """The 2-D ``QuantizedMatrix`` ``[K, N]`` of one layer's stored dict."""
    fmt = stored_format(parts)
    values = parts[fmt]
    scales = absmax_values(parts) if fmt == "nf4" else parts["scales"]
    return QuantizedMatrix(values.reshape(values.shape[0], -1), scales.reshape(scales.shape[0], -1), fmt)


def dequantized(parts: Mapping[str, jax.Array], in_shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    """The float weight ``[*in_shape, *out_shape]`` one layer's stored dict stands for."""
    out_shape = parts[stored_format(parts)].shape[1:]
    return dequantize(as_matrix(parts), dtype).reshape(*in_shape, *out_shape)


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized weight as a layer sees it (one layer's stored dict) and the logical axes of
    the float weight ``[*in_shape, *out_shape]`` it stands for, when the layer names them."""

    parts: Mapping[str, jax.Array]
    axes: tuple[str | None, ...] | None = None

    @property
    def format(self) -> str:
        return stored_format(self.parts)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.parts[self.format].shape[1:])


def read_quantized(module: nn.Module, name: str, axes: tuple[str | None, ...] | None = None) -> QuantizedWeight | None:
    """``module``'s parameter ``name`` when it is stored quantized, else None; ``axes``: the
    logical axes of the float weight (how its rows and columns shard)."""
    if not module.has_variable("params", name):
        return None
    value = module.get_variable("params", name)
    return QuantizedWeight(nn.meta.unbox(value), axes) if stored_format(value) else None


def quantized_dot(x: jax.Array, weight: QuantizedWeight, in_dims: int = 1, impl: str = "auto") -> jax.Array:
    """``x [..., *in_shape] @ W [*in_shape, *out_shape]`` -> ``[..., *out_shape]`` in ``x``'s dtype.

    Under a mesh it runs on each device's shard (``per_shard``): ``x``'s rows split as the batch,
    ``W``'s columns (with their scales) as its output axes, and a row-parallel weight's rows
    (``o``'s heads, ``down``'s mlp on the tensor axis) with ``x``'s columns, the partial products
    summed, as XLA splits its own matmul. An axis whose mesh axes the batch takes too is whole on
    every device: FSDP's ``embed`` rows are gathered, as XLA gathers an FSDP weight, but as codes.
    Why both paths: XLA cannot partition the Pallas kernel (it gathered ``x`` and ``W`` whole onto
    every device), and on XLA's own path it partitions the dequantised product, so under FSDP it
    gathered the float weight (8x an NF4 weight's bytes in f32)."""
    out_shape, fmt = weight.out_shape, weight.format

    def product(x, values, scales, out_dtype=None):
        lead = x.shape[: x.ndim - in_dims]
        local = QuantizedMatrix(values.reshape(values.shape[0], -1), scales.reshape(scales.shape[0], -1), fmt)
        y = quantized_matmul(x.reshape(math.prod(lead), -1), local, impl=impl, preferred_element_type=out_dtype)
        return y.reshape(*lead, *values.shape[1:])

    def values_and_scales(parts):
        matrix = as_matrix(parts)
        return (a.reshape(a.shape[0], *out_shape) for a in (matrix.values, matrix.scales))

    if x.ndim == in_dims:
        return product(x, *values_and_scales(weight.parts))
    axes = weight.axes or (None,) * (in_dims + len(out_shape))
    rows = ("batch", *(None,) * (x.ndim - in_dims - 1))
    columns = unshared_with(("batch",), axes[in_dims:])
    # The contraction, split by its first input axis where the rows and columns leave it free;
    # int8's one scale per column multiplies each partial product alike.
    (k,) = unshared_with(("batch", *columns), axes[:1])
    x_axes = (*rows, k, *(None,) * (in_dims - 1))
    scales_k = None if fmt == "int8" else k
    parts = weight.parts
    if fmt == "nf4":  # absmax codes laid out as the product takes the scales: gathered as 8-bit floats, not decoded f32
        parts = {**parts, "absmax": constrain(parts["absmax"], (scales_k, *columns))}
    in_axes = [x_axes, (k, *columns), (scales_k, *columns)]
    partial_sums = functools.partial(product, out_dtype=jnp.float32 if k else None)  # summed in f32
    sharded = per_shard(partial_sums, in_axes, (*rows, *columns), sum_over=k)
    return sharded(x, *values_and_scales(parts)).astype(x.dtype)


def calibrating(module: nn.Module) -> bool:
    """Whether ``module`` runs GPTQ's calibration pass (:data:`CALIBRATION` mutable, not init)."""
    # init makes every collection mutable: the statistics are not model state
    return not module.is_initializing() and module.is_mutable_collection(CALIBRATION)


def record_gram(module: nn.Module, name: str, gram: jax.Array) -> None:
    """Sows ``gram`` (f32 ``[..., K, K]``, summed over tokens) as weight ``name``'s input Gram
    matrix into :data:`CALIBRATION` when :func:`calibrating`; repeated calls add up."""
    if calibrating(module):
        module.sow(CALIBRATION, f"{name}_gram", gram, reduce_fn=lambda a, b: a + b, init_fn=lambda: 0.0)


def record_input(module: nn.Module, name: str, x: jax.Array, in_dims: int = 1) -> None:
    """Sows ``X^T X`` f32 ``[K, K]`` of weight ``name``'s input (summed over tokens) into
    :data:`CALIBRATION` when that collection is mutable (GPTQ's calibration pass)."""
    if not calibrating(module):
        return
    flat = x.reshape(-1, math.prod(x.shape[x.ndim - in_dims :])).astype(jnp.float32)
    record_gram(module, name, jnp.dot(flat.T, flat, precision=jax.lax.Precision.HIGHEST))


__all__ = [
    "ABSMAX_BLOCK",
    "CALIBRATION",
    "QuantizedWeight",
    "absmax_values",
    "as_matrix",
    "calibrating",
    "dequantized",
    "double_quantize",
    "quantized_dot",
    "read_quantized",
    "record_gram",
    "record_input",
    "store_matrix",
    "stored_format",
    "stored_weight_paths",
]

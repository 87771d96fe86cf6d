"""Choosing quantized values: scales and codes for a float matrix, through qwix.

A matrix ``w [k, n]`` (``k`` contracted) is split into groups of ``group_size`` rows; each
group and output column gets a symmetric scale from its absmax (qwix's ``calibrate`` and
``compute_scale_zero_point``), and each entry the code qwix's ``quantize_with_scale_zero_point``
gives it (int8 and int4: round and clip; NF4: the nearest of the 16 NormalFloat values).
The stored form (packed nibbles) is ``ember.kernels_pallas.quantized_formats``; this module
only chooses the numbers, so round-to-nearest, GPTQ (which picks scales per group, then
codes column by column) and QAT's fake quantization share one definition.

``fp8`` (float8_e4m3fn, per output channel) exists for quantization-aware training only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from qwix._src.core import qarray

from ember.kernels_pallas.quantized_formats import QuantizedMatrix, int4_to_nibbles, pack_nibbles
from ember.models.quantization.stored import absmax_values, double_quantize

QTYPES = {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4", "fp8": jnp.float8_e4m3fn}
"""qwix's name for each format."""
DEFAULT_GROUP_SIZES = {"int8": None, "int4": 128, "nf4": 64, "fp8": None}
"""Rows per scale group (None: one group of all rows, i.e. per output channel)."""


def _how(fmt: str, k: int, group_size: int | None) -> qarray.HowToQuantize:
    tiled = {} if group_size is None or group_size >= k else {0: group_size}
    return qarray.HowToQuantize(qtype=QTYPES[fmt], channelwise_axes=[1], tiled_axes=tiled)


def group_scales(w: jax.Array, fmt: str, group_size: int | None) -> jax.Array:
    """f32 ``[k // group_size, n]``: each group's absmax over the format's largest value."""
    how = _how(fmt, w.shape[0], group_size)
    scale, _ = qarray.compute_scale_zero_point(qarray.calibrate(w.astype(jnp.float32), how), how.qtype)
    return scale.astype(jnp.float32)


def encode(w: jax.Array, scales: jax.Array, fmt: str) -> jax.Array:
    """The codes of ``w [k, n]`` under ``scales [groups, n]``: int8 / int4 values, NF4 indices
    (uint4), fp8 values (as qwix returns them, unpacked)."""
    return qarray.quantize_with_scale_zero_point(w.astype(jnp.float32), QTYPES[fmt], scales, None).qvalue


def decode(codes: jax.Array, scales: jax.Array, fmt: str) -> jax.Array:
    """f32 ``[k, n]``: the values ``codes`` stand for under ``scales`` (qwix's dequantize)."""
    return qarray.dequantize(qarray.QArray(codes, scales.astype(jnp.float32), None, QTYPES[fmt]))


def to_matrix(codes: jax.Array, scales: jax.Array, fmt: str) -> QuantizedMatrix:
    """The stored form of int8 / int4 / NF4 ``codes [k, n]`` (4-bit packed two per byte)."""
    if fmt == "int8":
        values = codes.astype(jnp.int8)
    elif fmt == "int4":
        values = pack_nibbles(int4_to_nibbles(codes))
    else:
        values = pack_nibbles(codes.astype(jnp.int32))
    return QuantizedMatrix(values, scales.astype(jnp.float32), fmt)


def quantize_matrix(w: jax.Array, fmt: str, group_size: int | None) -> QuantizedMatrix:
    """Round-to-nearest: ``w [k, n]`` in ``fmt`` (int8, int4 or nf4)."""
    scales = group_scales(w, fmt, group_size)
    return to_matrix(encode(w, scales, fmt), scales, fmt)


def served_scales(scales: jax.Array, fmt: str) -> jax.Array:
    """f32 ``[groups, n]``: the scales a stored weight dequantises with. NF4 stores its absmax
    values double-quantised (``stored.double_quantize``: 8-bit floats less their mean), so it
    computes with their round trip; the other formats store their scales as they are."""
    return absmax_values(double_quantize(scales)) if fmt == "nf4" else scales


def round_trip(w: jax.Array, fmt: str, group_size: int | None) -> jax.Array:
    """f32 ``[k, n]``: what the stored ``quantize_matrix(w)`` computes with (codes chosen with
    the float scales, read with the served ones)."""
    scales = group_scales(w, fmt, group_size)
    return decode(encode(w, scales, fmt), served_scales(scales, fmt), fmt)


def fake_quantize(w: jax.Array, fmt: str, group_size: int | None) -> jax.Array:
    """``w [k, n]`` rounded through ``fmt`` and back as the stored weight computes
    (:func:`round_trip`), with a straight-through gradient (the forward pass sees the
    quantized weight, the backward pass the identity)."""
    rounded = jax.lax.stop_gradient(round_trip(w, fmt, group_size)).astype(w.dtype)
    return w + jax.lax.stop_gradient(rounded - w)


__all__ = [
    "DEFAULT_GROUP_SIZES",
    "QTYPES",
    "decode",
    "encode",
    "fake_quantize",
    "group_scales",
    "quantize_matrix",
    "round_trip",
    "served_scales",
    "to_matrix",
]

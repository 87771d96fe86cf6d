"""Quantized weight formats shared by :mod:`ember.kernels_pallas.quantized_matmul` and the
model-side quantization (``ember.models.quantization``).

A quantized matrix ``W [k, n]`` (``k`` contracted) is ``values`` plus float ``scales [k //
group_size, n]``: rows ``[g * group_size, (g + 1) * group_size)`` share ``scales[g]``.

- ``int8``: ``values`` int8 ``[k, n]``, ``W = values * scales`` (per output channel: one group
  of ``k`` rows).
- ``int4``: signed 4-bit integers in ``[-8, 7]``, two per byte: ``values`` uint8 ``[k // 2,
  n]``, ``W = unpack(values) * scales`` (group-wise, 128 rows by default).
- ``nf4``: QLoRA's 4-bit NormalFloat, codes into :data:`NF4_CODE` packed the same way,
  ``W = NF4_CODE[unpack(values)] * scales`` (``scales``: each block's absmax, blocks of 64).

Packing: byte ``i`` of a column holds row ``2 i`` in its low nibble and row ``2 i + 1`` in
its high nibble, so a kernel multiplies the low nibbles by the even columns of ``x`` and
the high nibbles by the odd ones (no interleaving inside the kernel).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

FORMATS: tuple[str, ...] = ("int8", "int4", "nf4")
"""The weight formats, by name."""
PACKED_FORMATS: tuple[str, ...] = ("int4", "nf4")
"""Formats storing two 4-bit values per byte."""
NF4_CODE: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
"""The 16 values of 4-bit NormalFloat (QLoRA, appendix E): quantiles of N(0, 1) scaled to
[-1, 1], with an exact zero."""


def pack_nibbles(nibbles: jax.Array) -> jax.Array:
    """Two 4-bit values per byte along axis 0: ``[k, ...]`` ints in ``[0, 16)`` -> uint8
    ``[k // 2, ...]`` (row ``2 i`` in the low nibble, ``2 i + 1`` in the high one)."""
    if nibbles.shape[0] % 2:
        raise ValueError(f"pack_nibbles: axis 0 must have even length, got shape {nibbles.shape}")
    pairs = nibbles.astype(jnp.uint8).reshape(nibbles.shape[0] // 2, 2, *nibbles.shape[1:])
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """The inverse of :func:`pack_nibbles`: uint8 ``[k // 2, ...]`` -> int32 ``[k, ...]`` in
    ``[0, 16)``."""
    packed = packed.astype(jnp.int32)
    low, high = packed & 0xF, (packed >> 4) & 0xF
    return jnp.stack([low, high], axis=1).reshape(2 * packed.shape[0], *packed.shape[1:])


def int4_to_nibbles(values: jax.Array) -> jax.Array:
    """Signed ``[-8, 7]`` -> two's-complement nibbles ``[0, 16)``."""
    return values.astype(jnp.int32) & 0xF


def nibbles_to_int4(nibbles: jax.Array) -> jax.Array:
    """Nibbles ``[0, 16)`` -> signed ``[-8, 7]`` (int32)."""
    return jnp.where(nibbles >= 8, nibbles - 16, nibbles)


def nf4_lookup(codes: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``NF4_CODE[codes]`` as a chain of selects (what a GPU kernel can do; no gather)."""
    out = jnp.full(codes.shape, NF4_CODE[0], dtype)
    for code, value in enumerate(NF4_CODE[1:], start=1):
        out = jnp.where(codes == code, jnp.asarray(value, dtype), out)
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedMatrix:
    """A quantized ``[k, n]`` matrix (see the module docstring): ``values`` (int8 ``[k, n]``
    or packed uint8 ``[k // 2, n]``) and float ``scales [k // group_size, n]``."""

    values: jax.Array
    scales: jax.Array
    format: str = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, int]:
        rows = self.values.shape[0] * (2 if self.format in PACKED_FORMATS else 1)
        return rows, self.values.shape[1]

    @property
    def group_size(self) -> int:
        return self.shape[0] // self.scales.shape[0]

    def validate(self, op: str) -> None:
        """Raises ``ValueError`` naming the first field that does not fit its format."""
        if self.format not in FORMATS:
            raise ValueError(f"{op}: format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        want = jnp.int8 if self.format == "int8" else jnp.uint8
        if self.values.ndim != 2 or self.values.dtype != want:
            raise ValueError(
                f"{op}: {self.format} values must be {jnp.dtype(want).name} [rows, n], "
                f"got {self.values.dtype}{list(self.values.shape)}"
            )
        k, n = self.shape
        if self.scales.ndim != 2 or self.scales.shape[1] != n or not jnp.issubdtype(self.scales.dtype, jnp.floating):
            raise ValueError(
                f"{op}: scales must be float [groups, n={n}], got {self.scales.dtype}{list(self.scales.shape)}"
            )
        groups = self.scales.shape[0]
        if self.format == "int8" and groups != 1:
            raise ValueError(
                f"{op}: int8 scales are per output channel, [1, n={n}], got {groups} groups of rows "
                "(group-wise scales are for int4 and nf4)"
            )
        if groups < 1 or k % groups:
            raise ValueError(f"{op}: scales' {groups} groups must divide the weight's {k} rows")


def dequantize(weight: QuantizedMatrix, dtype=jnp.float32) -> jax.Array:
    """The float matrix ``[k, n]`` that ``weight`` stands for."""
    weight.validate("dequantize")
    if weight.format == "int8":
        values = weight.values.astype(jnp.float32)
    elif weight.format == "int4":
        values = nibbles_to_int4(unpack_nibbles(weight.values)).astype(jnp.float32)
    else:
        values = jnp.asarray(np.asarray(NF4_CODE, np.float32))[unpack_nibbles(weight.values)]
    scales = jnp.repeat(weight.scales.astype(jnp.float32), weight.group_size, axis=0)
    return (values * scales).astype(dtype)


__all__ = [
    "FORMATS",
    "NF4_CODE",
    "PACKED_FORMATS",
    "QuantizedMatrix",
    "dequantize",
    "int4_to_nibbles",
    "nf4_lookup",
    "nibbles_to_int4",
    "pack_nibbles",
    "unpack_nibbles",
]

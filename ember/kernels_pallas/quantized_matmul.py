"""Quantized matmul: float activations times a quantized weight, dequantised tile by tile.

``x [m, k] @ W [k, n]`` with ``W`` a :class:`~ember.kernels_pallas.quantized_formats.QuantizedMatrix`
(int8 per output channel, int4 group-wise, NF4 block-wise; see that module)::

    y = quantized_matmul(x, QuantizedMatrix(values, scales, "int4"))   # [m, n]

Forms:
- :func:`quantized_matmul_reference`: ``x @ dequantize(W)`` in f32, THE reference.
- ``impl="xla"``: the weight dequantised to ``x``'s dtype by XLA (which may fuse it into the
  product), then one dot with f32 accumulation. (A per-group batched dot, which never
  materialises the float weight, measured 2-4x slower on CPU at batch 8-64.)
- ``impl="pallas"`` / ``"interpret"``: a Pallas kernel over ``[block_m, block_n]`` output
  tiles that streams the weight's k-tiles (one scale group per tile for the 4-bit formats),
  unpacks nibbles, maps NF4 codes through their 16-entry table, multiplies in ``x``'s dtype
  with f32 accumulation and applies each tile's scales to its partial product. Packed rows
  meet ``x``'s even and odd columns (split outside the kernel), so nothing is interleaved.
  A decode step has one row tile, so a ``[1, n / block_n]`` grid would leave most of a GPU
  idle while reading the weight (32 programs for n = 4096 against an H100's 132 SMs): the
  contraction is split over a third grid axis until there are :data:`MIN_PROGRAMS`
  programs (split-K), and XLA sums the splits' f32 partial products. Rows of ``x``'s padding
  to ``block_m`` are not stored (a masked store), so a one-row decode step writes one row of
  partial products per split, not sixteen. ``QuantizedMatmulBlockSizes(one_row="vector")``
  gives a one-row call a kernel without the dot: the row times each weight tile, summed
  over ``k``. Tiles follow ``x``'s rows (:func:`default_block_sizes`): 16 rows for decode
  steps, 64 for prefill and training products.

Differentiable in ``x`` (the weight is frozen: QLoRA trains adapters beside it); the
backward pass is ``dy @ dequantize(W)^T`` through XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ember.kernels_pallas.dispatch import resolve_impl, triton_compiler_params
from ember.kernels_pallas.int_options import check_num_warps, check_positive_int, check_power_of_two
from ember.kernels_pallas.quantized_formats import (
    PACKED_FORMATS,
    QuantizedMatrix,
    dequantize,
    nf4_lookup,
    nibbles_to_int4,
)
from ember.kernels_pallas.sequence_padding import pad_axis_to_multiple

_NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b
# Programs a call should launch, splitting the contraction when the output tiles are fewer:
# about two waves of an H100's 132 SMs, so a decode step's weight read keeps HBM busy.
MIN_PROGRAMS = 256
ONE_ROW_PRODUCTS: tuple[str, ...] = ("dot", "vector")
DECODE_ROWS = 64  # rows up to which a call gets decode tiles (see default_block_sizes)
KERNEL_BACKENDS: tuple[str, ...] = ("gpu",)
"""Backends with a compiled Pallas kernel for this op (Triton lowering)."""


@dataclasses.dataclass(frozen=True)
class QuantizedMatmulBlockSizes:
    """Kernel tiles: ``block_m`` rows and ``block_n`` output columns per program; ``block_k``
    rows of the weight per step for int8 (4-bit formats step one scale group at a time).
    Powers of two, at least 16 (what GPU dots want); a dimension shorter than its tile gets
    the next power of two above it. ``num_warps``/``num_stages``: Triton's parameters.

    ``one_row``: how a call with a single row of ``x`` (a batch-1 decode step) multiplies:
    ``"dot"`` pads it to ``block_m`` rows for the tensor cores' dot; ``"vector"`` multiplies
    the weight tile by the row broadcast down its columns and sums over ``k`` on the CUDA
    cores (no padding, and no trip of the dequantised tile through shared memory into the
    dot's operand layout)."""

    block_m: int = 16
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    k_splits: int | None = None  # programs along the contraction; None: up to MIN_PROGRAMS in all
    one_row: str = "dot"

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            check_power_of_two(name, getattr(self, name), 16)
        check_num_warps("num_warps", self.num_warps)
        check_positive_int("num_stages", self.num_stages)
        check_positive_int("k_splits", self.k_splits, none_means=f"enough for {MIN_PROGRAMS} programs")
        if self.one_row not in ONE_ROW_PRODUCTS:
            raise ValueError(f"one_row must be one of {', '.join(ONE_ROW_PRODUCTS)}, got {self.one_row!r}")

    def splits(self, output_tiles: int, k_tiles: int) -> tuple[int, int]:
        """``(splits, k-tiles per split)`` for a grid of ``output_tiles`` over ``k_tiles``:
        ``k_splits``, or the fewest that make :data:`MIN_PROGRAMS` programs; no split empty."""
        wanted = self.k_splits or -(-MIN_PROGRAMS // output_tiles)
        per_split = -(-k_tiles // min(wanted, k_tiles))
        return -(-k_tiles // per_split), per_split


def default_block_sizes(rows: int) -> QuantizedMatmulBlockSizes:
    """The tiles a call with ``rows`` rows of ``x`` gets when it names none.

    Up to :data:`DECODE_ROWS` rows (decode steps): 16-row tiles. The row tiles that share a
    weight tile run next to each other (rows are the grid's fastest axis), so the weight
    comes from HBM about once, and split-K's f32 partials stay small: at 64 rows and n =
    4096, 64-row tiles would split k eight ways and write 8 MB of partials beside a 16 MB
    int8 weight.

    More rows (prefill, QLoRA's training products): 64-row tiles on 8 warps. Every program
    dequantises each weight tile it reads once for all its rows, and 16-row tiles made a
    16k-row product dequantise every weight tile 1,024 times. Compiled for sm_90 at 4096 x
    4096 x 4096 in bf16, 64-row tiles need 112 / 80 / 40 KB of shared memory and 94 / 128 /
    123 registers (int8 / int4 / NF4), without spilling; 128-row tiles took 160 / 128 / 64 KB
    and up to 244 registers."""
    if rows <= DECODE_ROWS:
        return QuantizedMatmulBlockSizes()
    return QuantizedMatmulBlockSizes(block_m=64, num_warps=8)


def _validate(op: str, x, weight) -> None:
    if not isinstance(weight, QuantizedMatrix):
        raise ValueError(f"{op}: weight must be a QuantizedMatrix, got {type(weight).__name__}")
    weight.validate(op)
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{op}: x must be a float array [m, k], got {x.dtype}{list(x.shape)}")
    if x.shape[1] != weight.shape[0]:
        raise ValueError(f"{op}: x has k={x.shape[1]} columns but the weight has {weight.shape[0]} rows")
    group = weight.group_size
    if weight.format in PACKED_FORMATS and (group < 16 or group & (group - 1)):
        raise ValueError(f"{op}: a {weight.format} group_size must be a power of two >= 16, got {group}")


def quantized_matmul_reference(x, weight: QuantizedMatrix, *, preferred_element_type=None):
    """The definition: ``x [m, k] @ dequantize(weight) [k, n]`` in f32, cast to
    ``preferred_element_type`` (default ``x.dtype``)."""
    _validate("quantized_matmul_reference", x, weight)
    y = jnp.dot(x.astype(jnp.float32), dequantize(weight), precision=lax.Precision.HIGHEST)
    return y.astype(preferred_element_type or x.dtype)


def _xla(x, weight: QuantizedMatrix, out_dtype):
    # XLA's CPU dot has no bf16 x bf16 -> f32 form: multiply in f32 there.
    dtype = jnp.float32 if jax.default_backend() == "cpu" else x.dtype
    product = jnp.dot(x.astype(dtype), dequantize(weight, dtype), preferred_element_type=jnp.float32)
    return product.astype(out_dtype)


def _fit(block: int, length: int) -> int:
    return min(block, max(16, 1 << max(0, length - 1).bit_length()))


def _kernel(*refs, fmt: str, block_k: int, k_tiles: int, per_split: int, rows_per_scale: int, x_rows: int):
    if fmt in PACKED_FORMATS:
        x_even_ref, x_odd_ref, values_ref, scales_ref, out_ref = refs
    else:
        x_ref, values_ref, scales_ref, out_ref = refs
    block_m = out_ref.shape[0]
    if block_m == 1:  # one_row="vector": [1, k] x [k, n] as a broadcast product summed over k

        def product(x_block, cols, w):
            x = x_block[0, cols].astype(jnp.float32)
            return jnp.sum(x[:, None] * w.astype(jnp.float32), axis=0, keepdims=True)

    else:

        def product(x_block, cols, w):
            x = x_block[:, cols]
            return lax.dot_general(x, w.astype(x.dtype), _NN_DIMS, preferred_element_type=jnp.float32)

    def step(t, acc):
        if fmt == "int8":
            rows = pl.ds(pl.multiple_of(t * block_k, block_k), block_k)
            return acc + product(x_ref, rows, values_ref[rows, :])
        half = block_k // 2
        rows = pl.ds(pl.multiple_of(t * half, half), half)
        packed = values_ref[rows, :].astype(jnp.int32)
        low, high = packed & 0xF, (packed >> 4) & 0xF
        if fmt == "int4":
            low, high = nibbles_to_int4(low), nibbles_to_int4(high)
        else:
            low, high = nf4_lookup(low), nf4_lookup(high)
        partial = product(x_even_ref, rows, low) + product(x_odd_ref, rows, high)
        scale = scales_ref[pl.ds(t * block_k // rows_per_scale, 1), :].astype(jnp.float32)
        return acc + partial * scale

    first = pl.program_id(2) * per_split  # this program's share of the contraction
    acc = lax.fori_loop(first, jnp.minimum(first + per_split, k_tiles), step, jnp.zeros(out_ref.shape, jnp.float32))
    if fmt == "int8":
        acc = acc * scales_ref[...].astype(jnp.float32)
    if x_rows % block_m == 0:
        out_ref[...] = acc.astype(out_ref.dtype)
        return
    # x's padding rows are zeros: not writing their products saves (block_m - m) / block_m of
    # the output's (or split-K partials') bytes, most of them in a one-row decode step.
    from jax.experimental.pallas import triton as pallas_triton  # GPU-only module: imported where used

    row = pl.program_id(0) * block_m + lax.broadcasted_iota(jnp.int32, acc.shape, 0)
    pallas_triton.store(out_ref, acc.astype(out_ref.dtype), mask=row < x_rows)


def _pallas(x, weight: QuantizedMatrix, out_dtype, block_sizes: QuantizedMatmulBlockSizes, interpret: bool):
    (m, k), n = x.shape, weight.shape[1]
    bm = 1 if m == 1 and block_sizes.one_row == "vector" else _fit(block_sizes.block_m, m)
    bn = _fit(block_sizes.block_n, n)
    scales = pad_axis_to_multiple(weight.scales, 1, bn)
    if weight.format == "int8":
        bk = _fit(block_sizes.block_k, k)
        x_parts = [pad_axis_to_multiple(pad_axis_to_multiple(x, 0, bm), 1, bk)]
        values = pad_axis_to_multiple(pad_axis_to_multiple(weight.values, 0, bk), 1, bn)
        k_pad = x_parts[0].shape[1]
    else:
        bk = weight.group_size  # one scale row per k-tile
        pairs = x.reshape(m, k // 2, 2)
        x_parts = [pad_axis_to_multiple(pairs[..., i], 0, bm) for i in (0, 1)]
        values = pad_axis_to_multiple(weight.values, 1, bn)
        k_pad = k
    m_pad, n_pad = x_parts[0].shape[0], values.shape[1]
    x_cols = x_parts[0].shape[1]
    k_tiles = k_pad // bk
    splits, per_split = block_sizes.splits((m_pad // bm) * (n_pad // bn), k_tiles)
    kernel = functools.partial(
        _kernel,
        fmt=weight.format,
        block_k=bk,
        k_tiles=k_tiles,
        per_split=per_split,
        rows_per_scale=weight.group_size,
        x_rows=m,
    )
    partial_dtype = out_dtype if splits == 1 else jnp.float32
    compiler_params = triton_compiler_params(
        interpret=interpret, num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
    )
    out = pl.pallas_call(
        kernel,
        grid=(m_pad // bm, n_pad // bn, splits),
        in_specs=[
            *[pl.BlockSpec((bm, x_cols), lambda i, j, s: (i, 0)) for _ in x_parts],
            pl.BlockSpec((values.shape[0], bn), lambda i, j, s: (0, j)),
            pl.BlockSpec((scales.shape[0], bn), lambda i, j, s: (0, j)),
        ],
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, m_pad, n_pad), partial_dtype),
        compiler_params=compiler_params,
        cost_estimate=pl.CostEstimate(
            flops=2 * m * k * n,
            transcendentals=0,
            bytes_accessed=x.dtype.itemsize * x.size
            + weight.values.size
            + scales.dtype.itemsize * scales.size
            + jnp.dtype(partial_dtype).itemsize * splits * m * n,  # padding rows are not written
        ),
        interpret=interpret,
        name=f"quantized_matmul_{weight.format}",
    )(*x_parts, values, scales)
    return out[0, :m, :n] if splits == 1 else out[:, :m, :n].sum(axis=0).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _differentiable(x, weight, forward, x_dtype):
    return forward(x, weight)


def _forward(x, weight, forward, x_dtype):
    return forward(x, weight), weight


def _backward(forward, x_dtype, weight, d_out):
    # d_x in x's dtype (as autodiff of a dot gives), not the output's preferred_element_type.
    d_x = jnp.dot(d_out.astype(jnp.float32), dequantize(weight).T).astype(x_dtype)
    zeros = jax.tree.map(
        lambda a: jnp.zeros(a.shape, jax.dtypes.float0) if a.dtype in (jnp.int8, jnp.uint8) else jnp.zeros_like(a),
        weight,
    )
    return d_x, zeros


_differentiable.defvjp(_forward, _backward)


@functools.partial(jax.jit, static_argnames=("impl", "preferred_element_type", "block_sizes"))
def quantized_matmul(x, weight: QuantizedMatrix, *, preferred_element_type=None, impl="auto", block_sizes=None):
    """``x [m, k]`` float times the quantized ``weight [k, n]``: ``[m, n]`` in
    ``preferred_element_type`` (default ``x.dtype``), accumulated in f32.

    ``impl`` in {"auto", "pallas", "interpret", "xla"} (no TPU kernel: on a TPU, "auto" runs
    XLA); ``block_sizes`` a
    :class:`QuantizedMatmulBlockSizes` for the kernel (None: :func:`default_block_sizes` for
    ``x``'s rows).

    Raises:
      ValueError: naming the argument whose shape, dtype or group size does not fit.
    """
    _validate("quantized_matmul", x, weight)
    if block_sizes is not None and not isinstance(block_sizes, QuantizedMatmulBlockSizes):
        raise ValueError(
            f"quantized_matmul: block_sizes must be a QuantizedMatmulBlockSizes, got {type(block_sizes).__name__}"
        )
    impl = resolve_impl(impl, op="quantized_matmul", kernel_backends=KERNEL_BACKENDS)
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    if impl == "xla" or 0 in (*x.shape, weight.shape[1]):  # an empty product: no tiles for the kernel's grid
        forward = functools.partial(_xla, out_dtype=out_dtype)
    else:
        forward = functools.partial(
            _pallas,
            out_dtype=out_dtype,
            block_sizes=block_sizes or default_block_sizes(x.shape[0]),
            interpret=impl == "interpret",
        )
    return _differentiable(x, weight, forward, x.dtype)


__all__ = [
    "KERNEL_BACKENDS",
    "QuantizedMatmulBlockSizes",
    "default_block_sizes",
    "quantized_matmul",
    "quantized_matmul_reference",
]

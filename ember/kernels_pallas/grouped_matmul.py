"""Grouped matmul: each contiguous run of rows times its group's matrix (MoE experts).

With ``lhs [m, k]``, ``rhs [groups, k, n]`` and ``group_sizes [groups]`` (int32, summing to at
most ``m``), rows ``[start_g, start_g + group_sizes[g])`` of ``lhs`` -- ``start_g`` the sum of
the earlier sizes -- are multiplied by ``rhs[g]``::

    out[start_g + i] = lhs[start_g + i] @ rhs[g]

This is the contract of ``jax.lax.ragged_dot``. Rows past ``sum(group_sizes)`` are
unspecified (this implementation writes zeros there).

``group_offset`` (expert parallelism): ``group_sizes`` counts the rows of every global group,
while ``rhs`` holds only the ``rhs.shape[0]`` local groups starting at global group
``group_offset``. Rows of global groups outside the local ones are unspecified (zeros here).

Forms:
- :func:`grouped_matmul_reference`: a loop over groups with row masks, THE reference.
- :func:`grouped_matmul` with ``impl="xla"``: ``jax.lax.ragged_dot`` (with a zero matrix for
  the rows before the local groups when ``group_offset`` is given).
- :func:`grouped_matmul` with ``impl="pallas"``: the tiled Pallas kernels for the backend,
  each a forward ``gmm``, ``d_lhs`` by ``gmm`` against ``rhs^T`` and ``d_rhs`` by the
  transposed ``tgmm``, tiles from :class:`GroupedMatmulBlockSizes`. On an NVIDIA GPU the
  Triton kernels of :mod:`ember.kernels_pallas.grouped_matmul_kernels` (``impl="interpret"``
  runs them in the Pallas interpreter); on a TPU the megablox-style Mosaic kernels of
  :mod:`ember.kernels_pallas.grouped_matmul_tpu` (``impl="interpret_tpu"`` runs them in TPU
  interpret mode), which take float32 and bfloat16 operands.

    out = grouped_matmul(tokens_by_expert, expert_weights, tokens_per_expert)   # [m, n]
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ember.kernels_pallas.dispatch import (
    kernel_platform,
    pallas_interpret,
    refuse_gpu_kernel_choice_off_gpu,
    resolve_impl,
)
from ember.kernels_pallas.grouped_matmul_kernels import grouped_matmul_kernel
from ember.kernels_pallas.grouped_matmul_tpu import grouped_matmul_tpu
from ember.kernels_pallas.int_options import check_num_warps, check_positive_int, check_power_of_two

KERNEL_BACKENDS: tuple[str, ...] = ("gpu", "tpu")
"""Backends with a compiled Pallas kernel for this op."""


@dataclasses.dataclass(frozen=True)
class GroupedMatmulBlockSizes:
    """Kernel tiles: ``block_m`` rows, ``block_k`` of the contracted dimension and ``block_n``
    output columns per step (the backward kernels use the same tiles: ``d_lhs`` contracts
    over ``n``, ``d_rhs`` over rows). Powers of two, at least 8 (GPU dots want 16+; 8 keeps
    CPU interpret tests cheap). On a GPU a dimension shorter than its tile gets the next
    power of two above it (at least 16) instead. On a TPU ``block_m`` is at least the
    dtype's sublanes (8 for float32, 16 for bfloat16) and ``block_k``/``block_n`` at least
    128 lanes, each shrunk to the whole dimension when that is shorter. ``num_warps`` and
    ``num_stages`` are the Triton compiler parameters on a GPU (unused on a TPU). Compiled
    for sm_90 at the MoE benchmark's Mixtral shape, these tiles with 4 warps and 3 stages
    spilled registers in the forward and ``d_lhs`` kernels (512 and 480 bytes); with 8 warps
    and 4 stages none of the three kernels spills (``python -m benchmarks.triton_compile``)."""

    block_m: int = 128
    block_k: int = 64
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_m", "block_k", "block_n"):
            check_power_of_two(name, getattr(self, name), 8)
        check_num_warps("num_warps", self.num_warps)
        check_positive_int("num_stages", self.num_stages)


def _validate(op, lhs, rhs, group_sizes, group_offset) -> None:
    """Raises ``ValueError`` naming the first argument whose shape or dtype is wrong."""
    if lhs.ndim != 2 or not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise ValueError(f"{op}: lhs must be a float array [m, k], got {lhs.dtype}{list(lhs.shape)}")
    if rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"{op}: rhs must be [groups, k={lhs.shape[1]}, n], got shape {rhs.shape}")
    if rhs.dtype != lhs.dtype:
        raise ValueError(f"{op}: rhs must have lhs's dtype {lhs.dtype}, got {rhs.dtype}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"{op}: group_sizes must be an integer array [groups], got {group_sizes.dtype}{list(group_sizes.shape)}"
        )
    if group_offset is None and group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(
            f"{op}: group_sizes must have one entry per rhs group ({rhs.shape[0]}), got {group_sizes.shape[0]}"
        )
    if group_offset is not None:
        if group_offset.shape not in ((), (1,)) or not jnp.issubdtype(group_offset.dtype, jnp.integer):
            raise ValueError(
                f"{op}: group_offset must be an integer scalar, got {group_offset.dtype}{list(group_offset.shape)}"
            )
        if group_sizes.shape[0] < rhs.shape[0]:
            raise ValueError(
                f"{op}: with group_offset, group_sizes counts every global group and must have at least "
                f"rhs's {rhs.shape[0]} local groups, got {group_sizes.shape[0]}"
            )


def _local_layout(group_sizes, num_local, group_offset):
    """``(rows before the local groups, the local groups' sizes [num_local])``."""
    group_sizes = group_sizes.astype(jnp.int32)
    if group_offset is None:
        return jnp.int32(0), group_sizes
    offset = jnp.reshape(group_offset, ()).astype(jnp.int32)
    before = jnp.sum(jnp.where(jnp.arange(group_sizes.shape[0]) < offset, group_sizes, 0))
    return before, jax.lax.dynamic_slice(group_sizes, (offset,), (num_local,))


def _local_bounds(group_sizes, num_local, group_offset, num_rows):
    """int32 ``[num_local + 1]``: local group ``g`` owns rows ``[bounds[g], bounds[g + 1])``
    (clipped to the ``num_rows`` rows there are)."""
    before, sizes = _local_layout(group_sizes, num_local, group_offset)
    bounds = before + jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes, dtype=jnp.int32)])
    return jnp.minimum(bounds, num_rows)


def grouped_matmul_reference(lhs, rhs, group_sizes, *, group_offset=None, preferred_element_type=None):
    """The definition: for every local group, the rows it owns times its matrix, summed.

    Args:
      lhs: ``[m, k]`` float.
      rhs: ``[groups, k, n]``, ``lhs``'s dtype (the local groups when ``group_offset`` is set).
      group_sizes: int ``[groups]`` (every global group when ``group_offset`` is set).
      group_offset: optional int scalar: the global index of ``rhs[0]``.
      preferred_element_type: output dtype; default ``lhs.dtype``. Products accumulate in f32.

    Returns:
      ``[m, n]``; rows outside the local groups are zero.
    """
    _validate("grouped_matmul_reference", lhs, rhs, group_sizes, group_offset)
    before, sizes = _local_layout(group_sizes, rhs.shape[0], group_offset)
    ends = before + jnp.cumsum(sizes)
    starts = ends - sizes
    rows = jnp.arange(lhs.shape[0])
    out = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
    for g in range(rhs.shape[0]):
        owned = ((rows >= starts[g]) & (rows < ends[g]))[:, None]
        product = jnp.dot(lhs, rhs[g], preferred_element_type=jnp.float32)
        out = out + jnp.where(owned, product, 0.0)
    return out.astype(preferred_element_type or lhs.dtype)


def _xla(lhs, rhs, group_sizes, group_offset, out_dtype):
    if group_offset is None:
        return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=out_dtype)
    # ragged_dot has no usable group_offset in jax 0.10: the rows before the local groups
    # become one extra leading group multiplied by zeros.
    before, sizes = _local_layout(group_sizes, rhs.shape[0], group_offset)
    padded = jnp.concatenate([jnp.zeros_like(rhs[:1]), rhs], axis=0)
    return jax.lax.ragged_dot(lhs, padded, jnp.concatenate([before[None], sizes]), preferred_element_type=out_dtype)


@functools.partial(jax.jit, static_argnames=("impl", "preferred_element_type", "block_sizes", "gpu_kernel"))
def grouped_matmul(
    lhs,
    rhs,
    group_sizes,
    *,
    group_offset=None,
    preferred_element_type=None,
    impl="auto",
    block_sizes=None,
    gpu_kernel="auto",
):
    """``lhs [m, k]`` rows grouped contiguously by ``group_sizes`` times ``rhs [groups, k, n]``.

    Same arguments and result as :func:`grouped_matmul_reference`, plus ``impl`` in
    {"auto", "pallas", "interpret", "interpret_tpu", "xla"} and, for the kernels,
    ``block_sizes`` (a :class:`GroupedMatmulBlockSizes`; default tiles if None).
    Differentiable in ``lhs`` and ``rhs`` (the gradients are ``lhs``'s and ``rhs``'s dtypes).
    ``gpu_kernel``: the GPU kernels' forward (and ``d_lhs``): ``"auto"`` (today Triton's),
    ``"triton"`` or ``"hopper"`` (Mosaic GPU on sm90, bf16/f16 operands; raises naming the
    reason elsewhere). Anything but ``"auto"`` needs the GPU kernels.

    Raises:
      ValueError: naming a malformed argument; for the TPU kernel, operands other than
        float32 or bfloat16.
    """
    _validate("grouped_matmul", lhs, rhs, group_sizes, group_offset)
    if block_sizes is not None and not isinstance(block_sizes, GroupedMatmulBlockSizes):
        raise ValueError(
            f"grouped_matmul: block_sizes must be a GroupedMatmulBlockSizes, got {type(block_sizes).__name__}"
        )
    impl = resolve_impl(impl, op="grouped_matmul", kernel_backends=KERNEL_BACKENDS)
    out_dtype = preferred_element_type or lhs.dtype
    platform = kernel_platform(impl)
    refuse_gpu_kernel_choice_off_gpu("gpu_kernel", gpu_kernel, impl=impl, platform=platform, op="grouped_matmul: ")
    if platform is None:
        return _xla(lhs, rhs, group_sizes, group_offset, out_dtype)
    bounds = _local_bounds(group_sizes, rhs.shape[0], group_offset, lhs.shape[0])
    block_sizes = block_sizes or GroupedMatmulBlockSizes()
    interpret = pallas_interpret(impl)
    if platform == "tpu":
        return grouped_matmul_tpu(lhs, rhs, bounds, block_sizes=block_sizes, out_dtype=out_dtype, interpret=interpret)
    return grouped_matmul_kernel(
        lhs, rhs, bounds, block_sizes=block_sizes, out_dtype=out_dtype, interpret=interpret, gpu_kernel=gpu_kernel
    )


__all__ = ["KERNEL_BACKENDS", "GroupedMatmulBlockSizes", "grouped_matmul", "grouped_matmul_reference"]

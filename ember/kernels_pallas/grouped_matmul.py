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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ember.kernels_pallas.dispatch import resolve_impl

KERNEL_BACKENDS: tuple[str, ...] = ()
"""Backends with a compiled Pallas kernel for this op."""


def _validate(op, lhs, rhs, group_sizes, group_offset) -> None:
    """Raises ``ValueError`` naming the first argument whose shape or dtype is wrong."""
    if lhs.ndim != 2 or not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise ValueError(f"{op}: lhs must be a float array [m, k], got {lhs.dtype}{list(lhs.shape)}")
    if rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"{op}: rhs must be [groups, k={lhs.shape[1]}, n], got shape {rhs.shape}")
    if rhs.dtype != lhs.dtype:
        raise ValueError(f"{op}: rhs must have lhs's dtype {lhs.dtype}, got {rhs.dtype}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{op}: group_sizes must be an integer array [groups], got {group_sizes.dtype}")
    if group_offset is None and group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(
            f"{op}: group_sizes must have one entry per rhs group ({rhs.shape[0]}), got {group_sizes.shape[0]}"
        )
    if group_offset is not None:
        if group_offset.shape not in ((), (1,)) or not jnp.issubdtype(group_offset.dtype, jnp.integer):
            raise ValueError(f"{op}: group_offset must be an integer scalar, got {group_offset.dtype}")
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


@functools.partial(jax.jit, static_argnames=("impl", "preferred_element_type"))
def grouped_matmul(lhs, rhs, group_sizes, *, group_offset=None, preferred_element_type=None, impl="auto"):
    """``lhs [m, k]`` rows grouped contiguously by ``group_sizes`` times ``rhs [groups, k, n]``.

    Same arguments and result as :func:`grouped_matmul_reference`, plus ``impl`` in
    {"auto", "pallas", "interpret", "xla"}. Differentiable in ``lhs`` and ``rhs``.
    """
    _validate("grouped_matmul", lhs, rhs, group_sizes, group_offset)
    impl = resolve_impl(impl, op="grouped_matmul", kernel_backends=KERNEL_BACKENDS)
    out_dtype = preferred_element_type or lhs.dtype
    if impl == "xla":
        return _xla(lhs, rhs, group_sizes, group_offset, out_dtype)
    raise NotImplementedError("grouped_matmul: the Pallas kernel is being written; use impl='xla'")


__all__ = ["KERNEL_BACKENDS", "grouped_matmul", "grouped_matmul_reference"]

"""Padding an axis up to a multiple of a block size, so a kernel grid tiles it exactly.

Kernels pad, run on whole blocks, mask the padded positions inside, and slice the result
back to the original length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def round_up(length: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= length``."""
    return -(-length // multiple) * multiple


def pad_axis_to_multiple(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
    """``x`` padded at the end of ``axis`` with ``value`` to a length divisible by ``multiple``
    (``x`` itself when it already is)."""
    length = x.shape[axis]
    extra = round_up(length, multiple) - length
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)

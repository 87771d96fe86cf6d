"""GPTQ (Frantar et al., 2022): quantize a matrix column by column, compensating each
column's rounding error in the columns not yet quantized, weighted by the inverse Hessian of
the layer's output error ``H = X^T X`` (``X``: the layer's calibration inputs).

Written here rather than taken from qwix's ``contrib.gptq_core``: that one unrolls its column
loop in Python (44 s to compile one 256-column matrix on a CPU); this one runs each block's
columns in a ``lax.fori_loop``, with the same scales and codes (``ember.models.quantization.numerics``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ember.kernels_pallas.quantized_formats import QuantizedMatrix
from ember.models.quantization.numerics import decode, encode, group_scales, to_matrix

BLOCK = 128
"""Columns per lazy-update block (the paper's B) when the format has one scale per channel."""


def inverse_hessian_factor(gram: jax.Array, damp: float) -> jax.Array:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) I)^-1`` ``[k, k]``; inputs that were
    never active (zero diagonal) get a unit diagonal (their weights are then free to be zero)."""
    k = gram.shape[0]
    diag = jnp.diag(gram)
    gram = jnp.where(jnp.eye(k, dtype=bool) & (diag == 0)[:, None], 1.0, gram)
    gram = gram + damp * jnp.mean(jnp.diag(gram)) * jnp.eye(k)
    lower = jnp.linalg.cholesky(gram)
    inverse = jax.scipy.linalg.cho_solve((lower, True), jnp.eye(k))
    return jnp.linalg.cholesky(inverse).T


@jax.jit(static_argnames=("fmt", "group_size", "damp"))
def gptq_matrix(w: jax.Array, gram: jax.Array, fmt: str, group_size: int | None, damp: float = 0.01) -> QuantizedMatrix:
    """GPTQ's quantization of ``w [k, n]`` (``k`` input rows) given ``gram = X^T X [k, k]``.

    Scales are chosen per group of ``group_size`` input rows (all ``k`` when None) from the
    error-compensated weights when the group starts, as the paper's grouped variant does.
    """
    k = w.shape[0]
    dead = jnp.diag(gram) == 0
    weights = jnp.where(dead[:, None], 0.0, w.astype(jnp.float32))  # [k, n]: rows are GPTQ's columns
    hinv = inverse_hessian_factor(gram.astype(jnp.float32), damp)
    group = k if group_size is None else group_size
    block = group if group < k else min(BLOCK, k)
    scales_all = None if group < k else group_scales(weights, fmt, None)
    codes, scales = [], []
    for start in range(0, k, block):
        stop = min(start + block, k)
        rows = weights[start:stop]
        scale = group_scales(rows, fmt, None) if scales_all is None else scales_all
        if scales_all is None:
            scales.append(scale)
        h_block = hinv[start:stop, start:stop]

        def column(i, carry, h_block=h_block, scale=scale):
            rows, errors, block_codes = carry
            row = jax.lax.dynamic_slice_in_dim(rows, i, 1)  # [1, n]
            code = encode(row, scale, fmt)
            error = (row - decode(code, scale, fmt)) / h_block[i, i]
            # h_block is upper triangular: rows before i are not touched.
            rows = rows - h_block[i][:, None] * error
            errors = jax.lax.dynamic_update_slice_in_dim(errors, error, i, 0)
            block_codes = jax.lax.dynamic_update_slice_in_dim(block_codes, code.astype(jnp.int32), i, 0)
            return rows, errors, block_codes

        init = (rows, jnp.zeros_like(rows), jnp.zeros(rows.shape, jnp.int32))
        _, errors, block_codes = jax.lax.fori_loop(0, stop - start, column, init)
        codes.append(block_codes)
        weights = weights.at[stop:].add(-hinv[start:stop, stop:].T @ errors)
    return to_matrix(jnp.concatenate(codes), jnp.concatenate(scales) if scales else scales_all, fmt)


__all__ = ["gptq_matrix", "inverse_hessian_factor"]

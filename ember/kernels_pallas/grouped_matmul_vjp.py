"""The ``custom_vjp`` of the grouped matmul, one for its GPU and its TPU kernels.

With ``out[r] = lhs[r] @ rhs[g]`` for the rows ``r`` of local group ``g``, the gradients
are grouped matmuls again: ``d_lhs = gmm(d_out, rhs^T)`` and, per group, ``d_rhs[g] =
lhs_g^T @ d_out_g`` (``tgmm``). Each backend supplies its own ``gmm`` and ``tgmm`` kernels.
"""

from __future__ import annotations

import functools

import jax


def grouped_matmul_vjp(gmm, tgmm):
    """``matmul(lhs, rhs, bounds, config) -> [m, n]``, differentiable in ``lhs`` and ``rhs``.

    ``gmm(lhs, rhs, bounds, config, *, transpose_rhs=False, out_dtype=None)`` and
    ``tgmm(lhs, d_out, bounds, config, *, out_dtype)`` are a backend's kernels (see
    :mod:`ember.kernels_pallas.grouped_matmul_kernels`); ``bounds`` (int32 ``[groups + 1]``)
    gets no cotangent; ``config`` is static (hashable).
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def matmul(lhs, rhs, bounds, config):
        return gmm(lhs, rhs, bounds, config)

    def matmul_fwd(lhs, rhs, bounds, config):
        return gmm(lhs, rhs, bounds, config), (lhs, rhs, bounds)

    def matmul_bwd(config, residuals, d_out):
        lhs, rhs, bounds = residuals
        d_out = d_out.astype(lhs.dtype)  # the dots run in the operands' dtype, accumulating in f32
        d_lhs = gmm(d_out, rhs, bounds, config, transpose_rhs=True, out_dtype=lhs.dtype)
        d_rhs = tgmm(lhs, d_out, bounds, config, out_dtype=rhs.dtype)
        return d_lhs, d_rhs, None

    matmul.defvjp(matmul_fwd, matmul_bwd)
    return matmul

"""Orthogonal initialisation that is safe to ``vmap`` on XLA:CPU.

``orthogonal(gain)`` draws the same distribution as ``jax.nn.initializers.orthogonal``
(a Haar-random orthogonal matrix from the QR of a Gaussian one, signs fixed by ``R``'s
diagonal, times ``gain``). The difference is how it batches: under ``jax.vmap`` (many
seeds of one jitted RL run) it factorises one matrix at a time instead of calling the
batched LAPACK QR. On XLA:CPU (jaxlib 0.10) the batched QR fans its batch out onto the
intra-op thread pool from inside a pool worker and waits; two such QRs running at once
(an actor's and a critic's layers) can occupy every worker of a small pool and wait
forever. That hang was seen with PPO vmapped over 4-8 seeds on a 2-core machine.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


@jax.custom_batching.custom_vmap
def orthonormal_columns(matrix: jax.Array) -> jax.Array:
    """The ``Q`` of ``matrix [rows, cols]`` (``rows >= cols``) with ``R``'s diagonal made
    positive, so that ``Q`` is Haar-distributed for a Gaussian ``matrix``."""
    q, r = jnp.linalg.qr(matrix)
    return q * jnp.where(jnp.diag(r) < 0, -1.0, 1.0).astype(q.dtype)[None, :]


@orthonormal_columns.def_vmap
def _orthonormal_columns_batched(axis_size, in_batched, matrix):
    del axis_size, in_batched  # the only argument is the batched one
    return jax.lax.map(orthonormal_columns, matrix), True


def orthogonal(gain: float = 1.0):
    """A Flax/JAX initializer ``init(key, shape, dtype)``: the kernel reshaped to
    ``[prod(shape[:-1]), shape[-1]]`` has orthonormal rows or columns (whichever are
    fewer), times ``gain``. For dense ``[in, out]`` and conv ``[..., in, out]`` kernels."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
        if len(shape) < 2:
            raise ValueError(f"orthogonal initialisation needs a shape of rank >= 2, got {shape}")
        rows, cols = math.prod(shape[:-1]), shape[-1]
        gaussian = jax.random.normal(key, (max(rows, cols), min(rows, cols)), jnp.float32)
        q = orthonormal_columns(gaussian)
        q = q if rows >= cols else q.T
        return (gain * q).reshape(shape).astype(dtype)

    return init


__all__ = ["orthogonal", "orthonormal_columns"]

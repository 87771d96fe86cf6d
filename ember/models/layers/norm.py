"""RMSNorm and LayerNorm: the math as plain functions, the modules add a scale (and bias).

Statistics are computed in float32 whatever the input dtype (as Llama/Qwen checkpoints
expect), then the result is cast back.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``x / rms(x) * scale`` over the last axis. ``x [..., dim]``, ``scale [dim]``."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """``(x - mean) / std * scale + bias`` over the last axis. ``x [..., dim]``."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nn.Module):
    """RMS normalisation with a learned per-channel scale (initialised to one).

    ``axis_name`` is the logical axis of the normalised dimension (``embed`` for the
    residual stream, ``head_dim`` for QK-norm).
    """

    eps: float = 1e-6
    axis_name: str = "embed"
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
            (x.shape[-1],),
            self.param_dtype,
        )
        return rms_norm(x, scale, self.eps)


class LayerNorm(nn.Module):
    """Layer normalisation with a learned scale (ones) and bias (zeros)."""

    eps: float = 1e-5
    axis_name: str = "embed"
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = (x.shape[-1],)
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)), shape, self.param_dtype
        )
        bias = self.param(
            "bias", nn.with_logical_partitioning(nn.initializers.zeros, (self.axis_name,)), shape, self.param_dtype
        )
        return layer_norm(x, scale, bias, self.eps)


def make_norm(
    kind: str, eps: float, *, axis_name: str = "embed", param_dtype=jnp.float32, name: str | None = None
) -> nn.Module:
    """The norm module for ``kind`` in {"rmsnorm", "layernorm"}."""
    if kind == "rmsnorm":
        return RMSNorm(eps=eps, axis_name=axis_name, param_dtype=param_dtype, name=name)
    if kind == "layernorm":
        return LayerNorm(eps=eps, axis_name=axis_name, param_dtype=param_dtype, name=name)
    raise ValueError(f"norm kind must be 'rmsnorm' or 'layernorm', got {kind!r}")

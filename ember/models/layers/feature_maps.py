"""Feature maps for linear attention: ``phi(q) . phi(k)`` stands in for ``exp(q . k)``.

- ``elu``: ``elu(x) + 1`` (Katharopoulos et al., 2020), positive, same width.
- ``relu``: ``relu(x)``, non-negative, same width.
- ``hedgehog``: ``[softmax(x W), softmax(-x W)]`` with a learned per-head ``W [heads,
  head_dim, feature_dim]`` initialised to the identity (Zhang et al., 2024, "The Hedgehog &
  the Porcupine"): trained to mimic softmax attention when linearising a model; output
  width ``2 * feature_dim``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.models.config import FEATURE_MAPS


def elu_plus_one(x: jax.Array) -> jax.Array:
    return jax.nn.elu(x) + 1.0


def relu_features(x: jax.Array) -> jax.Array:
    return jax.nn.relu(x)


def hedgehog_features(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``x [batch, seq, heads, head_dim]``, ``weight [heads, head_dim, feature_dim]`` ->
    ``[batch, seq, heads, 2 * feature_dim]``; softmax in float32."""
    projected = jnp.einsum("bshd,hdf->bshf", x.astype(jnp.float32), weight.astype(jnp.float32))
    features = jnp.concatenate([jax.nn.softmax(projected, axis=-1), jax.nn.softmax(-projected, axis=-1)], axis=-1)
    return features.astype(x.dtype)


def _identity_init(key, shape, dtype=jnp.float32):
    """``[heads, head_dim, feature_dim]``: identity blocks (truncated or zero-padded)."""
    _heads, head_dim, feature_dim = shape
    return jnp.broadcast_to(jnp.eye(head_dim, feature_dim, dtype=dtype), shape)


class FeatureMap(nn.Module):
    """Applies the feature map ``kind`` to ``x [batch, seq, heads, head_dim]``."""

    kind: str = "elu"
    feature_dim: int = 0
    """Hedgehog projection width (0: ``head_dim``)."""
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.kind == "elu":
            return elu_plus_one(x)
        if self.kind == "relu":
            return relu_features(x)
        if self.kind == "hedgehog":
            heads, head_dim = x.shape[-2:]
            weight = self.param(
                "weight",
                nn.with_logical_partitioning(_identity_init, ("heads", "head_dim", None)),
                (heads, head_dim, self.feature_dim or head_dim),
                self.param_dtype,
            )
            return hedgehog_features(x, weight)
        raise ValueError(f"feature map must be one of {', '.join(FEATURE_MAPS)}; got {self.kind!r}")

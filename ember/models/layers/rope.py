"""Rotary position embeddings (RoPE) with the scalings real checkpoints use.

Layout follows Hugging Face Llama ("rotate half"): channel ``i`` pairs with channel
``i + head_dim / 2``, so imported q/k projections need no permutation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ember.models.config import RopeConfig


def rope_inverse_frequencies(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """The ``[head_dim // 2]`` inverse frequencies, after ``rope.scaling``.

    ``linear`` divides every frequency by ``factor`` (positions interpolated); ``llama3``
    divides only long wavelengths (longer than ``original_max_len / low_freq_factor``),
    keeps short ones (shorter than ``original_max_len / high_freq_factor``) and blends in
    between, as in Llama 3.1.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope.scaling == "linear":
        return (inv_freq / rope.factor).astype(np.float32)
    if rope.scaling == "llama3":
        low_freq_wavelen = rope.original_max_len / rope.low_freq_factor
        high_freq_wavelen = rope.original_max_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rope.original_max_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(is_medium, blended, scaled).astype(np.float32)
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array | np.ndarray) -> jax.Array:
    """Rotates ``x [batch, seq, heads, head_dim]`` by ``positions [batch, seq]``.

    ``inv_freq [head_dim // 2]`` comes from :func:`rope_inverse_frequencies`. Angles are
    computed in float32; the result has ``x``'s dtype.
    """
    if x.ndim != 4 or positions.shape != x.shape[:2]:
        raise ValueError(
            "apply_rope: x must be [batch, seq, heads, head_dim] and positions [batch, seq]; "
            f"got {x.shape} and {positions.shape}"
        )
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [batch, seq, head_dim/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)

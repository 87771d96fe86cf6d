"""Score math shared by the attention references and kernels (one definition of each)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ember.core.integers import is_integer


def default_sigmoid_bias(kv_len: int) -> float:
    """The FlashSigmoid default bias ``b = -log(kv_len)`` of ``score="sigmoid"``: it keeps
    the expected attention mass per query near one at initialization, as softmax does."""
    return -math.log(kv_len)


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(logits / cap)`` (Gemma-2 logit soft-capping); ``logits`` if ``cap`` is None."""
    if cap is None:
        return logits
    return cap * jnp.tanh(logits / cap)


@jax.custom_jvp
def masked_softmax(logits: jax.Array, visible: jax.Array) -> jax.Array:
    """Softmax over the last axis restricted to ``visible`` entries (broadcastable bool).
    A row with no visible entry gets all-zero weights (and zero gradient), never NaN.

    Differentiated by softmax's own rule, ``dy = y * (dx - sum(y * dx))``, as
    ``jax.nn.softmax`` is: autodiff through the masked formula built a backward of several
    more passes over the scores."""
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnormalized = jnp.exp(logits - row_max)  # exp(-inf) = 0 where not visible
    total = jnp.sum(unnormalized, axis=-1, keepdims=True)
    return unnormalized / jnp.where(total == 0.0, 1.0, total)


@masked_softmax.defjvp
def _masked_softmax_jvp(primals, tangents):
    logits, visible = primals
    logits_dot, _ = tangents
    weights = masked_softmax(logits, visible)
    return weights, weights * (logits_dot - jnp.sum(weights * logits_dot, axis=-1, keepdims=True))


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: jax.Array,
    *,
    sm_scale: float,
    logits_soft_cap: float | None,
    score: str,
    sigmoid_bias: float | None,
) -> jax.Array:
    """The attention math every op's reference is built on, densely in float32.

    Args:
      q: ``[n, q_len, heads, head_dim]``; k, v: ``[n, kv_len, kv_heads, head_dim]`` with
        ``heads % kv_heads == 0`` (query head ``h`` reads key head ``h // (heads // kv_heads)``).
      visible: bool, broadcastable to ``[n, q_len, kv_len]``: which keys each query sees.
      sm_scale: multiplies ``q.k``; logits_soft_cap: ``cap * tanh(logits / cap)`` if set.
      score: ``"softmax"`` (normalised over the visible keys; a row seeing none gets zeros)
        or ``"sigmoid"`` (each visible key weighted by ``sigmoid(logits + sigmoid_bias)``).

    Returns:
      ``[n, q_len, heads, head_dim]`` float32.
    """
    n, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    # The query heads that read one key head lie side by side along the query axis, so each
    # product is one matmul per (row, key head): [n, kv_heads, group * q_len, head_dim]. An
    # einsum with the group as a second batch axis compiled to transposes around both dots,
    # 2-3x slower forward+backward on CPU.
    q32 = q.astype(jnp.float32).reshape(n, q_len, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    q32 = q32.reshape(n, kv_heads, group * q_len, head_dim)
    logits = jnp.einsum("nhqd,nkhd->nhqk", q32, k.astype(jnp.float32)) * sm_scale
    logits = soft_cap(logits, logits_soft_cap).reshape(n, kv_heads, group, q_len, kv_len)
    visible = jnp.asarray(visible)[:, None, None]  # [n or 1, 1, 1, q_len, kv_len]
    if score == "sigmoid":
        weights = jnp.where(visible, jax.nn.sigmoid(logits + sigmoid_bias), 0.0)
    else:
        weights = masked_softmax(logits, visible)
    weights = weights.reshape(n, kv_heads, group * q_len, kv_len)
    out = jnp.einsum("nhqk,nkhd->nhqd", weights, v.astype(jnp.float32))
    return out.reshape(n, kv_heads, group, q_len, head_dim).transpose(0, 3, 1, 2, 4).reshape(n, q_len, heads, head_dim)


def check_window(window) -> tuple[int, int] | None:
    """``window`` validated as a pair ``(left, right)`` of non-negative ints, or ``None``."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(is_integer(w) and w >= 0 for w in window):
        raise ValueError(f"window must be a pair (left, right) of non-negative ints, got {window!r}")
    return int(window[0]), int(window[1])


def check_sm_scale(sm_scale, head_dim: int) -> float:
    """``sm_scale`` as a float: ``1 / sqrt(head_dim)`` for None, else a finite real number (any
    sign: 0 attends uniformly); a NaN or infinite scale would make every score NaN."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if (
        isinstance(sm_scale, (bool, np.bool_))
        or not isinstance(sm_scale, (int, float, np.integer, np.floating))
        or not math.isfinite(sm_scale)
    ):
        raise ValueError(f"sm_scale must be a finite number, or None for 1/sqrt(head_dim), got {sm_scale!r}")
    return float(sm_scale)


def check_soft_cap(logits_soft_cap) -> float | None:
    """``logits_soft_cap`` validated as a positive finite float, or ``None`` (no cap; an
    infinite cap would make ``cap * tanh(logits / cap)`` ``inf * 0 = NaN``)."""
    if logits_soft_cap is None:
        return None
    if (
        not isinstance(logits_soft_cap, (int, float, np.integer, np.floating))
        or not logits_soft_cap > 0
        or not math.isfinite(logits_soft_cap)
    ):
        raise ValueError(f"logits_soft_cap must be a positive finite number or None, got {logits_soft_cap!r}")
    return float(logits_soft_cap)

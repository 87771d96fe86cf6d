"""The math of the linearised attention layer (LoLCATs, Zhang et al., 2024): exact softmax
attention over a sliding window of the last ``window`` tokens, linear attention over every
earlier token, and one normaliser shared by the two::

    s_j   = q_t . k_j * sm_scale                        (1 / sqrt(head_dim) by default; soft-capped
                                                          as the teacher's scores)
    m_t   = the largest s_j over the window W_t = {j : t - window < j <= t}
    num_t = factor * sum_{j in W_t} exp(s_j - m_t) v_j + sum_{j <= t - window} (phi_q(q_t) . phi_k(k_j)) v_j
    den_t = factor * sum_{j in W_t} exp(s_j - m_t)     + sum_{j <= t - window}  phi_q(q_t) . phi_k(k_j)
    out_t = num_t / den_t

``factor [heads]`` is the learned per-head mix (a sigmoid). The token itself is in its window, so
``den_t >= factor > 0``. Keys of another document (``segment_ids``) are never seen.

Three forms of the same function:

- :func:`window_linear_reference`: masked ``[seq, seq]`` matrices; the reference.
- :func:`window_linear_attention`: linear in ``seq``. The window part runs in blocks of
  ``window`` queries, each attending to its own and the previous block's keys; the linear
  part is ``linear_attention`` over keys delayed by ``window`` positions.
- :func:`ragged_window_linear_attention`: one serving step's flat token budget. Each token's
  window comes from :func:`step_windows` (the step's own tokens, else its sequence's slot of
  the last ``window`` keys and values); the recurrent state holds the keys that have left the
  window, so a sequence's memory is ``window`` keys plus one state, whatever its length.

Heads: ``q [.., heads, head_dim]``, ``k``/``v [.., kv_heads, head_dim]`` (grouped-query: query
head ``h`` reads key head ``h // (heads // kv_heads)``); ``q_features [.., heads, features]``,
``k_features [.., kv_heads, features]``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ember.kernels_pallas.attention_math import soft_cap as capped
from ember.kernels_pallas.linear_attention import KERNEL_BACKENDS as LINEAR_KERNEL_BACKENDS
from ember.kernels_pallas.linear_attention import linear_attention
from ember.models.cache import Paging, run_history
from ember.models.layers.kernel_shards import per_head_group_shard, runs_per_shard
from ember.models.layers.linear_attention import ragged_linear_sums

_F32 = jnp.float32


def _scores(q: jax.Array, k: jax.Array, spec: str, soft_cap: float, sm_scale: float | None) -> jax.Array:
    scale = 1 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    return capped(jnp.einsum(spec, q.astype(_F32), k.astype(_F32)) * scale, soft_cap or None)


def _combine(window_num, window_den, linear_sums, factor) -> jax.Array:
    """``[.., heads, head_dim]`` from the window's sums and the linear part's ``[.., heads,
    head_dim + 1]`` (normaliser last); ``factor [heads]``."""
    factor = factor.astype(_F32)
    num = factor[:, None] * window_num + linear_sums[..., :-1]
    den = factor * window_den + linear_sums[..., -1]
    return num / den[..., None]


def window_linear_reference(
    q, k, v, q_features, k_features, factor, *, window: int, segment_ids=None, soft_cap: float = 0.0,
    sm_scale: float | None = None,
) -> jax.Array:  # fmt: skip
    """The layer's attention by its definition (module docstring), ``O(seq^2)``.

    Args:
      q: ``[batch, seq, heads, head_dim]``; k, v: ``[batch, seq, kv_heads, head_dim]``.
      q_features: ``[batch, seq, heads, features]``; k_features ``[batch, seq, kv_heads, features]``.
      factor: ``[heads]``, the window's weight; window: tokens of exact attention (>= 1).
      segment_ids: ``[batch, seq]`` packed-document ids, or None.

    Returns:
      ``[batch, seq, heads, head_dim]`` in v's dtype.
    """
    batch, seq, heads, _ = q.shape
    repeat = heads // k.shape[2]
    k, v, k_features = (jnp.repeat(x, repeat, axis=2) for x in (k, v, k_features))
    scores = _scores(q, k, "bqhd,bkhd->bhqk", soft_cap, sm_scale)
    query, key = jnp.arange(seq)[:, None], jnp.arange(seq)[None, :]
    segments = jnp.zeros((batch, seq), jnp.int32) if segment_ids is None else segment_ids
    same = (segments[:, :, None] == segments[:, None, :])[:, None]
    in_window = same & (key <= query) & (key > query - window)
    before = same & (key <= query - window)
    top = jnp.max(jnp.where(in_window, scores, -jnp.inf), axis=-1, keepdims=True)
    weights = factor.astype(_F32)[:, None, None] * jnp.where(in_window, jnp.exp(scores - top), 0.0)
    linear = jnp.einsum("bqhf,bkhf->bhqk", q_features.astype(_F32), k_features.astype(_F32))
    weights = weights + jnp.where(before, linear, 0.0)
    out = (
        jnp.einsum("bhqk,bkhd->bqhd", weights, v.astype(_F32)) / jnp.sum(weights, axis=-1).transpose(0, 2, 1)[..., None]
    )
    return out.astype(v.dtype)


def window_linear_attention(
    q, k, v, q_features, k_features, factor, *, window: int, segment_ids=None, soft_cap: float = 0.0,
    sm_scale: float | None = None, impl="auto",
) -> jax.Array:  # fmt: skip
    """:func:`window_linear_reference` in time and memory linear in ``seq`` (same arguments;
    ``impl`` is the linear part's ``linear_attention`` implementation)."""
    window_num, window_den = _blocked_window_sums(q, k, v, window, segment_ids, soft_cap, sm_scale)
    linear_sums = _delayed_linear_sums(q_features, k_features, v, window, segment_ids, impl)
    return _combine(window_num, window_den, linear_sums, factor).astype(v.dtype)


def _blocked_window_sums(q, k, v, window, segment_ids, soft_cap, sm_scale) -> tuple[jax.Array, jax.Array]:
    """``(sum exp(s - m) v [batch, seq, heads, head_dim], sum exp(s - m) [batch, seq, heads])``
    over each query's window, float32: queries in blocks of ``min(window, seq)``, each block
    against its own and the previous block's keys (``[2 * block]`` scores per query)."""
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    block = min(window, seq)
    blocks = -(-seq // block)

    def blocked(x):  # [batch, seq, ...] -> [batch, blocks, block, ...], zero-padded
        pad = [(0, 0), (0, blocks * block - seq)] + [(0, 0)] * (x.ndim - 2)
        return jnp.pad(x, pad).reshape(batch, blocks, block, *x.shape[2:])

    def with_previous(x):  # [batch, blocks, block, ...] -> [batch, blocks, 2 * block, ...]
        previous = jnp.pad(x, [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2))[:, :-1]
        return jnp.concatenate([previous, x], axis=2)

    queries = blocked(q).reshape(batch, blocks, block, kv_heads, heads // kv_heads, head_dim)
    keys, values = with_previous(blocked(k)), with_previous(blocked(v))
    scores = _scores(queries, keys, "bncgrd,bnkgd->bngrck", soft_cap, sm_scale)
    query_pos = jnp.arange(blocks * block).reshape(blocks, block)[:, :, None]
    key_pos = (jnp.arange(blocks)[:, None] * block - block + jnp.arange(2 * block)[None, :])[:, None, :]
    mask = (key_pos <= query_pos) & (key_pos > query_pos - window) & (key_pos >= 0)  # [blocks, block, 2 block]
    if segment_ids is not None:
        segments = blocked(segment_ids)
        mask = mask & (segments[..., :, None] == with_previous(segments)[..., None, :])
    mask = jnp.broadcast_to(mask, (batch, blocks, block, 2 * block))[:, :, None, None]
    top = jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True)
    weights = jnp.where(mask, jnp.exp(scores - top), 0.0)
    num = jnp.einsum("bngrck,bnkgd->bncgrd", weights, values.astype(_F32))
    den = jnp.sum(weights, axis=-1).transpose(0, 1, 4, 2, 3)
    return (
        num.reshape(batch, blocks * block, heads, head_dim)[:, :seq],
        den.reshape(batch, blocks * block, heads)[:, :seq],
    )


def _delayed_linear_sums(q_features, k_features, v, window, segment_ids, impl) -> jax.Array:
    """``sum_{j <= t - window} (phi_q(q_t) . phi_k(k_j)) [v_j, 1]``: ``[batch, seq, heads,
    head_dim + 1]`` float32, by causal linear attention over keys and values delayed by
    ``window`` positions (a delayed key from another document is zeroed)."""
    seq, heads = q_features.shape[1:3]
    repeat = heads // k_features.shape[2]
    values = jnp.concatenate([v.astype(_F32), jnp.ones_like(v[..., :1], _F32)], axis=-1)
    keys, values = jnp.repeat(k_features.astype(_F32), repeat, axis=2), jnp.repeat(values, repeat, axis=2)

    def delayed(x, fill=0):
        return jnp.pad(x, [(0, 0), (window, 0)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)[:, :seq]

    keys, values = delayed(keys), delayed(values)
    if segment_ids is not None:
        keys = jnp.where((delayed(segment_ids, -1) == segment_ids)[..., None, None], keys, 0.0)
    kernel = runs_per_shard(impl, op="linear_attention", kernel_backends=LINEAR_KERNEL_BACKENDS)
    return per_head_group_shard(
        lambda q, k, v, segment_ids: linear_attention(q, k, v, segment_ids=segment_ids, impl=impl),
        (q_features.astype(_F32), keys, values, segment_ids),
        ("bsh.", "bsh.", "bsh.", "bs"),
        out_layout="bsh.",
        groups=heads,
        kernel=kernel,
    )


def step_windows(
    k: jax.Array, v: jax.Array, slot_k: jax.Array, slot_v: jax.Array, paging: Paging, window: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Each token's keys and values at positions ``t - window .. t``, and the slots after the step.

    Args:
      k, v: the step's ``[num_tokens, kv_heads, head_dim]``.
      slot_k, slot_v: ``[seqs, window, kv_heads, head_dim]``, each sequence's last ``window``
        keys and values before the step (newest last).
      paging: the step's runs.

    Returns:
      ``(keys, values)`` ``[num_tokens, window + 1, kv_heads, head_dim]`` (first: the key that
      leaves the window at ``t``; entries before a sequence's start are zeros, see
      ``run_history``) and the new ``(slot_k, slot_v)``.
    """
    ends = paging.run_offsets() + 1
    seqs = jnp.arange(slot_k.shape[0])

    def history(new, slot):
        slot = slot.astype(new.dtype)
        per_token = run_history(new, slot, paging, paging.owner, ends, window + 1)
        return per_token, run_history(new, slot, paging, seqs, paging.query_lens, window)

    (keys, new_slot_k), (values, new_slot_v) = history(k, slot_k), history(v, slot_v)
    return keys, values, new_slot_k.astype(slot_k.dtype), new_slot_v.astype(slot_v.dtype)


def ragged_window_linear_attention(
    q, keys, values, q_features, left_k_features, factor, states, *, paging: Paging, positions, valid,
    window: int, soft_cap: float = 0.0, sm_scale: float | None = None, impl="auto",
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """The layer's attention over one serving step's flat token budget.

    Args:
      q: ``[num_tokens, heads, head_dim]``; keys, values: ``[num_tokens, window + 1, kv_heads,
        head_dim]`` from :func:`step_windows`.
      q_features: ``[num_tokens, heads, features]``; left_k_features: ``[num_tokens, kv_heads,
        features]``, the features of ``keys[:, 0]`` (the key leaving each token's window).
      factor: ``[heads]``; states: float32 ``[seqs, heads, features, head_dim + 1]``, each
        sequence's sum of ``phi_k(k_j) [v_j, 1]`` over the keys that left its window.
      paging, positions ``[num_tokens]``, valid ``[num_tokens]``: the step's runs.

    Returns:
      ``(out [num_tokens, heads, head_dim] in q's dtype, states after the step)``.
    """
    num_tokens, heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    held = positions[:, None] - window + jnp.arange(window + 1)[None, :] >= 0  # [num_tokens, window + 1]
    grouped = q.reshape(num_tokens, kv_heads, heads // kv_heads, head_dim)
    scores = _scores(grouped, keys[:, 1:], "tgrd,tkgd->tgrk", soft_cap, sm_scale)
    mask = held[:, None, None, 1:]
    top = jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True)
    weights = jnp.where(mask, jnp.exp(scores - top), 0.0)
    window_num = jnp.einsum("tgrk,tkgd->tgrd", weights, values[:, 1:].astype(_F32)).reshape(q.shape)
    window_den = jnp.sum(weights, axis=-1).reshape(num_tokens, heads)

    repeat = heads // kv_heads
    left_values = jnp.concatenate([values[:, 0], jnp.ones_like(values[:, 0, :, :1])], axis=-1)
    linear_sums, states = ragged_linear_sums(
        q_features,
        jnp.repeat(left_k_features, repeat, axis=1),
        jnp.repeat(left_values, repeat, axis=1),
        states,
        paging,
        valid & held[:, 0],
        impl,
    )
    return _combine(window_num, window_den, linear_sums, factor).astype(q.dtype), states


__all__ = ["ragged_window_linear_attention", "step_windows", "window_linear_attention", "window_linear_reference"]

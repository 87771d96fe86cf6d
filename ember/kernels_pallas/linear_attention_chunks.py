"""The chunk-level math of decayed causal linear attention, written once and shared.

Within one chunk of ``L`` positions the output is quadratic (a masked ``L x L`` score
matrix); between chunks only a ``[dk, dv]`` state travels. The functions below serve the
quadratic (masked-matrix) form (one chunk = the whole sequence), the XLA chunked path
(all chunks at once with leading batch dimensions) and the body of the Pallas kernels (one
chunk of one head at a time). All of them broadcast over leading dimensions ``...``.

Notation, per chunk:
  ``cum_log_decay`` ``b[t]``: sum of the log decays from the chunk's first position through
  ``t`` (inclusive), float32. The weight of key ``s`` at query ``t >= s`` is ``exp(b[t] - b[s])``;
  the state entering the chunk reaches ``t`` with weight ``exp(b[t])``.
  ``doc`` ``r[t]``: the document index of position ``t`` in the sequence
  (``document_boundaries.document_index``, int32). Positions interact only within one
  document: ``r[t] == r[s]``.
  ``doc_before``: ``r`` of the position just before the chunk (0 before the sequence), the
  document the entering state belongs to.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ember.kernels_pallas.sequence_padding import pad_axis_to_multiple


def split_into_chunks(x: jax.Array, chunk_size: int) -> jax.Array:
    """``[batch, seq, ...] -> [batch, chunks, chunk_size, ...]``, zero-padding ``seq`` up to a
    multiple of ``chunk_size``. Zero keys and values with zero log decay change neither the
    outputs nor the final state."""
    x = pad_axis_to_multiple(x, 1, chunk_size)
    return x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])


def split_documents_into_chunks(doc: jax.Array, chunk_size: int) -> jax.Array:
    """``doc`` ``[batch, seq] -> [batch, chunks, chunk_size]``; padding continues the last
    document, so padded positions do not cut the final state off from the real tokens."""
    last = doc[:, -1:]
    return split_into_chunks(doc - last, chunk_size) + last[:, :, None]


def intra_chunk_weights(cum_log_decay: jax.Array, doc: jax.Array) -> jax.Array:
    """Decay weights ``w[..., t, s]`` of key ``s`` at query ``t``, zero unless ``s <= t`` and both
    are in the same document. ``cum_log_decay``, ``doc``: ``[..., L]``; result ``[..., L, L]``
    float32. The mask is applied before ``exp`` so masked entries are 0, never ``inf * 0``."""
    length = cum_log_decay.shape[-1]
    t_index = jax.lax.broadcasted_iota(jnp.int32, (length, length), 0)
    s_index = jax.lax.broadcasted_iota(jnp.int32, (length, length), 1)
    visible = (s_index <= t_index) & (doc[..., :, None] == doc[..., None, :])
    log_weight = cum_log_decay[..., :, None] - cum_log_decay[..., None, :]
    return jnp.exp(jnp.where(visible, log_weight, -jnp.inf))


def entering_state_weights(cum_log_decay: jax.Array, doc: jax.Array, doc_before: jax.Array) -> jax.Array:
    """``[..., L]`` weight with which the entering state reaches each position (0 after a
    document boundary). ``doc_before``: ``[...]``."""
    same_doc = doc == doc_before[..., None]
    return jnp.where(same_doc, jnp.exp(cum_log_decay), 0.0)


def leaving_state_weights(
    cum_log_decay: jax.Array, doc: jax.Array, doc_before: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """How the state leaving the chunk is formed: ``(key_weights [..., L], carry [...])`` with
    ``state_out = carry * state_in + sum_s key_weights[s] * k[s]^T v[s]``."""
    # The last position's values as masked sums: Pallas' Triton lowering has no `slice`.
    length = cum_log_decay.shape[-1]
    is_last = jax.lax.broadcasted_iota(jnp.int32, cum_log_decay.shape, cum_log_decay.ndim - 1) == length - 1
    last_log_decay = jnp.sum(jnp.where(is_last, cum_log_decay, 0.0), axis=-1, keepdims=True)
    last_doc = jnp.sum(jnp.where(is_last, doc, 0), axis=-1, keepdims=True)
    key_weights = jnp.where(doc == last_doc, jnp.exp(last_log_decay - cum_log_decay), 0.0)
    carry = jnp.where(last_doc[..., 0] == doc_before, jnp.exp(last_log_decay[..., 0]), 0.0)
    return key_weights, carry


def _matmul(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def chunk_outputs_and_state(q, k, v, cum_log_decay, doc, doc_before, state_in):
    """Outputs of one chunk and the state leaving it.

    Args:
      q, k: ``[..., L, dk]``; v: ``[..., L, dv]`` (any float dtype; accumulation in float32).
      cum_log_decay, doc: ``[..., L]``; doc_before: ``[...]``.
      state_in: ``[..., dk, dv]`` float32, or None for a zero entering state.

    Returns:
      ``(outputs [..., L, dv] float32, state_out [..., dk, dv] float32)``.
    """
    weights = intra_chunk_weights(cum_log_decay, doc)
    scores = _matmul("...td,...sd->...ts", q, k) * weights
    outputs = _matmul("...ts,...sv->...tv", scores.astype(v.dtype), v)
    key_weights, carry = leaving_state_weights(cum_log_decay, doc, doc_before)
    weighted_keys = (k.astype(jnp.float32) * key_weights[..., None]).astype(v.dtype)
    state_out = _matmul("...sd,...sv->...dv", weighted_keys, v)
    if state_in is not None:
        entering = entering_state_weights(cum_log_decay, doc, doc_before)
        outputs = outputs + entering[..., None] * _matmul("...td,...dv->...tv", q.astype(jnp.float32), state_in)
        state_out = state_out + carry[..., None, None] * state_in
    return outputs, state_out

"""The chunk-level math of decayed causal linear attention, written once and shared.

Within one chunk of ``L`` positions the output is quadratic (a masked ``L x L`` score
matrix); between chunks only a ``[dk, dv]`` state travels. The functions below serve the
quadratic (masked-matrix) form (one chunk = the whole sequence), the XLA chunked path
(all chunks at once with leading batch dimensions) and the body of the Pallas kernels (one
chunk of one head at a time). All of them broadcast over leading dimensions ``...``.

The weight formulas are written once, elementwise (:func:`decay_weights`,
:func:`entering_weights`, :func:`key_weights`, :func:`carry_weight`), so that they serve any
layout: the ``[..., L]`` vectors of the XLA path and the GPU kernels (through the wrappers
:func:`intra_chunk_weights`, :func:`entering_state_weights`, :func:`leaving_state_weights`),
and the TPU kernels' ``[L, 1]`` columns, ``[1, L]`` rows and ``[1, 1]`` per-chunk values.

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

from typing import NamedTuple

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


def document_before_each_chunk(doc_chunks: jax.Array) -> jax.Array:
    """``doc_before`` of every chunk: ``[..., chunks, L] -> [..., chunks]``, the document index
    of the position just before each chunk (0 before the sequence)."""
    return jnp.concatenate([jnp.zeros_like(doc_chunks[..., :1, 0]), doc_chunks[..., :-1, -1]], axis=-1)


def decay_weights(cum_t: jax.Array, cum_s: jax.Array, doc_t: jax.Array, doc_s: jax.Array) -> jax.Array:
    """Decay weights ``w[..., t, s]`` of key ``s`` at query ``t``, zero unless ``s <= t`` and both
    are in the same document, from the queries' view ``cum_t``/``doc_t`` ``[..., L, 1]`` and
    the keys' view ``cum_s``/``doc_s`` ``[..., 1, L]`` of one chunk; result ``[..., L, L]``
    float32. The mask is applied before ``exp`` so masked entries are 0, never ``inf * 0``."""
    length = cum_s.shape[-1]
    t_index = jax.lax.broadcasted_iota(jnp.int32, (length, length), 0)
    s_index = jax.lax.broadcasted_iota(jnp.int32, (length, length), 1)
    visible = (s_index <= t_index) & (doc_t == doc_s)
    return jnp.exp(jnp.where(visible, cum_t - cum_s, -jnp.inf))


def entering_weights(cum_log_decay, doc, doc_before):
    """Weight with which the entering state reaches a position (0 after a document boundary);
    elementwise on broadcastable operands."""
    return jnp.where(doc == doc_before, jnp.exp(cum_log_decay), 0.0)


def key_weights(cum_log_decay, doc, last_log_decay, last_doc):
    """Weight of a position's ``k^T v`` in the state leaving the chunk (0 unless it is in the
    chunk's last document); ``last_*`` are the chunk's last position's. Elementwise."""
    return jnp.where(doc == last_doc, jnp.exp(last_log_decay - cum_log_decay), 0.0)


def carry_weight(last_log_decay, last_doc, doc_before):
    """Weight with which the entering state reaches the leaving one (0 if a document starts
    inside the chunk). Elementwise."""
    return jnp.where(last_doc == doc_before, jnp.exp(last_log_decay), 0.0)


def last_position(x: jax.Array) -> jax.Array:
    """``[..., L] -> [..., 1]``: the chunk's last entry, as a masked sum (Pallas' Triton lowering
    has no ``slice``, and on a TPU it stays a lane reduction)."""
    length = x.shape[-1]
    is_last = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == length - 1
    return jnp.sum(jnp.where(is_last, x, 0), axis=-1, keepdims=True)


def intra_chunk_weights(cum_log_decay: jax.Array, doc: jax.Array) -> jax.Array:
    """:func:`decay_weights` of ``[..., L]`` vectors ``cum_log_decay`` and ``doc``; result
    ``[..., L, L]`` float32."""
    return decay_weights(cum_log_decay[..., :, None], cum_log_decay[..., None, :], doc[..., :, None], doc[..., None, :])


def entering_state_weights(cum_log_decay: jax.Array, doc: jax.Array, doc_before: jax.Array) -> jax.Array:
    """``[..., L]`` weight with which the entering state reaches each position (0 after a
    document boundary). ``doc_before``: ``[...]``."""
    return entering_weights(cum_log_decay, doc, doc_before[..., None])


def leaving_state_weights(
    cum_log_decay: jax.Array, doc: jax.Array, doc_before: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """How the state leaving the chunk is formed: ``(key_weights [..., L], carry [...])`` with
    ``state_out = carry * state_in + sum_s key_weights[s] * k[s]^T v[s]``."""
    last_log_decay, last_doc = last_position(cum_log_decay), last_position(doc)
    return (
        key_weights(cum_log_decay, doc, last_log_decay, last_doc),
        carry_weight(last_log_decay[..., 0], last_doc[..., 0], doc_before),
    )


class ChunkWeights(NamedTuple):
    """One chunk's decay weights, shaped to broadcast against the chunk's tiles.

    intra: ``[..., L, L]`` (:func:`decay_weights`); entering, keys: ``[..., L, 1]``, one per
    position as a column (:func:`entering_weights`, :func:`key_weights`); carry: ``[..., 1, 1]``
    (:func:`carry_weight`).
    """

    intra: jax.Array
    entering: jax.Array
    keys: jax.Array
    carry: jax.Array


def chunk_weights(cum_log_decay: jax.Array, doc: jax.Array, doc_before: jax.Array) -> ChunkWeights:
    """:class:`ChunkWeights` from ``[..., L]`` vectors ``cum_log_decay``, ``doc`` and ``doc_before`` ``[...]``."""
    keys, carry = leaving_state_weights(cum_log_decay, doc, doc_before)
    return ChunkWeights(
        intra=intra_chunk_weights(cum_log_decay, doc),
        entering=entering_state_weights(cum_log_decay, doc, doc_before)[..., None],
        keys=keys[..., None],
        carry=carry[..., None, None],
    )


def _matmul(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def weighted_outer_sum(x, weights, y):
    """``sum_s weights[s] * x[s]^T y[s]``: ``x [..., L, d1]``, ``weights [..., L, 1]``,
    ``y [..., L, d2]`` -> ``[..., d1, d2]`` float32, the weighted ``x`` cast to ``y``'s dtype
    for the matmul. A chunk's share of the state leaving it (``x, y = k, v`` with the key
    weights) and of the gradient of the state entering it (``x, y = q, dout`` with the
    entering weights)."""
    return _matmul("...sd,...sv->...dv", (x.astype(jnp.float32) * weights).astype(y.dtype), y)


def chunk_outputs(q, k, v, weights: ChunkWeights, state_in):
    """Outputs of one chunk, ``[..., L, dv]`` float32: the masked, decayed intra-chunk scores
    by ``v`` plus what the entering state contributes. Arguments as :func:`outputs_and_state`'s."""
    outputs = _matmul("...ts,...sv->...tv", masked_scores(q, k, weights).astype(v.dtype), v)
    if state_in is None:
        return outputs
    return outputs + weights.entering * _matmul("...td,...dv->...tv", q.astype(jnp.float32), state_in)


def outputs_and_state(q, k, v, weights: ChunkWeights, state_in):
    """Outputs of one chunk and the state leaving it, given the chunk's :class:`ChunkWeights`.

    Args:
      q, k: ``[..., L, dk]``; v: ``[..., L, dv]`` (any float dtype; accumulation in float32).
      state_in: ``[..., dk, dv]`` float32, or None for a zero entering state.

    Returns:
      ``(outputs [..., L, dv] float32, state_out [..., dk, dv] float32)``.
    """
    state_out = weighted_outer_sum(k, weights.keys, v)
    if state_in is not None:
        state_out = state_out + weights.carry * state_in
    return chunk_outputs(q, k, v, weights, state_in), state_out


def chunk_outputs_and_state(q, k, v, cum_log_decay, doc, doc_before, state_in):
    """:func:`outputs_and_state` with the weights from ``[..., L]`` vectors ``cum_log_decay``,
    ``doc`` and ``doc_before`` ``[...]``."""
    return outputs_and_state(q, k, v, chunk_weights(cum_log_decay, doc, doc_before), state_in)


# The gradients of one chunk's inputs, in pieces a kernel can also sum over blocks of value
# columns: output_products, state_product and last_state_gradient are sums over the value
# columns, so a program holding a block of them adds up its blocks' shares.


def masked_scores(q, k, weights: ChunkWeights):
    """One chunk's masked, decayed scores ``[..., L, L]``, float32."""
    return _matmul("...td,...sd->...ts", q, k) * weights.intra


def output_products(dout, v):
    """``dout v^T`` ``[..., L, L]`` float32: the gradient of one chunk's scores before the
    mask and decay (:func:`score_gradients`)."""
    return _matmul("...tv,...sv->...ts", dout, v)


def score_gradients(dout_by_v, weights: ChunkWeights):
    """Gradient of one chunk's masked, decayed ``[..., L, L]`` scores, float32, from
    ``dout_by_v = output_products(dout, v)``."""
    return dout_by_v * weights.intra


def state_product(x, state):
    """``x [..., L, dv]`` by a state's transpose ``[..., dk, dv]``: ``[..., L, dk]`` float32
    (``dout S_in^T`` in dq, ``v dS_out^T`` in dk)."""
    return _matmul("...tv,...dv->...td", x, state)


def query_gradient(dscores, k, weights: ChunkWeights, dout_by_state_in):
    """dq ``[..., L, dk]``: through the scores and the entering state
    (``dout_by_state_in = state_product(dout, state_in)``)."""
    return _matmul("...ts,...sd->...td", dscores, k) + weights.entering * dout_by_state_in


def key_gradient(dscores, q, weights: ChunkWeights, v_by_dstate_out):
    """dk ``[..., L, dk]``: through the scores and the state leaving the chunk
    (``v_by_dstate_out = state_product(v, dstate_out)``)."""
    return _matmul("...ts,...td->...sd", dscores, q) + weights.keys * v_by_dstate_out


def value_gradient(scores, dout, k, weights: ChunkWeights, dstate_out):
    """dv ``[..., L, dv]``: through the scores and the state leaving the chunk."""
    return _matmul("...ts,...tv->...sv", scores, dout) + weights.keys * _matmul("...sd,...dv->...sv", k, dstate_out)


def decay_gradient(q, dq, k, dk):
    """``q . dq - k . dk`` ``[..., L]``: the cumulative log decay's gradient at every position
    (see :func:`chunk_input_gradients`)."""
    return jnp.sum(q * dq, axis=-1) - jnp.sum(k * dk, axis=-1)


def chunk_input_gradients(q, k, v, dout, weights: ChunkWeights, state_in, state_out, dstate_out):
    """Gradients of one chunk's inputs (the backward of :func:`outputs_and_state` but for the
    entering state's, :func:`chunk_gradients`), float32, from the pieces above.

    Args:
      q, k: ``[..., L, dk]``; v, dout: ``[..., L, dv]``; float32.
      weights: the chunk's :class:`ChunkWeights` (``carry`` unused).
      state_in, state_out: ``[..., dk, dv]``, the states entering and leaving the chunk.
      dstate_out: ``[..., dk, dv]``, the gradient of ``state_out``.

    Returns:
      ``(dq, dk, dv, dcum, dcum_last)``. The gradient of the cumulative log decay is
      ``dcum [..., L]`` at every position plus ``dcum_last [...]`` at the chunk's last one, by
      the identity: every term with ``q_t`` carries ``exp(b_t)``, every term with ``k_s``
      ``exp(-b_s)``, and the leaving state ``exp(b_last)``, so
      ``d b_t = q_t . dq_t - k_t . dk_t + [t = last] <dS_out, S_out>``.
    """
    dscores = score_gradients(output_products(dout, v), weights)
    dq = query_gradient(dscores, k, weights, state_product(dout, state_in))
    dk = key_gradient(dscores, q, weights, state_product(v, dstate_out))
    dv = value_gradient(masked_scores(q, k, weights), dout, k, weights, dstate_out)
    return dq, dk, dv, decay_gradient(q, dq, k, dk), last_state_gradient(state_out, dstate_out)


def last_state_gradient(state_out, dstate_out):
    """``<dS_out, S_out>`` ``[...]``: the decay gradient the leaving state adds at the chunk's last position."""
    return jnp.sum(dstate_out * state_out, axis=(-2, -1))


def entering_state_gradient(q, dout, weights: ChunkWeights, dstate_out):
    """Gradient of the state entering one chunk, ``[..., dk, dv]`` float32: the leaving state's
    gradient carried back plus what the chunk's outputs read from the entering state."""
    return weights.carry * dstate_out + weighted_outer_sum(q, weights.entering, dout)


def chunk_gradients(q, k, v, dout, weights: ChunkWeights, state_in, state_out, dstate_out):
    """Gradients through one chunk (the backward of :func:`outputs_and_state`), float32:
    :func:`chunk_input_gradients`' ``(dq, dk, dv, dcum, dcum_last)`` and then
    :func:`entering_state_gradient`'s ``dstate_in``. Arguments as the former's."""
    return (
        *chunk_input_gradients(q, k, v, dout, weights, state_in, state_out, dstate_out),
        entering_state_gradient(q, dout, weights, dstate_out),
    )

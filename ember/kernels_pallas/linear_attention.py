"""Causal linear attention with per-step scalar decay, chunked (DESIGN.md section 4).

For each batch element and head, with a state ``S`` of shape ``[dk, dv]``::

    S_t = exp(log_decay_t) * S_{t-1} + k_t^T v_t        (S_{t-1} := 0 after a document boundary)
    o_t = q_t S_t                                       (normalize: / (q_t z_t + eps), z the decayed key sum)

``log_decay=None`` is plain linear attention, a constant per head is RetNet-style retention,
a data-dependent one is a scalar-gated variant (and Mamba-2's SSD, see ``ssd.py``).

Forms of the same op, all in this package:
- :func:`linear_attention_reference`: the recurrence above as a sequential ``lax.scan``; THE
  reference (tests, fallbacks). :func:`linear_attention_step` is its one-token update.
- :func:`linear_attention_quadratic`: the parallel masked-matrix form, ``O(seq^2)``.
- :func:`linear_attention` with ``impl="xla"``: the chunked form in einsums (quadratic inside
  a chunk, state passed between chunks); ``impl="pallas"``: the same algorithm as Pallas
  kernels with a hand-written backward, for NVIDIA GPUs (``linear_attention_pallas.py``,
  the Triton lowering) and TPUs (``linear_attention_tpu.py``, Mosaic TPU);
  ``"interpret"``/``"interpret_tpu"`` run the GPU/TPU kernel in the Pallas interpreter / JAX's
  TPU interpret mode on any backend (``dispatch.py``).

Heads: ``q`` and ``k`` may have fewer heads than ``v`` (``heads % qk_heads == 0``): value
head ``h`` reads query/key head ``h // (heads // qk_heads)``, as in grouped-query attention
and Mamba-2's B/C groups.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ember.kernels_pallas import linear_attention_chunks as chunks
from ember.kernels_pallas.dispatch import kernel_platform, pallas_interpret, resolve_impl
from ember.kernels_pallas.document_boundaries import document_index, document_starts
from ember.kernels_pallas.int_options import check_power_of_two
from ember.kernels_pallas.linear_attention_pallas import chunked_linear_attention_pallas
from ember.kernels_pallas.linear_attention_tpu import chunked_linear_attention_tpu
from ember.kernels_pallas.step_inputs import check_one_token

KERNEL_BACKENDS = ("gpu", "tpu")
"""Backends with a compiled Pallas kernel (GPU: the Triton lowering; TPU: Mosaic TPU);
elsewhere "auto" is "xla"."""

_CHUNKED_KERNELS = {"gpu": chunked_linear_attention_pallas, "tpu": chunked_linear_attention_tpu}

NORMALIZER_EPS = 1e-6
"""Added to the normaliser ``q_t z_t`` (``normalize=True``) so a zero key sum gives 0, not NaN."""


@dataclasses.dataclass(frozen=True)
class ChunkSize:
    """The chunk length of the chunked forms; validates itself.

    Any power of two of at least 8 (small chunks keep CPU tests small); the compiled GPU
    kernel (``impl="pallas"`` on a GPU) also needs at least 16, for Triton's matmul tiles.
    On a TPU a chunk is the sublane side of the kernel's blocks and both sides of its
    ``[chunk, chunk]`` score tiles: 128 fills the MXU.
    """

    chunk_size: int

    def __post_init__(self):
        check_power_of_two("chunk_size", self.chunk_size, 8)


# ----------------------------------------------------------------------------- validation


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _validate(op, q, k, v, log_decay, initial_state, segment_ids, normalize, state_name="initial_state") -> None:
    """Raises ``ValueError`` naming the first argument whose shape or dtype is wrong
    (``state_name``: what the caller calls the state argument)."""
    if q.ndim != 4:
        raise ValueError(f"{op}: q must be [batch, seq, qk_heads, dk], got shape {q.shape}")
    if k.shape != q.shape:
        raise ValueError(f"{op}: k must have q's shape {q.shape}, got {k.shape}")
    if v.ndim != 4 or v.shape[:2] != q.shape[:2] or q.shape[2] == 0 or v.shape[2] % q.shape[2]:
        raise ValueError(
            f"{op}: v must be [batch, seq, heads, dv] with q's batch and seq {q.shape[:2]} and heads a "
            f"multiple of q's {q.shape[2]} heads, got shape {v.shape}"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not _is_float(x):
            raise ValueError(f"{op}: {name} must be a floating dtype, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, seq, heads, _dv = v.shape
    if log_decay is not None and (log_decay.shape != (batch, seq, heads) or not _is_float(log_decay)):
        raise ValueError(
            f"{op}: log_decay must be a float array [batch, seq, heads] = {(batch, seq, heads)}, "
            f"got {log_decay.dtype}{list(log_decay.shape)}"
        )
    if initial_state is not None:
        expected = state_shape(q.shape, v.shape, normalize=normalize)
        if initial_state.shape != expected or not _is_float(initial_state):
            raise ValueError(
                f"{op}: {state_name} must be a float array {expected} ([batch, heads, dk, dv"
                f"{' + 1' if normalize else ''}]), got {initial_state.dtype}{list(initial_state.shape)}"
            )
    if segment_ids is not None and (
        segment_ids.shape != (batch, seq) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
    ):
        raise ValueError(
            f"{op}: segment_ids must be an integer array [batch, seq] = {(batch, seq)}, "
            f"got {segment_ids.dtype}{list(segment_ids.shape)}"
        )


def state_shape(q_shape, v_shape, *, normalize: bool = False) -> tuple[int, int, int, int]:
    """Shape of the recurrent state, ``[batch, heads, dk, dv]``; with ``normalize`` one more
    value column holding the decayed running key sum ``z``: ``[batch, heads, dk, dv + 1]``."""
    batch, _, heads, dv = v_shape
    return (batch, heads, q_shape[-1], dv + int(normalize))


# ----------------------------------------------------------------------------- shared pieces


def _with_key_sum_column(v: jax.Array) -> jax.Array:
    """``[..., dv] -> [..., dv + 1]``: a column of ones, so the state's last column
    accumulates the (decayed) key sum used by ``normalize``."""
    return jnp.concatenate([v, jnp.ones((*v.shape[:-1], 1), v.dtype)], axis=-1)


def _normalized(outputs: jax.Array) -> jax.Array:
    """Splits ``[..., dv + 1]`` into numerator and normaliser and divides."""
    return outputs[..., :-1] / (outputs[..., -1:] + NORMALIZER_EPS)


def _expand_heads(x: jax.Array, heads: int, axis: int) -> jax.Array:
    """Repeats query/key heads so that value head ``h`` sees head ``h // group``."""
    return jnp.repeat(x, heads // x.shape[axis], axis=axis) if x.shape[axis] != heads else x


def _zero_log_decay(v: jax.Array) -> jax.Array:
    return jnp.zeros(v.shape[:3], jnp.float32)


MIN_LOG_DECAY = -200.0
"""The chunked forms clamp ``log_decay`` to at least this: ``exp(-200)`` is 0 in float32, as
``exp(-inf)`` is (a full reset), but the differences of cumulative sums they exponentiate
stay finite, where ``-inf - -inf`` is NaN."""


def _chunkable_log_decay(log_decay, v: jax.Array) -> jax.Array:
    """``log_decay`` as the chunked forms take it: float32, zeros for None, at least
    :data:`MIN_LOG_DECAY`."""
    if log_decay is None:
        return _zero_log_decay(v)
    return jnp.maximum(log_decay.astype(jnp.float32), MIN_LOG_DECAY)


# ----------------------------------------------------------------------------- recurrence


def _recurrent_update(state, q, k, v, log_decay):
    """One step of the recurrence for every batch element and head (float32).

    state ``[batch, heads, dk, dv]``; q, k ``[batch, heads, dk]``; v ``[batch, heads, dv]``;
    log_decay ``[batch, heads]``. Returns ``(output [batch, heads, dv], new_state)``.
    """
    state = jnp.exp(log_decay)[..., None, None] * state + k[..., :, None] * v[..., None, :]
    return jnp.einsum("bhd,bhdv->bhv", q, state), state


def linear_attention_step(q, k, v, state, *, log_decay=None, normalize=False):
    """One decode step: the recurrence applied to a single token.

    Args:
      q, k: ``[batch, qk_heads, dk]``; v: ``[batch, heads, dv]``.
      state: ``[batch, heads, dk, dv]`` (``dv + 1`` with ``normalize``), as returned by
        ``linear_attention(..., return_final_state=True)`` or a previous step.
      log_decay: ``[batch, heads]`` or None (no decay).

    Returns:
      ``(output [batch, heads, dv] in v's dtype, new_state float32)``.
    """
    check_one_token(
        "linear_attention_step",
        (
            ("q", q, "[batch, qk_heads, dk]"),
            ("k", k, "[batch, qk_heads, dk]"),
            ("v", v, "[batch, heads, dv]"),
            ("log_decay", log_decay, "[batch, heads]"),
        ),
    )
    batch, heads, _dv = v.shape
    _validate(
        "linear_attention_step",
        q[:, None],
        k[:, None],
        v[:, None],
        None if log_decay is None else log_decay[:, None],
        state,
        None,
        normalize,
        state_name="state",
    )
    f32 = jnp.float32
    values = _with_key_sum_column(v) if normalize else v
    log_decay = jnp.zeros((batch, heads), f32) if log_decay is None else log_decay
    output, new_state = _recurrent_update(
        state.astype(f32),
        _expand_heads(q, heads, 1).astype(f32),
        _expand_heads(k, heads, 1).astype(f32),
        values.astype(f32),
        log_decay.astype(f32),
    )
    return (_normalized(output) if normalize else output).astype(v.dtype), new_state


def linear_attention_reference(
    q, k, v, *, log_decay=None, normalize=False, initial_state=None, return_final_state=False, segment_ids=None
):
    """The definition: a sequential ``lax.scan`` of :func:`linear_attention_step`'s update,
    in float32. Same arguments and results as :func:`linear_attention`."""
    _validate("linear_attention_reference", q, k, v, log_decay, initial_state, segment_ids, normalize)
    batch, seq, heads, _ = v.shape
    f32 = jnp.float32
    values = _with_key_sum_column(v) if normalize else v
    log_decay = _zero_log_decay(v) if log_decay is None else log_decay
    state = (
        jnp.zeros(state_shape(q.shape, v.shape, normalize=normalize), f32) if initial_state is None else initial_state
    )
    new_document = document_starts(segment_ids, batch, seq)

    def step(state, inputs):
        q_t, k_t, v_t, log_decay_t, reset_t = inputs
        state = jnp.where(reset_t[:, None, None, None], 0.0, state)
        output, state = _recurrent_update(state, q_t, k_t, v_t, log_decay_t)
        return state, output

    time_major = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
    final_state, outputs = jax.lax.scan(
        step,
        state.astype(f32),
        (
            time_major(_expand_heads(q, heads, 2).astype(f32)),
            time_major(_expand_heads(k, heads, 2).astype(f32)),
            time_major(values.astype(f32)),
            time_major(log_decay.astype(f32)),
            time_major(new_document),
        ),
    )
    outputs = jnp.moveaxis(outputs, 0, 1)
    outputs = (_normalized(outputs) if normalize else outputs).astype(v.dtype)
    return (outputs, final_state) if return_final_state else outputs


# ----------------------------------------------------------------------------- quadratic form


def _heads_major(x: jax.Array) -> jax.Array:
    """``[batch, seq, heads, ...] -> [batch, heads, seq, ...]``."""
    return jnp.moveaxis(x, 2, 1)


def _seq_major(x: jax.Array) -> jax.Array:
    """``[batch, heads, seq, ...] -> [batch, seq, heads, ...]``."""
    return jnp.moveaxis(x, 1, 2)


def linear_attention_quadratic(
    q, k, v, *, log_decay=None, normalize=False, initial_state=None, return_final_state=False, segment_ids=None
):
    """The parallel (masked-matrix) form: one ``[seq, seq]`` decay-weighted score matrix per
    head, ``O(seq^2)`` time and memory. Same arguments and results as
    :func:`linear_attention`; it is the chunked algorithm with a single chunk."""
    _validate("linear_attention_quadratic", q, k, v, log_decay, initial_state, segment_ids, normalize)
    batch, seq, heads, _ = v.shape
    values = _with_key_sum_column(v) if normalize else v
    cum_log_decay = jnp.cumsum(_heads_major(_chunkable_log_decay(log_decay, v)), axis=-1)
    doc = document_index(segment_ids, batch, seq)[:, None, :]
    outputs, final_state = chunks.chunk_outputs_and_state(
        _heads_major(_expand_heads(q, heads, 2)),
        _heads_major(_expand_heads(k, heads, 2)),
        _heads_major(values),
        cum_log_decay,
        doc,
        jnp.zeros((batch, 1), jnp.int32),
        None if initial_state is None else initial_state.astype(jnp.float32),
    )
    if initial_state is None:
        final_state = jnp.broadcast_to(final_state, state_shape(q.shape, v.shape, normalize=normalize))
    outputs = _seq_major(outputs)
    outputs = (_normalized(outputs) if normalize else outputs).astype(v.dtype)
    return (outputs, final_state) if return_final_state else outputs


# ----------------------------------------------------------------------------- chunked (XLA)


def _chunked_xla(q, k, v, log_decay, doc, initial_state, chunk_size):
    """The chunked algorithm in einsums over all chunks at once, with a ``lax.scan`` over
    chunks for the ``[dk, dv]`` states only. Inputs as in :func:`linear_attention` (``v``
    already carrying the key-sum column if normalising, ``log_decay`` float32, ``doc`` from
    :func:`document_index`, ``initial_state`` float32). Returns float32 outputs
    ``[batch, seq, heads, dv]`` and the final state."""
    seq, heads = v.shape[1], v.shape[2]

    def by_chunk(x):  # [batch, seq, heads, ...] -> [batch, heads, chunks, chunk, ...]
        return jnp.moveaxis(chunks.split_into_chunks(x, chunk_size), 3, 1)

    q_c = by_chunk(_expand_heads(q, heads, 2))
    k_c = by_chunk(_expand_heads(k, heads, 2))
    v_c = by_chunk(v)
    cum_log_decay = jnp.cumsum(by_chunk(log_decay), axis=-1)
    doc_c = chunks.split_documents_into_chunks(doc, chunk_size)[:, None]  # [batch, 1, chunks, chunk]
    doc_before = chunks.document_before_each_chunk(doc_c)  # [batch, 1, chunks]

    outputs, chunk_states = chunks.chunk_outputs_and_state(q_c, k_c, v_c, cum_log_decay, doc_c, doc_before, None)
    _, carry = chunks.leaving_state_weights(cum_log_decay, doc_c, doc_before)

    def pass_state(state, chunk):
        chunk_state, chunk_carry = chunk
        return chunk_carry[..., None, None] * state + chunk_state, state

    final_state, entering_states = jax.lax.scan(
        pass_state, initial_state, (jnp.moveaxis(chunk_states, 2, 0), jnp.moveaxis(carry, 2, 0))
    )
    entering_states = jnp.moveaxis(entering_states, 0, 2)  # [batch, heads, chunks, dk, dv]
    entering = chunks.entering_state_weights(cum_log_decay, doc_c, doc_before)
    outputs = outputs + entering[..., None] * jnp.einsum("bhntd,bhndv->bhntv", q_c.astype(jnp.float32), entering_states)
    outputs = jnp.moveaxis(outputs, 1, 3).reshape(v.shape[0], -1, heads, v.shape[-1])[:, :seq]
    return outputs, final_state


# ----------------------------------------------------------------------------- public op


@functools.partial(jax.jit, static_argnames=("normalize", "return_final_state", "chunk_size", "impl"))
def linear_attention(
    q,
    k,
    v,
    *,
    log_decay=None,
    normalize=False,
    initial_state=None,
    return_final_state=False,
    segment_ids=None,
    chunk_size=64,
    impl="auto",
):
    """Causal linear attention over already feature-mapped ``q``/``k``, chunked.

    Args:
      q, k: ``[batch, seq, qk_heads, dk]``.
      v: ``[batch, seq, heads, dv]``, ``heads`` a multiple of ``qk_heads``; same dtype as q, k.
      log_decay: ``[batch, seq, heads]`` float, ``<= 0``: the state is multiplied by
        ``exp(log_decay[t])`` before token ``t`` is added (``-inf``: a full reset). None: no
        decay.
      normalize: divide each output by ``q_t . z_t + eps`` where ``z_t`` is the decayed running
        sum of keys (needs positive feature maps). The state then has ``dv + 1`` columns.
      initial_state: ``[batch, heads, dk, dv (+1)]`` state before the first token; None: zeros.
      return_final_state: also return the state after the last token (float32).
      segment_ids: ``[batch, seq]`` integers; the state is reset wherever the id changes, so
        packed documents do not see each other. ``initial_state`` flows into the first one.
      chunk_size: chunk length (power of two >= 8); results do not depend on it.
      impl: "auto", "pallas", "interpret", "interpret_tpu" or "xla" (see ``dispatch.py``).

    Returns:
      outputs ``[batch, seq, heads, dv]`` in v's dtype; with ``return_final_state``,
      ``(outputs, final_state)``.
    """
    _validate("linear_attention", q, k, v, log_decay, initial_state, segment_ids, normalize)
    ChunkSize(chunk_size)
    impl = resolve_impl(impl, op="linear_attention", kernel_backends=KERNEL_BACKENDS)
    platform = kernel_platform(impl)
    if impl == "pallas" and platform == "gpu" and chunk_size < 16:
        raise ValueError(
            f"linear_attention: chunk_size must be >= 16 for impl='pallas' (Triton tiles), got {chunk_size}"
        )
    batch, seq, _heads, _ = v.shape
    values = _with_key_sum_column(v) if normalize else v
    log_decay = _chunkable_log_decay(log_decay, v)
    shape = state_shape(q.shape, v.shape, normalize=normalize)
    state = jnp.zeros(shape, jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    doc = document_index(segment_ids, batch, seq)
    if batch == 0 or seq == 0:  # nothing to attend: no output rows, the state passes through
        outputs, final_state = jnp.zeros((batch, seq, _heads, values.shape[-1]), jnp.float32), state
    elif platform is None:
        outputs, final_state = _chunked_xla(q, k, values, log_decay, doc, state, chunk_size)
    else:
        outputs, final_state = _CHUNKED_KERNELS[platform](
            q, k, values, log_decay, doc, state, chunk_size=chunk_size, interpret=pallas_interpret(impl)
        )
    outputs = (_normalized(outputs) if normalize else outputs).astype(v.dtype)
    return (outputs, final_state) if return_final_state else outputs

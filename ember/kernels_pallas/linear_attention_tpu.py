"""Mosaic TPU kernels for chunked linear attention: forward and a hand-written backward.

The grid is ``(batch * heads, chunks)``: the first axis is "parallel" (a chip with two
TensorCores splits it), the second "arbitrary" (chunks run in order on one core). Each step reads one
chunk of one head as VMEM blocks, auto-pipelined by ``BlockSpec`` (the next chunk's DMA
overlaps this chunk's compute), and carries the head's ``[dk, dv]`` state across chunk steps
in float32 VMEM scratch. Per chunk the intra-chunk ``[L, L]`` (masked, decayed) scores and
the state's contribution run on the MXU; the chunk math is ``linear_attention_chunks.py``,
shared with the XLA path and the GPU kernels.

Layout (built by :func:`chunked_linear_attention_tpu` around the kernels):
- q, k ``[batch * qk_heads, seq, dk]`` and v ``[batch * heads, seq, dv]``, heads-major, so a
  block ``(L, d)`` has the chunk on sublanes and the head dimension on lanes; ``dk`` and
  ``dv`` are zero-padded to multiples of 128 lanes (full MXU tiles, unmasked stores; zero
  columns change nothing) and ``seq`` to whole chunks. Value head ``h`` reads query/key row
  ``h // group`` through its index map, so grouped heads are never copied.
- Per-position scalars as ``[1, L]`` rows (``[..., chunks, 1, L]`` arrays, whose last two
  block dims are the full array dims): the chunk-local cumulative log decay per head and the
  document index per batch element, counted from the document of the state entering the
  chunk, so no chunk needs its predecessor's. The kernels turn rows into ``[L, 1]`` columns
  with a masked lane reduction (no relayout).
- The forward also writes the state entering every chunk when a backward will follow; the
  backward walks the chunks in reverse (reversed index maps) carrying the state's gradient
  and the state leaving the current chunk in VMEM scratch. Its dq and dk are one partial
  sum per value head (grouped heads share q and k), added up outside the kernel.

Matmuls whose operands are both inputs (``q k^T``, scores by ``v``, weighted keys by ``v``)
run in the input dtype with float32 accumulation; the state's and the backward's run in
float32, as in the GPU kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ember.kernels_pallas import linear_attention_chunks as chunks
from ember.kernels_pallas.sequence_padding import pad_axis_to_multiple

NUM_LANES = 128

_DIMENSION_SEMANTICS = ("parallel", "arbitrary")  # (batch * heads, chunks)


# ----------------------------------------------------------------------------- in-kernel helpers


def _diagonal(length: int) -> jax.Array:
    rows = jax.lax.broadcasted_iota(jnp.int32, (length, length), 0)
    return rows == jax.lax.broadcasted_iota(jnp.int32, (length, length), 1)


def _column(row: jax.Array) -> jax.Array:
    """``[1, L] -> [L, 1]``: a transpose written as a masked lane reduction."""
    return jnp.sum(jnp.where(_diagonal(row.shape[-1]), row, 0.0), axis=1, keepdims=True)


def _row(column: jax.Array) -> jax.Array:
    """``[L, 1] -> [1, L]``: a transpose written as a masked sublane reduction."""
    return jnp.sum(jnp.where(_diagonal(column.shape[0]), column, 0.0), axis=0, keepdims=True)


def _chunk_weights(cum_row: jax.Array, doc_row: jax.Array) -> chunks.ChunkWeights:
    """The chunk's weights from its ``[1, L]`` rows: cumulative log decay (float32) and
    document index counted from the entering state's document (int32)."""
    doc_row = doc_row.astype(jnp.float32)  # at most L: exact, and one dtype for the reductions
    cum_col, doc_col = _column(cum_row), _column(doc_row)
    last_cum, last_doc = chunks.last_position(cum_row), chunks.last_position(doc_row)  # [1, 1]
    return chunks.ChunkWeights(
        intra=chunks.decay_weights(cum_col, cum_row, doc_col, doc_row),
        entering=chunks.entering_weights(cum_col, doc_col, 0.0),
        keys=chunks.key_weights(cum_col, doc_col, last_cum, last_doc),
        carry=chunks.carry_weight(last_cum, last_doc, 0.0),
    )


# ----------------------------------------------------------------------------- kernels


def _forward_kernel(q_ref, k_ref, v_ref, cum_ref, doc_ref, initial_ref, out_ref, final_ref, *rest):
    """One chunk of one head. Blocks: q/k ``[L, dk]``, v ``[L, dv]``, cum/doc ``[1, L]``,
    initial and final state ``[dk, dv]``, outputs ``[L, dv]`` float32. ``rest`` is
    ``(states_ref, state_scratch)`` when the backward needs the state entering each chunk
    (a ``[dk, dv]`` block per chunk), else ``(state_scratch,)``."""
    *states_ref, state_scratch = rest
    step = pl.program_id(1)

    @pl.when(step == 0)
    def _start():
        state_scratch[...] = initial_ref[...]

    state_in = state_scratch[...]
    if states_ref:
        states_ref[0][...] = state_in
    weights = _chunk_weights(cum_ref[...], doc_ref[...])
    outputs, state_out = chunks.outputs_and_state(q_ref[...], k_ref[...], v_ref[...], weights, state_in)
    out_ref[...] = outputs
    state_scratch[...] = state_out

    @pl.when(step == pl.num_programs(1) - 1)
    def _finish():
        final_ref[...] = state_out


def _backward_kernel(
    q_ref,
    k_ref,
    v_ref,
    cum_ref,
    doc_ref,
    states_ref,
    final_ref,
    dout_ref,
    dfinal_ref,
    dq_ref,
    dk_ref,
    dv_ref,
    dcum_ref,
    dinitial_ref,
    dstate_scratch,
    state_out_scratch,
):
    """One chunk of one head, chunks in reverse. Blocks as the forward's, plus: states (the
    chunk's entering state) and final ``[dk, dv]``, dout ``[L, dv]``, dfinal ``[dk, dv]``;
    gradients dq/dk ``[L, dk]`` (this value head's share), dv ``[L, dv]``, dcum ``[1, L]``,
    dinitial ``[dk, dv]``; all float32. Scratch: the gradient of the state leaving the chunk
    and that state itself (the next chunk's entering state, read one step earlier)."""
    step = pl.program_id(1)

    @pl.when(step == 0)
    def _start():  # the last chunk leaves the final state
        dstate_scratch[...] = dfinal_ref[...]
        state_out_scratch[...] = final_ref[...]

    f32 = jnp.float32
    q, k, v, dout = (ref[...].astype(f32) for ref in (q_ref, k_ref, v_ref, dout_ref))
    state_in = states_ref[...]
    weights = _chunk_weights(cum_ref[...], doc_ref[...])
    dq, dk, dv, dcum, dcum_last, dstate_in = chunks.chunk_gradients(
        q, k, v, dout, weights, state_in, state_out_scratch[...], dstate_scratch[...]
    )
    dq_ref[...] = dq
    dk_ref[...] = dk
    dv_ref[...] = dv
    length = q.shape[0]
    is_last = jax.lax.broadcasted_iota(jnp.int32, (length, 1), 0) == length - 1
    dcum_ref[...] = _row(dcum[:, None] + jnp.where(is_last, dcum_last, 0.0))
    dstate_scratch[...] = dstate_in
    state_out_scratch[...] = state_in

    @pl.when(step == pl.num_programs(1) - 1)
    def _finish():
        dinitial_ref[...] = dstate_in


# ----------------------------------------------------------------------------- pallas_calls


def _block_specs(q, v, doc, *, reverse: bool) -> dict[str, pl.BlockSpec]:
    """BlockSpecs over the grid ``(batch * heads, chunk step)``; chunk ``n - 1 - step`` when
    ``reverse``. Arrays as laid out by :func:`chunked_linear_attention_tpu`."""
    rows, dk, dv = q.shape[0], q.shape[-1], v.shape[-1]
    n_chunks, chunk_size = doc.shape[1], doc.shape[-1]
    heads = v.shape[0] // doc.shape[0]
    group = v.shape[0] // rows

    def chunk(step):
        return n_chunks - 1 - step if reverse else step

    def div(index, divisor):  # indices are nonnegative: truncation is floor, without `//`'s sign fix-up
        return jax.lax.div(index, divisor)

    return {
        "qk": pl.BlockSpec((None, chunk_size, dk), lambda bh, s: (div(bh, group), chunk(s), 0)),
        "qk_per_value_head": pl.BlockSpec((None, chunk_size, dk), lambda bh, s: (bh, chunk(s), 0)),
        "v": pl.BlockSpec((None, chunk_size, dv), lambda bh, s: (bh, chunk(s), 0)),
        "cum": pl.BlockSpec((None, None, 1, chunk_size), lambda bh, s: (bh, chunk(s), 0, 0)),
        "doc": pl.BlockSpec((None, None, 1, chunk_size), lambda bh, s: (div(bh, heads), chunk(s), 0, 0)),
        "state": pl.BlockSpec((None, dk, dv), lambda bh, s: (bh, 0, 0)),
        "states": pl.BlockSpec((None, None, dk, dv), lambda bh, s: (bh, chunk(s), 0, 0)),
    }


def _grid(v, doc) -> tuple[int, int]:
    return v.shape[0], doc.shape[1]


def _forward(q, k, v, cum, doc, state, interpret, *, save_states: bool):
    """Outputs ``[batch * heads, seq, dv]``, the final state and, with ``save_states``, the
    state entering every chunk ``[batch * heads, chunks, dk, dv]`` (all float32)."""
    rows, dk, dv = v.shape[0], q.shape[-1], v.shape[-1]
    n_chunks = doc.shape[1]
    specs = _block_specs(q, v, doc, reverse=False)
    out_specs = [specs["v"], specs["state"]]
    out_shape = [jax.ShapeDtypeStruct(v.shape, jnp.float32), jax.ShapeDtypeStruct((rows, dk, dv), jnp.float32)]
    if save_states:
        out_specs.append(specs["states"])
        out_shape.append(jax.ShapeDtypeStruct((rows, n_chunks, dk, dv), jnp.float32))
    results = pl.pallas_call(
        _forward_kernel,
        grid=_grid(v, doc),
        in_specs=[specs["qk"], specs["qk"], specs["v"], specs["cum"], specs["doc"], specs["state"]],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=_DIMENSION_SEMANTICS),
        interpret=interpret,
        name="linear_attention_forward_tpu",
    )(q, k, v, cum, doc, state)
    return results if save_states else (*results, None)


def _backward(q, k, v, cum, doc, states, final_state, dout, dfinal, interpret):
    """Gradients of q, k (``[batch * qk_heads, seq, dk]``), v, cum and the initial state, float32."""
    rows, dk, dv = v.shape[0], q.shape[-1], v.shape[-1]
    specs = _block_specs(q, v, doc, reverse=True)
    f32 = jnp.float32
    dq, dk_, dv_, dcum, dstate = pl.pallas_call(
        _backward_kernel,
        grid=_grid(v, doc),
        in_specs=[
            specs["qk"],
            specs["qk"],
            specs["v"],
            specs["cum"],
            specs["doc"],
            specs["states"],
            specs["state"],
            specs["v"],
            specs["state"],
        ],
        out_specs=[specs["qk_per_value_head"], specs["qk_per_value_head"], specs["v"], specs["cum"], specs["state"]],
        out_shape=[
            jax.ShapeDtypeStruct((rows, *q.shape[1:]), f32),
            jax.ShapeDtypeStruct((rows, *q.shape[1:]), f32),
            jax.ShapeDtypeStruct(v.shape, f32),
            jax.ShapeDtypeStruct(cum.shape, f32),
            jax.ShapeDtypeStruct((rows, dk, dv), f32),
        ],
        scratch_shapes=[pltpu.VMEM((dk, dv), f32), pltpu.VMEM((dk, dv), f32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=_DIMENSION_SEMANTICS),
        interpret=interpret,
        name="linear_attention_backward_tpu",
    )(q, k, v, cum, doc, states, final_state, dout, dfinal)

    def total(per_value_head):  # [batch * heads, ...] -> [batch * qk_heads, ...]
        return per_value_head.reshape(q.shape[0], rows // q.shape[0], *q.shape[1:]).sum(axis=1)

    return total(dq), total(dk_), dv_, dcum, dstate


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _chunked(q, k, v, cum, doc, state, interpret):
    outputs, final_state, _ = _forward(q, k, v, cum, doc, state, interpret, save_states=False)
    return outputs, final_state


def _chunked_forward(q, k, v, cum, doc, state, interpret):
    outputs, final_state, states = _forward(q, k, v, cum, doc, state, interpret, save_states=True)
    return (outputs, final_state), (q, k, v, cum, doc, states, final_state)


def _chunked_backward(interpret, residuals, cotangents):
    q, k, v, cum, doc, states, final_state = residuals
    dout, dfinal = cotangents
    dq, dk, dv, dcum, dstate = _backward(q, k, v, cum, doc, states, final_state, dout, dfinal, interpret)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dcum, None, dstate


_chunked.defvjp(_chunked_forward, _chunked_backward)


# ----------------------------------------------------------------------------- entry point


def _heads_major(x: jax.Array, chunk_size: int) -> jax.Array:
    """``[batch, seq, heads, d] -> [batch * heads, seq', d']``: ``seq`` padded to whole chunks,
    ``d`` to whole lanes, with zeros."""
    x = pad_axis_to_multiple(pad_axis_to_multiple(x, 1, chunk_size), 3, NUM_LANES)
    return jnp.moveaxis(x, 2, 1).reshape(-1, x.shape[1], x.shape[3])


def chunked_linear_attention_tpu(q, k, v, log_decay, doc, state, *, chunk_size, interpret):
    """The chunked algorithm as Mosaic TPU kernels, differentiable in q, k, v, log_decay, state.

    Args:
      q, k: ``[batch, seq, qk_heads, dk]``; v: ``[batch, seq, heads, dv]``.
      log_decay: ``[batch, seq, heads]`` float32; doc: ``[batch, seq]`` int32 document index
        (``document_boundaries.document_index``); state: ``[batch, heads, dk, dv]`` float32.
      chunk_size: chunk length ``L``, a multiple of 8 (the blocks' sublanes); the sequence is
        padded to a multiple of it (zero keys and values, no decay: padding changes neither
        outputs nor the final state).
      interpret: ``pallas_call``'s ``interpret`` (``dispatch.pallas_interpret``).

    Returns:
      ``(outputs [batch, seq, heads, dv] float32, final_state [batch, heads, dk, dv] float32)``.
    """
    batch, seq, heads, dv = v.shape
    dk = q.shape[-1]
    cum = jnp.cumsum(chunks.split_into_chunks(log_decay, chunk_size), axis=2)  # [batch, chunks, L, heads]
    cum = jnp.moveaxis(cum, 3, 1).reshape(batch * heads, -1, 1, chunk_size)
    doc = chunks.split_documents_into_chunks(doc, chunk_size)
    doc = (doc - chunks.document_before_each_chunk(doc)[..., None])[:, :, None, :]  # [batch, chunks, 1, L]
    state = pad_axis_to_multiple(pad_axis_to_multiple(state, 2, NUM_LANES), 3, NUM_LANES)
    outputs, final_state = _chunked(
        _heads_major(q, chunk_size),
        _heads_major(k, chunk_size),
        _heads_major(v, chunk_size),
        cum,
        doc,
        state.reshape(batch * heads, *state.shape[2:]),
        interpret,
    )
    outputs = jnp.moveaxis(outputs.reshape(batch, heads, *outputs.shape[1:]), 1, 2)[:, :seq, :, :dv]
    return outputs, final_state.reshape(batch, heads, *final_state.shape[1:])[:, :, :dk, :dv]

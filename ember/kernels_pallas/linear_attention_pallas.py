"""Pallas kernels for chunked linear attention on GPUs: forward and a hand-written backward,
chunk-parallel.

Only the ``[dk, dv]`` state has to travel from chunk to chunk; everything else a chunk
computes depends on its own tokens and the state entering it. So the work splits as in
flash-linear-attention:

- a *state pass*, one program per (batch, head, block of value columns) walking the chunks
  in order, which does only the light sequential part: the forward carries the state
  (``S_out = carry * S_in + sum_s w_s k_s^T v_s``) and writes the state entering every chunk;
  the backward walks in reverse carrying the state's gradient
  (``dS_in = carry * dS_out + sum_t e_t q_t^T dout_t``) and writes it for every chunk;
- *chunk kernels*, one program per (batch, head, chunk and a block of columns), all
  independent: the forward's outputs (masked, decayed ``[chunk, chunk]`` scores by ``v``,
  plus ``q`` by the entering state), per block of value columns; the backward's dv, per
  block of value columns, and its dq and dk (with the decay gradient), per block of *key*
  columns.

A chunk kernel's grid is ``chunks`` times larger than a state pass's: at batch 1, 16 heads,
16k tokens and chunks of 64 that is 8,192 forward programs against the 32 of a kernel that
walks each head's chunks itself, which left most of an H100's 132 SMs idle.

Value columns never mix (output column ``j`` reads state column ``j`` only), so the forward
and dv split them across programs, for the price of recomputing the ``[chunk, chunk]``
scores per block. dq and dk are sums over every value column (through the score gradients
``dout v^T`` and the states), so their kernel splits the key columns instead and adds up
the value columns in a loop: each writes its dq and dk whole, with no partial sums per value
block to write out and add up after (at dv = 128 and 32 columns a block those were 4x dq's
and dk's size in float32). Only the decay gradient, a ``[seq]`` vector per head, is summed
over key blocks outside. The chunk math is ``linear_attention_chunks.py``, shared with the
XLA path and the TPU kernels; the kernels compute the gradient of the chunk-local cumulative
log decay, and ``d log_decay`` follows by differentiating that cumulative sum outside.

Documents: each chunk's document indices are counted from the document of the state
entering it (as in the TPU kernels), so no program needs the position before its chunk:
the entering state reaches position ``t`` only where that index is 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ember.kernels_pallas import linear_attention_chunks as chunks
from ember.kernels_pallas.dispatch import triton_compiler_params
from ember.kernels_pallas.sequence_padding import pad_axis_to_multiple

# Block sizes and warps, chosen by compiling every kernel for sm_90 at dk = 128, chunks of 64
# and dv = 192 (python -m benchmarks.triton_compile linear_attention): none needs more than
# 112 KB of shared memory or spills registers. The kernels this replaced spilled 0.4 KB
# (forward) and 2.7 KB (backward); dq, dk and dv in one chunk kernel spilled 0.1-2 KB at every
# value block (16-64) and warp count (4-16) tried, and dq + dk/dv kernels split by value
# block still spilled 168 bytes in bfloat16.
STATE_VALUE_BLOCK = 32  # 4 state-pass programs per head at dv = 128, each carrying a [dk, 32] state
FORWARD_VALUE_BLOCK = 64
VALUE_GRADIENT_VALUE_BLOCK = 64
KEY_BLOCK = 64  # key columns per dq/dk program: 2 at dk = 128
LOOP_VALUE_BLOCK = 32  # value columns the dq/dk kernel adds up per loop step
STATE_PASS_WARPS = 8  # 4 spilled in the float32 gradient pass
OUTPUT_WARPS = 4  # 168 registers a thread, no spills: more blocks per SM than 8 warps
GRADIENT_WARPS = 8  # 4 spilled in the bfloat16 dv kernel


def column_block_size(columns: int, block: int) -> int:
    """Value or key columns per program (or loop step): ``block`` when that splits
    ``columns`` evenly, else all of them."""
    return block if columns > block and columns % block == 0 else columns


def padded_value_columns(dv: int) -> int:
    """``dv`` rounded up to tiles the Triton lowering accepts (power-of-two sizes): the next
    power of two up to 64, else a multiple of 64 (e.g. ``dv + 1 = 129`` with ``normalize``
    becomes 192, three blocks of 64). Zero columns are independent of the real ones."""
    return max(8, 1 << (dv - 1).bit_length()) if dv <= 64 else -(-dv // 64) * 64


# ----------------------------------------------------------------------------- chunk weights


def _chunk_weights(cum: jax.Array, doc: jax.Array, *, intra: bool = True) -> chunks.ChunkWeights:
    """One chunk's :class:`~linear_attention_chunks.ChunkWeights` from its ``[L]`` vectors:
    chunk-local cumulative log decay and document index counted from the entering state's
    document (0 before the first boundary inside the chunk). Without ``intra`` (the state
    passes, which need no scores) the ``[L, L]`` weights are left out: None."""
    last_cum, last_doc = chunks.last_position(cum), chunks.last_position(doc)  # [1]
    return chunks.ChunkWeights(
        intra=chunks.intra_chunk_weights(cum, doc) if intra else None,
        entering=chunks.entering_weights(cum, doc, 0)[:, None],
        keys=chunks.key_weights(cum, doc, last_cum, last_doc)[:, None],
        carry=chunks.carry_weight(last_cum, last_doc, 0)[:, None],
    )


# ----------------------------------------------------------------------------- kernels


def _load_chunk(ref, index, chunk_size):
    """Rows ``[index * chunk_size, (index + 1) * chunk_size)`` of a ``[seq, ...]`` ref."""
    rows = pl.ds(index * chunk_size, chunk_size)
    return ref[rows] if len(ref.shape) == 1 else ref[rows, :]


def _state_pass_kernel(k_ref, v_ref, cum_ref, doc_ref, initial_ref, states_ref, *, chunk_size, n_chunks):
    """Forward state pass of one (batch, head, value block); ``dv`` below is the block's
    columns. Refs: k ``[seq, dk]``, v ``[seq, dv]``, cum/doc ``[seq]``, initial ``[dk, dv]``;
    output states ``[n_chunks + 1, dk, dv]`` float32: the state entering every chunk, then
    the final state."""

    def chunk_step(index, state):
        states_ref[index] = state
        weights = _chunk_weights(
            _load_chunk(cum_ref, index, chunk_size), _load_chunk(doc_ref, index, chunk_size), intra=False
        )
        k, v = _load_chunk(k_ref, index, chunk_size), _load_chunk(v_ref, index, chunk_size)
        return weights.carry * state + chunks.weighted_outer_sum(k, weights.keys, v)

    states_ref[n_chunks] = jax.lax.fori_loop(0, n_chunks, chunk_step, initial_ref[...])


def _state_gradient_pass_kernel(q_ref, dout_ref, cum_ref, doc_ref, dfinal_ref, dstates_ref, *, chunk_size, n_chunks):
    """Backward state pass of one (batch, head, value block), chunks in reverse. Refs: q
    ``[seq, dk]``, dout ``[seq, dv]``, cum/doc ``[seq]``, dfinal ``[dk, dv]``; output dstates
    ``[n_chunks + 1, dk, dv]`` float32: the gradient of the state entering every chunk (entry
    0 is the initial state's), then dfinal."""
    f32 = jnp.float32

    def chunk_step(step, dstate_out):
        index = n_chunks - 1 - step
        dstates_ref[index + 1] = dstate_out
        weights = _chunk_weights(
            _load_chunk(cum_ref, index, chunk_size), _load_chunk(doc_ref, index, chunk_size), intra=False
        )
        q = _load_chunk(q_ref, index, chunk_size).astype(f32)
        dout = _load_chunk(dout_ref, index, chunk_size).astype(f32)
        return chunks.entering_state_gradient(q, dout, weights, dstate_out)

    dstates_ref[0] = jax.lax.fori_loop(0, n_chunks, chunk_step, dfinal_ref[...])


def _outputs_kernel(q_ref, k_ref, v_ref, cum_ref, doc_ref, state_ref, out_ref):
    """Outputs of one (batch, head, chunk, value block). Blocks: q/k ``[L, dk]``, v
    ``[L, dv]``, cum/doc ``[L]``, the entering state ``[dk, dv]``; outputs ``[L, dv]`` float32."""
    weights = _chunk_weights(cum_ref[...], doc_ref[...])
    out_ref[...] = chunks.chunk_outputs(q_ref[...], k_ref[...], v_ref[...], weights, state_ref[...])


def _value_gradients_kernel(q_ref, k_ref, dout_ref, cum_ref, doc_ref, dstate_out_ref, dv_ref):
    """dv of one (batch, head, chunk, value block). Blocks: q/k ``[L, dk]``, dout ``[L, dv]``,
    cum/doc ``[L]``, the gradient of the state leaving the chunk ``[dk, dv]``; dv ``[L, dv]``
    float32."""
    f32 = jnp.float32
    q, k, dout = (ref[...].astype(f32) for ref in (q_ref, k_ref, dout_ref))
    weights = _chunk_weights(cum_ref[...], doc_ref[...])
    dv_ref[...] = chunks.value_gradient(chunks.masked_scores(q, k, weights), dout, k, weights, dstate_out_ref[...])


def _query_key_gradients_kernel(
    q_ref,
    k_ref,
    v_ref,
    dout_ref,
    cum_ref,
    doc_ref,
    state_in_ref,
    state_out_ref,
    dstate_out_ref,
    dq_ref,
    dk_ref,
    dcum_ref,
    *,
    value_block,
):
    """dq and dk of one (batch, value head, chunk, block of key columns), and their share of
    the decay gradient. Blocks: q/k ``[L, bk]``, v/dout ``[L, dv]`` (all value columns),
    cum/doc ``[L]``, the states entering and leaving the chunk and the leaving one's gradient
    ``[bk, dv]`` (the block's rows); dq/dk ``[L, bk]`` and dcum ``[L]``, float32.

    The output products ``dout v^T`` and the state products sum over the value columns: a
    loop adds them up ``value_block`` columns at a time (the mask and decay applied once,
    after), so dq and dk are whole here (no partial sums per value block written out and
    added up after)."""
    f32 = jnp.float32
    length, key_block = q_ref.shape
    weights = _chunk_weights(cum_ref[...], doc_ref[...])

    def add_value_block(index, sums):
        dout_by_v, dout_by_state_in, v_by_dstate_out, dcum_last = sums
        columns = pl.ds(index * value_block, value_block)
        v, dout = v_ref[:, columns].astype(f32), dout_ref[:, columns]
        dstate_out = dstate_out_ref[:, columns]
        return (
            dout_by_v + chunks.output_products(dout, v),
            dout_by_state_in + chunks.state_product(dout, state_in_ref[:, columns]),
            v_by_dstate_out + chunks.state_product(v, dstate_out),
            dcum_last + chunks.last_state_gradient(state_out_ref[:, columns], dstate_out),
        )

    zeros = (
        jnp.zeros((length, length), f32),
        jnp.zeros((length, key_block), f32),
        jnp.zeros((length, key_block), f32),
        jnp.zeros((), f32),
    )
    dout_by_v, dout_by_state_in, v_by_dstate_out, dcum_last = jax.lax.fori_loop(
        0, v_ref.shape[1] // value_block, add_value_block, zeros
    )
    dscores = chunks.score_gradients(dout_by_v, weights)
    q, k = q_ref[...].astype(f32), k_ref[...].astype(f32)
    dq = chunks.query_gradient(dscores, k, weights, dout_by_state_in)
    dq_ref[...] = dq
    dk = chunks.key_gradient(dscores, q, weights, v_by_dstate_out)
    dk_ref[...] = dk
    is_last = jax.lax.broadcasted_iota(jnp.int32, (length,), 0) == length - 1
    dcum_ref[...] = chunks.decay_gradient(q, dq, k, dk) + jnp.where(is_last, dcum_last, 0.0)


# ----------------------------------------------------------------------------- pallas_calls


def _state_pass_specs(q_shape, v_shape, n_chunks, block):
    """BlockSpecs over a state pass's grid (batch, head, value block): whole sequences of one
    head."""
    _, seq, qk_heads, dk = q_shape
    group = v_shape[2] // qk_heads
    return {
        "qk": pl.BlockSpec((None, seq, None, dk), lambda b, h, j: (b, 0, h // group, 0)),
        "v": pl.BlockSpec((None, seq, None, block), lambda b, h, j: (b, 0, h, j)),
        "cum": pl.BlockSpec((None, seq, None), lambda b, h, j: (b, 0, h)),
        "doc": pl.BlockSpec((None, seq), lambda b, h, j: (b, 0)),
        "state": pl.BlockSpec((None, None, dk, block), lambda b, h, j: (b, h, 0, j)),
        "states": pl.BlockSpec((None, None, n_chunks + 1, dk, block), lambda b, h, j: (b, h, 0, 0, j)),
    }


def _chunk_specs(q_shape, v_shape, chunk_size, block):
    """BlockSpecs over a chunk kernel's grid (batch, head, chunk, value block): one chunk of
    one head; ``state_in``/``state_out`` pick the chunk's and the next chunk's entry of a
    ``[batch, heads, chunks + 1, dk, dv]`` array of states."""
    _, _, qk_heads, dk = q_shape
    group = v_shape[2] // qk_heads
    size = chunk_size
    return {
        "qk": pl.BlockSpec((None, size, None, dk), lambda b, h, c, j: (b, c, h // group, 0)),
        "v": pl.BlockSpec((None, size, None, block), lambda b, h, c, j: (b, c, h, j)),
        "cum": pl.BlockSpec((None, size, None), lambda b, h, c, j: (b, c, h)),
        "doc": pl.BlockSpec((None, size), lambda b, h, c, j: (b, c)),
        "state_in": pl.BlockSpec((None, None, None, dk, block), lambda b, h, c, j: (b, h, c, 0, j)),
        "state_out": pl.BlockSpec((None, None, None, dk, block), lambda b, h, c, j: (b, h, c + 1, 0, j)),
    }


def _key_block_specs(q_shape, v_shape, chunk_size, block):
    """BlockSpecs over the dq/dk kernel's grid (batch, head, chunk, key block of ``block``
    columns): one chunk of one value head, every value column; the states' rows of the key
    block. dq and dk come out per value head ``[batch, seq, heads, dk]``, dcum as one partial
    sum per key block ``[key blocks, batch, seq, heads]``."""
    _, _, qk_heads, _ = q_shape
    group = v_shape[2] // qk_heads
    size, dv = chunk_size, v_shape[-1]
    return {
        "qk": pl.BlockSpec((None, size, None, block), lambda b, h, c, i: (b, c, h // group, i)),
        "v": pl.BlockSpec((None, size, None, dv), lambda b, h, c, i: (b, c, h, 0)),
        "cum": pl.BlockSpec((None, size, None), lambda b, h, c, i: (b, c, h)),
        "doc": pl.BlockSpec((None, size), lambda b, h, c, i: (b, c)),
        "state_in": pl.BlockSpec((None, None, None, block, dv), lambda b, h, c, i: (b, h, c, i, 0)),
        "state_out": pl.BlockSpec((None, None, None, block, dv), lambda b, h, c, i: (b, h, c + 1, i, 0)),
        "per_value_head": pl.BlockSpec((None, size, None, block), lambda b, h, c, i: (b, c, h, i)),
        "partial_cum": pl.BlockSpec((None, None, size, None), lambda b, h, c, i: (i, b, c, h)),
    }


def _state_pass_params(interpret: bool):
    # Two stages: the next chunk's k and v (or q and dout) load while this chunk's matmul runs.
    return triton_compiler_params(interpret=interpret, num_warps=STATE_PASS_WARPS, num_stages=2)


def _chunk_kernel_params(interpret: bool, num_warps: int, num_stages: int = 1):
    # One stage where the kernel has no loop to pipeline; the dq/dk kernel's loop over value
    # blocks takes two (the next block's v, dout and states load during this one's matmuls).
    return triton_compiler_params(interpret=interpret, num_warps=num_warps, num_stages=num_stages)


def _state_pass(kernel, name, x, y, cum, doc, start, chunk_size, interpret):
    """A state pass over (batch, head, value block): ``kernel`` walks ``x`` ``[batch, seq,
    qk_heads, dk]`` and ``y`` ``[batch, seq, heads, dv]`` (k and v forward, q and dout
    backward) from ``start`` ``[batch, heads, dk, dv]``; returns its ``[batch, heads, chunks +
    1, dk, dv]`` float32 states."""
    batch, seq, heads, dv = y.shape
    n_chunks = seq // chunk_size
    block = column_block_size(dv, STATE_VALUE_BLOCK)
    specs = _state_pass_specs(x.shape, y.shape, n_chunks, block)
    return pl.pallas_call(
        functools.partial(kernel, chunk_size=chunk_size, n_chunks=n_chunks),
        grid=(batch, heads, dv // block),
        in_specs=[specs["qk"], specs["v"], specs["cum"], specs["doc"], specs["state"]],
        out_specs=specs["states"],
        out_shape=jax.ShapeDtypeStruct((batch, heads, n_chunks + 1, x.shape[-1], dv), jnp.float32),
        interpret=interpret,
        compiler_params=_state_pass_params(interpret),
        name=name,
    )(x, y, cum, doc, start)


def _states(k, v, cum, doc, initial, chunk_size, interpret):
    """``[batch, heads, chunks + 1, dk, dv]`` float32: the state entering every chunk, then the final one."""
    name = "linear_attention_state_pass"
    return _state_pass(_state_pass_kernel, name, k, v, cum, doc, initial, chunk_size, interpret)


def _state_gradients(q, dout, cum, doc, dfinal, chunk_size, interpret):
    """``[batch, heads, chunks + 1, dk, dv]`` float32: the gradient of the state entering every
    chunk (entry 0: the initial state's), then ``dfinal``."""
    name = "linear_attention_state_gradient_pass"
    return _state_pass(_state_gradient_pass_kernel, name, q, dout, cum, doc, dfinal, chunk_size, interpret)


def _forward(q, k, v, cum, doc, initial, chunk_size, interpret):
    """Outputs ``[batch, seq, heads, dv]`` and the states of :func:`_states`, float32."""
    batch, seq, heads, dv = v.shape
    states = _states(k, v, cum, doc, initial, chunk_size, interpret)
    block = column_block_size(dv, FORWARD_VALUE_BLOCK)
    specs = _chunk_specs(q.shape, v.shape, chunk_size, block)
    outputs = pl.pallas_call(
        _outputs_kernel,
        grid=(batch, heads, seq // chunk_size, dv // block),
        in_specs=[specs["qk"], specs["qk"], specs["v"], specs["cum"], specs["doc"], specs["state_in"]],
        out_specs=specs["v"],
        out_shape=jax.ShapeDtypeStruct((batch, seq, heads, dv), jnp.float32),
        interpret=interpret,
        compiler_params=_chunk_kernel_params(interpret, OUTPUT_WARPS),
        name="linear_attention_outputs",
    )(q, k, v, cum, doc, states)
    return outputs, states


def _value_gradients(q, k, dout, cum, doc, dstates, chunk_size, interpret):
    """dv ``[batch, seq, heads, dv]`` float32."""
    batch, seq, heads, dv = dout.shape
    block = column_block_size(dv, VALUE_GRADIENT_VALUE_BLOCK)
    specs = _chunk_specs(q.shape, dout.shape, chunk_size, block)
    return pl.pallas_call(
        _value_gradients_kernel,
        grid=(batch, heads, seq // chunk_size, dv // block),
        in_specs=[specs["qk"], specs["qk"], specs["v"], specs["cum"], specs["doc"], specs["state_out"]],
        out_specs=specs["v"],
        out_shape=jax.ShapeDtypeStruct(dout.shape, jnp.float32),
        interpret=interpret,
        compiler_params=_chunk_kernel_params(interpret, GRADIENT_WARPS),
        name="linear_attention_value_gradients",
    )(q, k, dout, cum, doc, dstates)


def _query_key_gradients(q, k, v, dout, cum, doc, states, dstates, chunk_size, interpret):
    """dq and dk per value head ``[batch, seq, heads, dk]`` and the decay gradient's partial
    sums per key block ``[key blocks, batch, seq, heads]``, float32."""
    batch, seq, heads, dv = v.shape
    dk = q.shape[-1]
    block = column_block_size(dk, KEY_BLOCK)
    specs = _key_block_specs(q.shape, v.shape, chunk_size, block)
    per_value_head = jax.ShapeDtypeStruct((batch, seq, heads, dk), jnp.float32)
    return pl.pallas_call(
        functools.partial(_query_key_gradients_kernel, value_block=column_block_size(dv, LOOP_VALUE_BLOCK)),
        grid=(batch, heads, seq // chunk_size, dk // block),
        in_specs=[
            *(specs[name] for name in ("qk", "qk", "v", "v", "cum", "doc")),
            *(specs[name] for name in ("state_in", "state_out", "state_out")),
        ],
        out_specs=[specs["per_value_head"], specs["per_value_head"], specs["partial_cum"]],
        out_shape=[
            per_value_head,
            per_value_head,
            jax.ShapeDtypeStruct((dk // block, batch, seq, heads), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=_chunk_kernel_params(interpret, GRADIENT_WARPS, num_stages=2),
        name="linear_attention_query_key_gradients",
    )(q, k, v, dout, cum, doc, states, states, dstates)


def _backward(q, k, v, cum, doc, states, dout, dfinal, chunk_size, interpret):
    batch, seq, heads, _ = v.shape
    qk_heads, dk = q.shape[2], q.shape[3]
    dstates = _state_gradients(q, dout, cum, doc, dfinal, chunk_size, interpret)
    dv = _value_gradients(q, k, dout, cum, doc, dstates, chunk_size, interpret)
    dq, dk_, dcum = _query_key_gradients(q, k, v, dout, cum, doc, states, dstates, chunk_size, interpret)

    def group_total(per_value_head):  # [batch, seq, heads, dk] -> [batch, seq, qk_heads, dk]
        return per_value_head.reshape(batch, seq, qk_heads, heads // qk_heads, dk).sum(axis=3)

    return group_total(dq), group_total(dk_), dv, dcum.sum(axis=0), dstates[:, :, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _chunked(q, k, v, cum, doc, state, chunk_size, interpret):
    outputs, states = _forward(q, k, v, cum, doc, state, chunk_size, interpret)
    return outputs, states[:, :, -1]


def _chunked_forward(q, k, v, cum, doc, state, chunk_size, interpret):
    outputs, states = _forward(q, k, v, cum, doc, state, chunk_size, interpret)
    return (outputs, states[:, :, -1]), (q, k, v, cum, doc, states)


def _chunked_backward(chunk_size, interpret, residuals, cotangents):
    q, k, v, cum, doc, states = residuals
    dout, dfinal = cotangents
    dq, dk, dv, dcum, dstate = _backward(q, k, v, cum, doc, states, dout, dfinal, chunk_size, interpret)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dcum, None, dstate


_chunked.defvjp(_chunked_forward, _chunked_backward)


def chunked_linear_attention_pallas(q, k, v, log_decay, doc, state, *, chunk_size, interpret):
    """The chunked algorithm as Pallas kernels, differentiable in q, k, v, log_decay, state.

    Args:
      q, k: ``[batch, seq, qk_heads, dk]``; v: ``[batch, seq, heads, dv]``.
      log_decay: ``[batch, seq, heads]`` float32; doc: ``[batch, seq]`` int32 document index
        (``document_boundaries.document_index``); state: ``[batch, heads, dk, dv]`` float32.
      chunk_size: chunk length; the sequence is padded to a multiple of it (zero keys and
        values, no decay: padding changes neither outputs nor the final state).
      interpret: run in the Pallas interpreter.

    Returns:
      ``(outputs [batch, seq, heads, dv] float32, final_state [batch, heads, dk, dv] float32)``.
    """
    batch, seq, _, dv = v.shape

    padded = functools.partial(pad_axis_to_multiple, axis=1, multiple=chunk_size)
    cum = jnp.cumsum(chunks.split_into_chunks(log_decay, chunk_size), axis=2).reshape(batch, -1, v.shape[2])
    doc = chunks.split_documents_into_chunks(doc, chunk_size)  # [batch, chunks, chunk]
    doc = (doc - chunks.document_before_each_chunk(doc)[..., None]).reshape(batch, -1)
    v, state = (pad_axis_to_multiple(x, x.ndim - 1, padded_value_columns(dv)) for x in (v, state))
    outputs, final_state = _chunked(padded(q), padded(k), padded(v), cum, doc, state, chunk_size, interpret)
    return outputs[:, :seq, :, :dv], final_state[..., :dv]

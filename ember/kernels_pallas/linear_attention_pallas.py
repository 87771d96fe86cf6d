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
- *chunk kernels*, one program per (batch, head, chunk, block of value columns), all
  independent: the forward's outputs (masked, decayed ``[chunk, chunk]`` scores by ``v``,
  plus ``q`` by the entering state); the backward's dq (with its share of the decay
  gradient) in one kernel and dk, dv (with theirs) in another, since one kernel holding dq,
  dk, q and k as ``[chunk, dk]`` float32 tiles spilled registers.

A chunk kernel's grid is ``chunks`` times larger than a state pass's: at batch 1, 16 heads,
16k tokens and chunks of 64 that is 8,192 forward programs against the 32 of a kernel that
walks each head's chunks itself, which left most of an H100's 132 SMs idle.

Value columns never mix (output column ``j`` reads state column ``j`` only), so splitting
them multiplies the programs for the price of recomputing the ``[chunk, chunk]`` scores per
block; the backward's dq, dk and decay gradients are then partial sums per value block,
added up outside the kernel. The chunk math is ``linear_attention_chunks.py``, shared with
the XLA path and the TPU kernels; the chunk kernels compute the gradient of the chunk-local
cumulative log decay, and ``d log_decay`` follows by differentiating that cumulative sum
outside the kernels.

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
# 144 KB of shared memory, and all but the bfloat16 dk/dv kernel (168 bytes) are free of
# register spills. One kernel for dq, dk and dv spilled 0.1-2 KB at every value block (16-64)
# and warp count (4-16) tried; the kernels this replaced spilled 0.4 KB (forward) and 2.7 KB.
STATE_VALUE_BLOCK = 32  # 4 state-pass programs per head at dv = 128, each carrying a [dk, 32] state
FORWARD_VALUE_BLOCK = 64
QUERY_GRADIENT_VALUE_BLOCK = 64  # half the dq partial sums of 32 columns, still without spills
KEY_VALUE_GRADIENT_VALUE_BLOCK = 32  # 64 spilled 272 bytes in bfloat16 (32: 168)
STATE_PASS_WARPS = 8  # 4 spilled in the float32 gradient pass
OUTPUT_WARPS = 4  # 168 registers a thread, no spills: more blocks per SM than 8 warps
GRADIENT_WARPS = 8  # each gradient kernel holds [chunk, dk] float32 tiles of q, k and its gradient


def value_block_size(dv: int, block: int) -> int:
    """Value columns per program: ``block`` when that splits ``dv`` evenly, else all of them."""
    return block if dv > block and dv % block == 0 else dv


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


def _query_gradients_kernel(q_ref, k_ref, v_ref, dout_ref, cum_ref, doc_ref, state_in_ref, dq_ref, dcum_ref):
    """dq of one (batch, head, chunk, value block). Blocks as the forward's, plus dout
    ``[L, dv]``; dq ``[L, dk]`` and its share of dcum ``[L]`` (this value head's and block's
    partial sums), float32."""
    f32 = jnp.float32
    q, k, v, dout = (ref[...].astype(f32) for ref in (q_ref, k_ref, v_ref, dout_ref))
    weights = _chunk_weights(cum_ref[...], doc_ref[...])
    dscores = chunks.score_gradients(dout, v, weights)
    dq_ref[...], dcum_ref[...] = chunks.query_gradient(q, k, dout, dscores, weights, state_in_ref[...])


def _key_value_gradients_kernel(
    q_ref, k_ref, v_ref, dout_ref, cum_ref, doc_ref, state_out_ref, dstate_out_ref, dk_ref, dv_ref, dcum_ref
):
    """dk and dv of one (batch, head, chunk, value block). Blocks as the forward's, plus dout
    ``[L, dv]``, the state leaving the chunk and its gradient ``[dk, dv]``; dk ``[L, dk]`` and
    its share of dcum ``[L]`` (partial sums as the dq kernel's), dv ``[L, dv]``, float32."""
    f32 = jnp.float32
    q, k, v, dout = (ref[...].astype(f32) for ref in (q_ref, k_ref, v_ref, dout_ref))
    weights = _chunk_weights(cum_ref[...], doc_ref[...])
    dscores = chunks.score_gradients(dout, v, weights)
    dk, dv, dcum_keys = chunks.key_value_gradients(q, k, v, dout, dscores, weights, dstate_out_ref[...])
    dv_ref[...] = dv
    dk_ref[...] = dk
    dcum_last = chunks.last_state_gradient(state_out_ref[...], dstate_out_ref[...])
    is_last = jax.lax.broadcasted_iota(jnp.int32, dcum_keys.shape, 0) == dcum_keys.shape[0] - 1
    dcum_ref[...] = dcum_keys + jnp.where(is_last, dcum_last, 0.0)


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
        # Partial gradients, one slab per value block: [value blocks, batch, seq, heads, ...].
        "partial_qk": pl.BlockSpec((None, None, size, None, dk), lambda b, h, c, j: (j, b, c, h, 0)),
        "partial_cum": pl.BlockSpec((None, None, size, None), lambda b, h, c, j: (j, b, c, h)),
    }


def _state_pass_params(interpret: bool):
    # Two stages: the next chunk's k and v (or q and dout) load while this chunk's matmul runs.
    return triton_compiler_params(interpret=interpret, num_warps=STATE_PASS_WARPS, num_stages=2)


def _chunk_kernel_params(interpret: bool, num_warps: int):
    return triton_compiler_params(interpret=interpret, num_warps=num_warps, num_stages=1)  # no loop to pipeline


def _states(k, v, cum, doc, initial, chunk_size, interpret):
    """``[batch, heads, chunks + 1, dk, dv]`` float32: the state entering every chunk, then the final one."""
    batch, seq, heads, dv = v.shape
    dk = k.shape[-1]
    n_chunks = seq // chunk_size
    block = value_block_size(dv, STATE_VALUE_BLOCK)
    specs = _state_pass_specs(k.shape, v.shape, n_chunks, block)
    return pl.pallas_call(
        functools.partial(_state_pass_kernel, chunk_size=chunk_size, n_chunks=n_chunks),
        grid=(batch, heads, dv // block),
        in_specs=[specs["qk"], specs["v"], specs["cum"], specs["doc"], specs["state"]],
        out_specs=specs["states"],
        out_shape=jax.ShapeDtypeStruct((batch, heads, n_chunks + 1, dk, dv), jnp.float32),
        interpret=interpret,
        compiler_params=_state_pass_params(interpret),
        name="linear_attention_state_pass",
    )(k, v, cum, doc, initial)


def _state_gradients(q, dout, cum, doc, dfinal, chunk_size, interpret):
    """``[batch, heads, chunks + 1, dk, dv]`` float32: the gradient of the state entering every
    chunk (entry 0: the initial state's), then ``dfinal``."""
    batch, seq, heads, dv = dout.shape
    dk = q.shape[-1]
    n_chunks = seq // chunk_size
    block = value_block_size(dv, STATE_VALUE_BLOCK)
    specs = _state_pass_specs(q.shape, dout.shape, n_chunks, block)
    return pl.pallas_call(
        functools.partial(_state_gradient_pass_kernel, chunk_size=chunk_size, n_chunks=n_chunks),
        grid=(batch, heads, dv // block),
        in_specs=[specs["qk"], specs["v"], specs["cum"], specs["doc"], specs["state"]],
        out_specs=specs["states"],
        out_shape=jax.ShapeDtypeStruct((batch, heads, n_chunks + 1, dk, dv), jnp.float32),
        interpret=interpret,
        compiler_params=_state_pass_params(interpret),
        name="linear_attention_state_gradient_pass",
    )(q, dout, cum, doc, dfinal)


def _forward(q, k, v, cum, doc, initial, chunk_size, interpret):
    """Outputs ``[batch, seq, heads, dv]`` and the states of :func:`_states`, float32."""
    batch, seq, heads, dv = v.shape
    states = _states(k, v, cum, doc, initial, chunk_size, interpret)
    block = value_block_size(dv, FORWARD_VALUE_BLOCK)
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


def _gradient_call(kernel, name, block, q, k, v, dout, cum, doc, states, state_specs, outputs, chunk_size, interpret):
    """A gradient kernel over (batch, head, chunk, value block of ``block`` columns): the
    chunk's q, k, v, dout, cum and doc, then ``states`` as ``state_specs`` name them
    (entries of :func:`_chunk_specs`); ``outputs`` names the results: ``"partial_qk"``
    ``[value blocks, batch, seq, heads, dk]``, ``"partial_cum"`` ``[value blocks, batch, seq,
    heads]`` or ``"v"`` ``[batch, seq, heads, dv]``, all float32."""
    batch, seq, heads, dv = v.shape
    specs = _chunk_specs(q.shape, v.shape, chunk_size, block)
    value_blocks = dv // block
    shapes = {
        "partial_qk": (value_blocks, batch, seq, heads, q.shape[-1]),
        "partial_cum": (value_blocks, batch, seq, heads),
        "v": v.shape,
    }
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, seq // chunk_size, value_blocks),
        in_specs=[specs[n] for n in ("qk", "qk", "v", "v", "cum", "doc", *state_specs)],
        out_specs=[specs[n] for n in outputs],
        out_shape=[jax.ShapeDtypeStruct(shapes[n], jnp.float32) for n in outputs],
        interpret=interpret,
        compiler_params=_chunk_kernel_params(interpret, GRADIENT_WARPS),
        name=name,
    )(q, k, v, dout, cum, doc, *states)


def _backward(q, k, v, cum, doc, states, dout, dfinal, chunk_size, interpret):
    batch, seq, heads, dv = v.shape
    qk_heads, dk = q.shape[2], q.shape[3]
    dstates = _state_gradients(q, dout, cum, doc, dfinal, chunk_size, interpret)
    inputs = (q, k, v, dout, cum, doc)
    dq, dcum_queries = _gradient_call(
        _query_gradients_kernel,
        "linear_attention_query_gradients",
        value_block_size(dv, QUERY_GRADIENT_VALUE_BLOCK),
        *inputs,
        (states,),
        ("state_in",),
        ("partial_qk", "partial_cum"),
        chunk_size,
        interpret,
    )
    dk_, dv_, dcum_keys = _gradient_call(
        _key_value_gradients_kernel,
        "linear_attention_key_value_gradients",
        value_block_size(dv, KEY_VALUE_GRADIENT_VALUE_BLOCK),
        *inputs,
        (states, dstates),
        ("state_out", "state_out"),
        ("partial_qk", "v", "partial_cum"),
        chunk_size,
        interpret,
    )

    def total(partial_qk):  # [value blocks, batch, seq, heads, dk] -> [batch, seq, qk_heads, dk]
        return partial_qk.sum(axis=0).reshape(batch, seq, qk_heads, heads // qk_heads, dk).sum(axis=3)

    dcum = dcum_queries.sum(axis=0) + dcum_keys.sum(axis=0)
    return total(dq), total(dk_), dv_, dcum, dstates[:, :, 0]


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

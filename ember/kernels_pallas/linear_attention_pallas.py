"""Pallas kernels for chunked linear attention: forward and a hand-written backward.

One program per (batch, head, block of value columns) walks that head's chunks in order,
carrying its ``[dk, value_block]`` slice of the state; the chunk math is
``linear_attention_chunks.py``, shared with the XLA path. Value columns never mix (output
column ``j`` reads state column ``j`` only), so splitting them multiplies the programs a GPU
can run at once for the price of recomputing the ``[chunk, chunk]`` scores per block. The
forward also writes the state entering every chunk (``[batch, heads, chunks + 1, dk, dv]``,
the last being the final state); the backward walks the chunks in reverse carrying the
state's gradient and reads those states instead of recomputing them, as
flash-linear-attention does. Its dq, dk and decay gradients are partial sums per value
block, added up outside the kernel.

The backward's chunk math (``linear_attention_chunks.chunk_gradients``, shared with the TPU
kernel) gives the gradient of the chunk-local cumulative log decay; ``d log_decay`` then
follows by differentiating that cumulative sum outside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ember.kernels_pallas import linear_attention_chunks as chunks
from ember.kernels_pallas.dispatch import triton_compiler_params
from ember.kernels_pallas.sequence_padding import pad_axis_to_multiple


def _load_chunk(ref, index, chunk_size):
    """Rows ``[index * chunk_size, (index + 1) * chunk_size)`` of a ``[seq, ...]`` ref."""
    rows = pl.ds(index * chunk_size, chunk_size)
    return ref[rows] if len(ref.shape) == 1 else ref[rows, :]


def _doc_before(doc_ref, index, chunk_size):
    """Document index of the position before chunk ``index`` (0 before the sequence)."""
    previous = doc_ref[jnp.maximum(index * chunk_size - 1, 0)]
    return jnp.where(index == 0, 0, previous)


def _forward_kernel(q_ref, k_ref, v_ref, cum_ref, doc_ref, state_ref, out_ref, states_ref, *, chunk_size, n_chunks):
    """One (batch, head, value block); ``dv`` below is the block's columns. Refs: q/k
    ``[seq, dk]``, v ``[seq, dv]``, cum/doc ``[seq]``, state ``[dk, dv]``; outputs ``[seq, dv]``
    float32 and states ``[n_chunks + 1, dk, dv]``."""

    def chunk_step(index, state):
        states_ref[index] = state
        outputs, state = chunks.chunk_outputs_and_state(
            _load_chunk(q_ref, index, chunk_size),
            _load_chunk(k_ref, index, chunk_size),
            _load_chunk(v_ref, index, chunk_size),
            _load_chunk(cum_ref, index, chunk_size),
            _load_chunk(doc_ref, index, chunk_size),
            _doc_before(doc_ref, index, chunk_size),
            state,
        )
        out_ref[pl.ds(index * chunk_size, chunk_size), :] = outputs
        return state

    states_ref[n_chunks] = jax.lax.fori_loop(0, n_chunks, chunk_step, state_ref[...])


def _backward_kernel(
    q_ref,
    k_ref,
    v_ref,
    cum_ref,
    doc_ref,
    states_ref,
    dout_ref,
    dfinal_ref,
    dq_ref,
    dk_ref,
    dv_ref,
    dcum_ref,
    dstate_ref,
    *,
    chunk_size,
    n_chunks,
):
    """One (batch, head, value block), chunks in reverse. Extra refs: dout ``[seq, dv]``,
    dfinal ``[dk, dv]``; gradients dq/dk ``[seq, dk]`` and dcum ``[seq]`` (this value head's
    and block's share), dv ``[seq, dv]``, dstate ``[dk, dv]`` (of the initial state); all
    float32."""
    f32 = jnp.float32

    def chunk_step(step, dstate_out):
        index = n_chunks - 1 - step
        q = _load_chunk(q_ref, index, chunk_size).astype(f32)
        k = _load_chunk(k_ref, index, chunk_size).astype(f32)
        v = _load_chunk(v_ref, index, chunk_size).astype(f32)
        dout = _load_chunk(dout_ref, index, chunk_size).astype(f32)
        cum = _load_chunk(cum_ref, index, chunk_size)
        doc = _load_chunk(doc_ref, index, chunk_size)
        weights = chunks.chunk_weights(cum, doc, _doc_before(doc_ref, index, chunk_size))
        state_in, state_out = states_ref[index], states_ref[index + 1]
        dq, dk, dv, dcum, dcum_last, dstate_in = chunks.chunk_gradients(
            q, k, v, dout, weights, state_in, state_out, dstate_out
        )
        is_last = jax.lax.broadcasted_iota(jnp.int32, (chunk_size,), 0) == chunk_size - 1
        rows = pl.ds(index * chunk_size, chunk_size)
        dq_ref[rows, :] = dq
        dk_ref[rows, :] = dk
        dv_ref[rows, :] = dv
        dcum_ref[rows] = dcum + jnp.where(is_last, dcum_last, 0.0)
        return dstate_in

    dstate_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk_step, dfinal_ref[...])


FORWARD_VALUE_BLOCK = 64
BACKWARD_VALUE_BLOCK = 32  # the backward holds more [dk, block] tiles: 64 overran the H200's shared memory in f32


def value_block_size(dv: int, block: int = FORWARD_VALUE_BLOCK) -> int:
    """Value columns per program: ``block`` when that splits ``dv`` evenly, else all of them."""
    return block if dv > block and dv % block == 0 else dv


def padded_value_columns(dv: int) -> int:
    """``dv`` rounded up to tiles the Triton lowering accepts (power-of-two sizes): the next
    power of two up to 64, else a multiple of 64 (e.g. ``dv + 1 = 129`` with ``normalize``
    becomes 192, three blocks of 64). Zero columns are independent of the real ones."""
    return max(8, 1 << (dv - 1).bit_length()) if dv <= 64 else -(-dv // 64) * 64


def _specs(q_shape, v_shape, n_chunks, block):
    """BlockSpecs over the grid (batch, head, value block of ``block`` columns): whole
    sequences of one head."""
    _, seq, qk_heads, dk = q_shape
    group = v_shape[2] // qk_heads
    return {
        "qk": pl.BlockSpec((None, seq, None, dk), lambda b, h, j: (b, 0, h // group, 0)),
        "v": pl.BlockSpec((None, seq, None, block), lambda b, h, j: (b, 0, h, j)),
        "per_head_scalar": pl.BlockSpec((None, seq, None), lambda b, h, j: (b, 0, h)),
        "doc": pl.BlockSpec((None, seq), lambda b, h, j: (b, 0)),
        "state": pl.BlockSpec((None, None, dk, block), lambda b, h, j: (b, h, 0, j)),
        "states": pl.BlockSpec((None, None, n_chunks + 1, dk, block), lambda b, h, j: (b, h, 0, 0, j)),
        # Partial gradients, one slab per value block: [value blocks, batch, seq, heads, ...].
        "partial_qk": pl.BlockSpec((None, None, seq, None, dk), lambda b, h, j: (j, b, 0, h, 0)),
        "partial_scalar": pl.BlockSpec((None, None, seq, None), lambda b, h, j: (j, b, 0, h)),
    }


def _compiler_params(interpret: bool):
    # One stage: each chunk needs the state the previous chunk left, so prefetching the next
    # chunk's tiles buys little, and Triton's default three stages overran the H200's 227 KB
    # of shared memory at dk = 128 (234 KB in bf16, 283 KB in f32).
    return triton_compiler_params(interpret=interpret, num_warps=4, num_stages=1)


def _grid(v_shape, block):
    batch, _, heads, dv = v_shape
    return (batch, heads, dv // block)


def _forward(q, k, v, cum, doc, state, chunk_size, interpret):
    batch, seq, heads, dv = v.shape
    dk = q.shape[-1]
    n_chunks = seq // chunk_size
    block = value_block_size(dv, FORWARD_VALUE_BLOCK)
    specs = _specs(q.shape, v.shape, n_chunks, block)
    outputs, states = pl.pallas_call(
        functools.partial(_forward_kernel, chunk_size=chunk_size, n_chunks=n_chunks),
        grid=_grid(v.shape, block),
        in_specs=[specs["qk"], specs["qk"], specs["v"], specs["per_head_scalar"], specs["doc"], specs["state"]],
        out_specs=[specs["v"], specs["states"]],
        out_shape=[
            jax.ShapeDtypeStruct((batch, seq, heads, dv), jnp.float32),
            jax.ShapeDtypeStruct((batch, heads, n_chunks + 1, dk, dv), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=_compiler_params(interpret),
        name="linear_attention_forward",
    )(q, k, v, cum, doc, state)
    return outputs, states


def _backward(q, k, v, cum, doc, states, dout, dfinal, chunk_size, interpret):
    batch, seq, heads, dv = v.shape
    qk_heads, dk = q.shape[2], q.shape[3]
    n_chunks = seq // chunk_size
    block = value_block_size(dv, BACKWARD_VALUE_BLOCK)
    specs = _specs(q.shape, v.shape, n_chunks, block)
    grid = _grid(v.shape, block)
    f32 = jnp.float32
    dq, dk_, dv_, dcum, dstate = pl.pallas_call(
        functools.partial(_backward_kernel, chunk_size=chunk_size, n_chunks=n_chunks),
        grid=grid,
        in_specs=[
            specs["qk"],
            specs["qk"],
            specs["v"],
            specs["per_head_scalar"],
            specs["doc"],
            specs["states"],
            specs["v"],
            specs["state"],
        ],
        out_specs=[specs["partial_qk"], specs["partial_qk"], specs["v"], specs["partial_scalar"], specs["state"]],
        out_shape=[
            jax.ShapeDtypeStruct((grid[2], batch, seq, heads, dk), f32),
            jax.ShapeDtypeStruct((grid[2], batch, seq, heads, dk), f32),
            jax.ShapeDtypeStruct((batch, seq, heads, dv), f32),
            jax.ShapeDtypeStruct((grid[2], batch, seq, heads), f32),
            jax.ShapeDtypeStruct((batch, heads, dk, dv), f32),
        ],
        interpret=interpret,
        compiler_params=_compiler_params(interpret),
        name="linear_attention_backward",
    )(q, k, v, cum, doc, states, dout, dfinal)

    def total(partial_qk):  # [value blocks, batch, seq, heads, dk] -> [batch, seq, qk_heads, dk]
        return partial_qk.sum(axis=0).reshape(batch, seq, qk_heads, heads // qk_heads, dk).sum(axis=3)

    return total(dq), total(dk_), dv_, dcum.sum(axis=0), dstate


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
    doc = chunks.split_documents_into_chunks(doc, chunk_size).reshape(batch, -1)
    v, state = (pad_axis_to_multiple(x, x.ndim - 1, padded_value_columns(dv)) for x in (v, state))
    outputs, final_state = _chunked(padded(q), padded(k), padded(v), cum, doc, state, chunk_size, interpret)
    return outputs[:, :seq, :, :dv], final_state[..., :dv]

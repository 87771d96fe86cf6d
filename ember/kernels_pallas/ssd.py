"""Mamba-2's state space duality (SSD) scan (DESIGN.md section 4).

For each batch element and head ``h`` (group ``g = h // (heads // groups)``), with a state
``H`` of shape ``[head_dim, state]``::

    dt_t = softplus(dt_t + dt_bias)                      (dt_softplus; else dt_t + dt_bias)
    H_t  = exp(dt_t A) H_{t-1} + dt_t x_t^T B_t          (H_{t-1} := 0 after a document boundary)
    y_t  = H_t C_t + D x_t

SSD is linear attention with a per-step scalar decay (the Mamba-2 paper's duality):
queries ``C``, keys ``B``, values ``dt * x``, ``log_decay = dt * A``. So :func:`ssd` runs the
chunked linear-attention algorithm of ``linear_attention.py`` -- intra-chunk matmuls,
inter-chunk state recurrence, output combination -- as its XLA einsum path or its Pallas
kernels for NVIDIA GPUs and TPUs (forward and backward), with the ``B``/``C`` groups read
through the kernels' head grouping rather than copied per head. Gradients for ``dt``, ``A``,
``dt_bias`` and ``D`` follow by differentiating this thin mapping.

Forms:
- :func:`ssd_reference`: the recurrence above as a ``lax.scan``, THE reference;
  :func:`ssd_step` is its one-token update (decode).
- :func:`ssd_quadratic`: the masked-matrix ("attention") form, ``O(seq^2)``.
- :func:`ssd` with ``impl`` "xla" / "pallas" / "interpret" / "interpret_tpu": the chunked
  algorithm (``impl`` as for :func:`linear_attention`, whose kernels it runs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ember.kernels_pallas.dispatch import resolve_impl
from ember.kernels_pallas.document_boundaries import document_starts
from ember.kernels_pallas.linear_attention import (
    KERNEL_BACKENDS,
    ChunkSize,
    linear_attention,
    linear_attention_quadratic,
)
from ember.kernels_pallas.step_inputs import check_one_token


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _validate(op, x, dt, A, B, C, D, dt_bias, initial_state, segment_ids, state_name="initial_state") -> None:
    """Raises ``ValueError`` naming the first argument whose shape or dtype is wrong
    (``state_name``: what the caller calls the state argument)."""
    if x.ndim != 4:
        raise ValueError(f"{op}: x must be [batch, seq, heads, head_dim], got shape {x.shape}")
    batch, seq, heads, _head_dim = x.shape
    if B.ndim != 4 or B.shape[:2] != (batch, seq) or B.shape[2] == 0 or heads % B.shape[2]:
        raise ValueError(
            f"{op}: B must be [batch, seq, groups, state] with x's batch and seq {(batch, seq)} and "
            f"groups dividing heads={heads}, got shape {B.shape}"
        )
    if C.shape != B.shape:
        raise ValueError(f"{op}: C must have B's shape {B.shape}, got {C.shape}")
    expected = {"dt": (batch, seq, heads), "A": (heads,), "D": (heads,), "dt_bias": (heads,)}
    for name, value in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("dt_bias", dt_bias)):
        if value is None:
            continue
        if not _is_float(value):
            raise ValueError(f"{op}: {name} must be a floating dtype, got {value.dtype}")
        if name in expected and value.shape != expected[name]:
            raise ValueError(f"{op}: {name} must have shape {expected[name]}, got {value.shape}")
    if not (x.dtype == B.dtype == C.dtype):
        raise ValueError(f"{op}: x, B and C must share one dtype, got {x.dtype}, {B.dtype}, {C.dtype}")
    if initial_state is not None:
        expected_state = state_shape(x.shape, B.shape)
        if initial_state.shape != expected_state or not _is_float(initial_state):
            raise ValueError(
                f"{op}: {state_name} must be a float array {expected_state} ([batch, heads, head_dim, "
                f"state]), got {initial_state.dtype}{list(initial_state.shape)}"
            )
    if segment_ids is not None and (
        segment_ids.shape != (batch, seq) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
    ):
        raise ValueError(
            f"{op}: segment_ids must be an integer array [batch, seq] = {(batch, seq)}, "
            f"got {segment_ids.dtype}{list(segment_ids.shape)}"
        )


def state_shape(x_shape, B_shape) -> tuple[int, int, int, int]:
    """The SSM state's shape, ``[batch, heads, head_dim, state]`` (Mamba's layout)."""
    batch, _, heads, head_dim = x_shape
    return (batch, heads, head_dim, B_shape[-1])


def _time_step(dt, dt_bias, dt_softplus):
    """The effective step size ``dt`` in float32 (bias added, softplus applied)."""
    dt = dt.astype(jnp.float32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(jnp.float32)
    return jax.nn.softplus(dt) if dt_softplus else dt


def _skip(y, x, D):
    """Adds the ``D x`` skip connection (float32)."""
    return y if D is None else y + D.astype(jnp.float32)[:, None] * x.astype(jnp.float32)


# ----------------------------------------------------------------------------- recurrence


def _ssd_update(state, x, dt, A, B, C):
    """One step for every batch element and head (float32): state ``[batch, heads, head_dim,
    state]``, x ``[batch, heads, head_dim]``, dt ``[batch, heads]``, A ``[heads]``, B/C
    ``[batch, heads, state]`` (already per head). Returns ``(y [batch, heads, head_dim],
    new_state)`` without the D skip."""
    decay = jnp.exp(dt * A)[..., None, None]
    state = decay * state + (dt[..., None] * x)[..., :, None] * B[..., None, :]
    return jnp.einsum("bhpn,bhn->bhp", state, C), state


def _per_head(groups_array, heads, axis):
    return jnp.repeat(groups_array, heads // groups_array.shape[axis], axis=axis)


def ssd_step(x, dt, A, B, C, state, *, D=None, dt_bias=None, dt_softplus=True):
    """One decode step (``O(1)`` in the position).

    Args:
      x: ``[batch, heads, head_dim]``; dt: ``[batch, heads]``; A, D, dt_bias: ``[heads]``;
      B, C: ``[batch, groups, state]``; state: ``[batch, heads, head_dim, state]``.

    Returns:
      ``(y [batch, heads, head_dim] in x's dtype, new_state float32)``.
    """
    check_one_token(
        "ssd_step",
        (
            ("x", x, "[batch, heads, head_dim]"),
            ("dt", dt, "[batch, heads]"),
            ("B", B, "[batch, groups, state]"),
            ("C", C, "[batch, groups, state]"),
        ),
    )
    _validate("ssd_step", x[:, None], dt[:, None], A, B[:, None], C[:, None], D, dt_bias, state, None, "state")
    heads = x.shape[1]
    f32 = jnp.float32
    y, new_state = _ssd_update(
        state.astype(f32),
        x.astype(f32),
        _time_step(dt, dt_bias, dt_softplus),
        A.astype(f32),
        _per_head(B, heads, 1).astype(f32),
        _per_head(C, heads, 1).astype(f32),
    )
    return _skip(y, x, D).astype(x.dtype), new_state


def ssd_reference(
    x,
    dt,
    A,
    B,
    C,
    *,
    D=None,
    dt_bias=None,
    dt_softplus=True,
    initial_state=None,
    return_final_state=False,
    segment_ids=None,
):
    """The definition: a sequential ``lax.scan`` of :func:`ssd_step`'s update in float32.
    Same arguments and results as :func:`ssd`."""
    _validate("ssd_reference", x, dt, A, B, C, D, dt_bias, initial_state, segment_ids)
    batch, seq, heads, _ = x.shape
    f32 = jnp.float32
    state = jnp.zeros(state_shape(x.shape, B.shape), f32) if initial_state is None else initial_state.astype(f32)
    new_document = document_starts(segment_ids, batch, seq)
    A = A.astype(f32)

    def step(state, inputs):
        x_t, dt_t, B_t, C_t, reset_t = inputs
        state = jnp.where(reset_t[:, None, None, None], 0.0, state)
        y_t, state = _ssd_update(state, x_t, dt_t, A, B_t, C_t)
        return state, y_t

    time_major = lambda a: jnp.moveaxis(a, 1, 0)  # noqa: E731
    final_state, y = jax.lax.scan(
        step,
        state,
        (
            time_major(x.astype(f32)),
            time_major(_time_step(dt, dt_bias, dt_softplus)),
            time_major(_per_head(B, heads, 2).astype(f32)),
            time_major(_per_head(C, heads, 2).astype(f32)),
            time_major(new_document),
        ),
    )
    y = _skip(jnp.moveaxis(y, 0, 1), x, D).astype(x.dtype)
    return (y, final_state) if return_final_state else y


# ----------------------------------------------------------------------------- as linear attention


def _as_linear_attention(x, dt, A, B, initial_state, dt_bias, dt_softplus):
    """SSD's operands in linear-attention terms: ``(keys, values, log_decay, state)``;
    queries are ``C`` unchanged. The state is transposed to linear attention's
    ``[batch, heads, state, head_dim]``."""
    dt = _time_step(dt, dt_bias, dt_softplus)
    values = (dt[..., None] * x.astype(jnp.float32)).astype(x.dtype)
    log_decay = dt * A.astype(jnp.float32)
    state = None if initial_state is None else jnp.swapaxes(initial_state, -1, -2)
    return B, values, log_decay, state


def _from_linear_attention(result, x, D, return_final_state):
    y, final_state = result
    y = _skip(y, x, D).astype(x.dtype)
    return (y, jnp.swapaxes(final_state, -1, -2)) if return_final_state else y


def ssd_quadratic(
    x,
    dt,
    A,
    B,
    C,
    *,
    D=None,
    dt_bias=None,
    dt_softplus=True,
    initial_state=None,
    return_final_state=False,
    segment_ids=None,
):
    """The masked-matrix form ``y = (L o C B^T)(dt x) + D x`` with ``L`` the
    ``[seq, seq]`` decay mask; ``O(seq^2)``. Same arguments and results as :func:`ssd`."""
    _validate("ssd_quadratic", x, dt, A, B, C, D, dt_bias, initial_state, segment_ids)
    keys, values, log_decay, state = _as_linear_attention(x, dt, A, B, initial_state, dt_bias, dt_softplus)
    result = linear_attention_quadratic(
        C, keys, values, log_decay=log_decay, initial_state=state, return_final_state=True, segment_ids=segment_ids
    )
    return _from_linear_attention(result, x, D, return_final_state)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "return_final_state", "chunk_size", "impl"))
def ssd(
    x,
    dt,
    A,
    B,
    C,
    *,
    D=None,
    dt_bias=None,
    dt_softplus=True,
    initial_state=None,
    return_final_state=False,
    segment_ids=None,
    chunk_size=128,
    impl="auto",
):
    """Mamba-2's SSD scan, chunked.

    Args:
      x: ``[batch, seq, heads, head_dim]``.
      dt: ``[batch, seq, heads]`` raw step sizes (``dt_bias`` added and softplus applied here).
      A: ``[heads]``, negative (Mamba stores ``A = -exp(A_log)``).
      B, C: ``[batch, seq, groups, state]``, ``groups`` dividing ``heads``; x's dtype.
      D: ``[heads]`` skip weights or None; dt_bias: ``[heads]`` or None.
      dt_softplus: apply softplus to ``dt + dt_bias``.
      initial_state: ``[batch, heads, head_dim, state]`` or None (zeros).
      return_final_state: also return the state after the last token (float32).
      segment_ids: ``[batch, seq]`` integers; the state resets wherever the id changes.
      chunk_size: chunk length (power of two >= 8); results do not depend on it.
      impl: "auto", "pallas", "interpret", "interpret_tpu" or "xla" (see ``dispatch.py``).

    Returns:
      y ``[batch, seq, heads, head_dim]`` in x's dtype; with ``return_final_state``,
      ``(y, final_state)``.
    """
    _validate("ssd", x, dt, A, B, C, D, dt_bias, initial_state, segment_ids)
    ChunkSize(chunk_size)
    impl = resolve_impl(impl, op="ssd", kernel_backends=KERNEL_BACKENDS)
    keys, values, log_decay, state = _as_linear_attention(x, dt, A, B, initial_state, dt_bias, dt_softplus)
    result = linear_attention(
        C,
        keys,
        values,
        log_decay=log_decay,
        initial_state=state,
        return_final_state=True,
        segment_ids=segment_ids,
        chunk_size=chunk_size,
        impl=impl,
    )
    return _from_linear_attention(result, x, D, return_final_state)

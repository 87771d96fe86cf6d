"""Causal depthwise 1-D convolution with a rolling state (Mamba's short convolution).

For each channel ``c``, with ``width`` taps::

    y[t, c] = bias[c] + sum_j weight[j, c] * x[t - (width - 1) + j, c]

``weight[-1]`` multiplies the current token. (A PyTorch ``Conv1d(groups=channels)`` weight
``[channels, 1, width]`` is ``weight[:, 0, :].T`` here.) Inputs before the sequence come
from ``state``, the last ``width - 1`` inputs of the previous call (oldest first), so a
sequence processed in pieces -- or token by token with :func:`short_conv_step` -- gives
the same outputs as processed whole. Taps never reach across a document boundary
(``segment_ids``).

There is no Pallas kernel: the op is memory-bound and ``width`` (typically 4) shifted
multiply-adds fuse into one XLA loop, so ``impl`` accepts "auto" and "xla" only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ember.kernels_pallas.dispatch import resolve_impl
from ember.kernels_pallas.document_boundaries import document_index
from ember.kernels_pallas.step_inputs import check_one_token

KERNEL_BACKENDS: tuple[str, ...] = ()
"""Backends with a Pallas kernel for this op: none (see the module docstring)."""


def _validate(op, x, weight, bias, state, segment_ids, state_name="initial_state") -> None:
    """Raises ``ValueError`` naming the first argument whose shape or dtype is wrong
    (``state_name``: what the caller calls the state argument)."""
    if x.ndim != 3 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{op}: x must be a float array [batch, seq, channels], got {x.dtype}{list(x.shape)}")
    batch, seq, channels = x.shape
    if weight.ndim != 2 or weight.shape[1] != channels or weight.shape[0] < 1:
        raise ValueError(f"{op}: weight must be [width, channels={channels}], got shape {weight.shape}")
    if weight.dtype != x.dtype:
        raise ValueError(f"{op}: weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if bias is not None and (bias.shape != (channels,) or bias.dtype != x.dtype):
        raise ValueError(f"{op}: bias must be {x.dtype}[{channels}], got {bias.dtype}{list(bias.shape)}")
    expected = (batch, weight.shape[0] - 1, channels)
    if state is not None and (state.shape != expected or not jnp.issubdtype(state.dtype, jnp.floating)):
        raise ValueError(
            f"{op}: {state_name} must be a float array [batch, width - 1, channels] = {expected}, "
            f"got {state.dtype}{list(state.shape)}"
        )
    if segment_ids is not None and (
        segment_ids.shape != (batch, seq) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
    ):
        raise ValueError(
            f"{op}: segment_ids must be an integer array [batch, seq] = {(batch, seq)}, "
            f"got {segment_ids.dtype}{list(segment_ids.shape)}"
        )


def _causal_conv(history_and_x, doc, weight, bias):
    """The convolution over ``[batch, width - 1 + seq, channels]`` inputs (history first),
    ``doc`` ``[batch, width - 1 + seq]`` the document of each input. Returns
    ``[batch, seq, channels]`` float32."""
    width = weight.shape[0]
    seq = history_and_x.shape[1] - (width - 1)
    f32 = jnp.float32
    current_doc = doc[:, width - 1 :]
    outputs = jnp.zeros((history_and_x.shape[0], seq, history_and_x.shape[2]), f32)
    for tap in range(width):
        same_doc = (doc[:, tap : tap + seq] == current_doc)[..., None]
        shifted = history_and_x[:, tap : tap + seq].astype(f32)
        outputs = outputs + jnp.where(same_doc, shifted, 0.0) * weight[tap].astype(f32)
    return outputs if bias is None else outputs + bias.astype(f32)


def short_conv_reference(x, weight, bias=None, *, initial_state=None, return_final_state=False, segment_ids=None):
    """The definition: ``width`` shifted multiply-adds in float32. Same arguments and
    results as :func:`short_conv`."""
    _validate("short_conv_reference", x, weight, bias, initial_state, segment_ids)
    batch, seq, channels = x.shape
    history_length = weight.shape[0] - 1
    history = jnp.zeros((batch, history_length, channels), x.dtype) if initial_state is None else initial_state
    history_and_x = jnp.concatenate([history.astype(x.dtype), x], axis=1)
    doc = document_index(segment_ids, batch, seq)
    # The history belongs to the first document (index 0).
    doc = jnp.concatenate([jnp.zeros((batch, history_length), jnp.int32), doc], axis=1)
    outputs = _causal_conv(history_and_x, doc, weight, bias).astype(x.dtype)
    if not return_final_state:
        return outputs
    # Keep only inputs of the last document, so the next call cannot reach across a boundary.
    last = slice(history_and_x.shape[1] - history_length, None)
    final_state = jnp.where((doc[:, last] == doc[:, -1:])[..., None], history_and_x[:, last], 0)
    return outputs, final_state.astype(x.dtype)


def short_conv_step(x, state, weight, bias=None):
    """One decode step.

    Args:
      x: ``[batch, channels]``; state: ``[batch, width - 1, channels]`` (the previous
        ``width - 1`` inputs, oldest first); weight ``[width, channels]``; bias ``[channels]``.

    Returns:
      ``(y [batch, channels], new_state)``, the state rolled by one token.
    """
    check_one_token("short_conv_step", (("x", x, "[batch, channels]"),))
    _validate("short_conv_step", x[:, None], weight, bias, state, None, "state")
    window = jnp.concatenate([state.astype(x.dtype), x[:, None]], axis=1)
    y = jnp.einsum("bwc,wc->bc", window.astype(jnp.float32), weight.astype(jnp.float32))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype), window[:, 1:].astype(state.dtype)


@functools.partial(jax.jit, static_argnames=("return_final_state", "impl"))
def short_conv(x, weight, bias=None, *, initial_state=None, return_final_state=False, segment_ids=None, impl="auto"):
    """Causal depthwise convolution.

    Args:
      x: ``[batch, seq, channels]``.
      weight: ``[width, channels]`` (x's dtype); bias: ``[channels]`` or None.
      initial_state: ``[batch, width - 1, channels]`` inputs before the sequence, or None (zeros).
      return_final_state: also return the last ``width - 1`` inputs (zeros where they belong
        to an earlier document than the last token), the next call's ``initial_state``.
      segment_ids: ``[batch, seq]`` integers; taps do not cross a change of id.
      impl: "auto" or "xla" (no Pallas kernel, see the module docstring).

    Returns:
      y ``[batch, seq, channels]`` in x's dtype; with ``return_final_state``, ``(y, state)``.
    """
    if impl in ("pallas", "interpret", "interpret_tpu"):
        raise ValueError(f"short_conv: impl must be 'auto' or 'xla' (this op has no Pallas kernel), got {impl!r}")
    resolve_impl(impl, op="short_conv", kernel_backends=KERNEL_BACKENDS)  # rejects unknown names
    _validate("short_conv", x, weight, bias, initial_state, segment_ids)  # errors name the op called
    return short_conv_reference(
        x, weight, bias, initial_state=initial_state, return_final_state=return_final_state, segment_ids=segment_ids
    )

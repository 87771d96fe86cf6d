"""Shared checks for the sequence-mixer tests (linear attention, SSD): values and
gradients of a random linear functional of an op's outputs and final state."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tests.host_random import numpy_rng
from tests.tolerances import assert_allclose


@functools.cache
def _jitted_loss_and_grads(fn, options):
    """Jitted value-and-grad of ``sum(results * cotangents)``, cached per form and options
    so tests with equal shapes share one compilation."""

    def loss(differentiable, segment_ids, cotangents):
        results = fn(**differentiable, segment_ids=segment_ids, return_final_state=True, **dict(options))
        return sum(jnp.sum(r.astype(jnp.float32) * c) for r, c in zip(results, cotangents)), results

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def values_and_grads(fn, inputs, cotangent_key, *, grad_args, output_like, **options):
    """``((outputs, final_state), {name: gradient})`` of ``fn(**inputs[grad_args], ...)``.

    The functional weights the outputs (shaped like ``inputs[output_like]``) and the final
    state (like ``inputs["initial_state"]``) by random cotangents, so the gradients exercise
    every cotangent path.
    """
    gen = numpy_rng(cotangent_key)
    cotangents = tuple(gen.standard_normal(inputs[n].shape, np.float32) for n in (output_like, "initial_state"))
    differentiable = {n: inputs[n] for n in grad_args}
    loss_and_grads = _jitted_loss_and_grads(fn, tuple(sorted(options.items())))
    (_, results), grads = loss_and_grads(differentiable, inputs["segment_ids"], cotangents)
    return results, grads


def assert_forms_agree(forms, expected, expected_grads, *, dtype, grad_args, output_name):
    """Each ``forms[name] = ((outputs, final_state), grads)`` (from :func:`values_and_grads`)
    equals the reference's ``expected``/``expected_grads`` within ``dtype``'s tolerance:
    the final state and the gradients sum over the sequence, so they get looser scales."""
    for form, (actual, grads) in forms.items():
        assert actual[0].dtype == dtype
        assert_allclose(actual[0], expected[0], dtype=dtype, err_msg=f"{form} {output_name}")
        # The final state sums every token's contribution: error grows with the sequence.
        assert_allclose(actual[1], expected[1], dtype=dtype, scale=4.0, err_msg=f"{form} final state")
        for name in grad_args:
            # Gradients sum over the sequence (and batch and channels) and the cotangents.
            assert_allclose(grads[name], expected_grads[name], dtype=dtype, scale=8.0, err_msg=f"{form} d{name}")

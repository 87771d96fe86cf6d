"""The score math every attention reference shares: masked softmax's own derivative."""

import jax
import jax.numpy as jnp
import numpy as np

from ember.kernels_pallas.attention_math import masked_softmax
from tests.tolerances import assert_allclose


def _softmax_by_formula(logits, visible):
    """The masked softmax written out, differentiated by autodiff (what the custom rule replaces)."""
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnormalized = jnp.where(visible, jnp.exp(logits - row_max), 0.0)
    total = jnp.sum(unnormalized, axis=-1, keepdims=True)
    return unnormalized / jnp.where(total == 0.0, 1.0, total)


def test_masked_softmax_gradients_equal_autodiff_of_its_formula_with_a_row_seeing_nothing(rng):
    logits_key, cotangent_key, mask_key = jax.random.split(rng, 3)
    logits = 3.0 * jax.random.normal(logits_key, (2, 5, 7))  # [batch, queries, keys]
    cotangent = jax.random.normal(cotangent_key, logits.shape)
    visible = jax.random.bernoulli(mask_key, 0.6, logits.shape).at[0, 2].set(False)

    @jax.jit
    def values_and_grads(logits, cotangent):
        results = []
        for softmax in (masked_softmax, _softmax_by_formula):
            loss = lambda x, softmax=softmax: jnp.sum(jnp.tanh(softmax(x, visible)) * cotangent)  # noqa: E731
            # A Hessian-vector product too: the rule must be differentiable again.
            hvp = jax.jvp(jax.grad(loss), (logits,), (cotangent,))[1]
            results.append((softmax(logits, visible), jax.grad(loss)(logits), hvp))
        return results

    (weights, grad, hvp), (expected, expected_grad, expected_hvp) = values_and_grads(logits, cotangent)
    assert_allclose(weights, expected)
    assert_allclose(grad, expected_grad)
    assert_allclose(hvp, expected_hvp)
    assert np.all(np.asarray(weights[0, 2]) == 0.0) and np.all(np.asarray(grad[0, 2]) == 0.0)
    assert np.all(np.asarray(grad)[~np.asarray(visible)] == 0.0)

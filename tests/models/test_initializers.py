"""The vmap-safe orthogonal initializer: orthogonal rows or columns times the gain, the same
values under vmap as key by key, and no batched QR in a vmapped init (XLA:CPU's batched QR
can deadlock its thread pool, see ember/models/initializers.py)."""

import jax
import jax.extend
import numpy as np
import pytest

from ember.models.initializers import orthogonal


@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (3, 3, 2, 5)])
def test_kernel_is_orthogonal_times_the_gain(rng, shape):
    kernel = np.asarray(orthogonal(2.0)(rng, shape), np.float64).reshape(-1, shape[-1])
    small = min(kernel.shape)
    gram = kernel.T @ kernel if kernel.shape[0] >= kernel.shape[1] else kernel @ kernel.T
    np.testing.assert_allclose(gram, 4.0 * np.eye(small), atol=1e-5)


def test_vmap_gives_the_per_key_values_and_no_batched_qr(rng):
    keys = jax.random.split(rng, 4)
    init = orthogonal(1.0)
    batched = jax.vmap(lambda key: init(key, (5, 3)))(keys)
    assert batched.shape == (4, 5, 3)
    for key, kernel in zip(keys, batched):
        np.testing.assert_allclose(kernel, init(key, (5, 3)), atol=1e-6)

    def qr_operand_ranks(jaxpr):
        for eqn in jaxpr.eqns:
            if "qr" in eqn.primitive.name or "geqrf" in eqn.primitive.name:
                yield eqn.invars[0].aval.ndim
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from qr_operand_ranks(sub)

    ranks = list(qr_operand_ranks(jax.make_jaxpr(jax.vmap(lambda key: init(key, (5, 3))))(keys).jaxpr))
    assert ranks and set(ranks) == {2}, ranks


def test_rank_one_shapes_are_refused(rng):
    with pytest.raises(ValueError, match="rank >= 2"):
        orthogonal()(rng, (4,))

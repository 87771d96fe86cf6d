"""Random test inputs drawn on the host, seeded from a JAX key.

Drawing with NumPy gives each test fresh inputs (the key comes from the per-test ``rng``
fixture) without compiling JAX's random-bit kernels for every shape, which dominates the
time of small CPU tests.
"""

import jax
import numpy as np


def numpy_rng(key) -> np.random.Generator:
    """A NumPy generator seeded from the JAX PRNG ``key``."""
    return np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())


def perturbed(params, key, scale: float = 0.1):
    """``params`` plus host-drawn normal noise of std ``scale`` on every leaf (same dtypes), so
    tests do not run at an initialisation with special structure (identity convolutions,
    zero biases)."""
    generator = numpy_rng(key)
    return jax.tree.map(
        lambda leaf: (np.asarray(leaf, np.float32) + scale * generator.standard_normal(leaf.shape)).astype(leaf.dtype),
        params,
    )

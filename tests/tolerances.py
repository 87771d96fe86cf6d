"""The one table of numerical tolerances, keyed by dtype.

Every value comparison in the suite goes through :func:`assert_allclose` (or reads
:func:`tolerance`), so loosening a dtype's tolerance is a change in exactly one place.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

TOLERANCES: dict[np.dtype, dict[str, float]] = {
    np.dtype(np.float64): {"atol": 1e-9, "rtol": 1e-9},
    np.dtype(np.float32): {"atol": 1e-5, "rtol": 1e-5},
    np.dtype(jnp.float16): {"atol": 2e-3, "rtol": 2e-3},
    np.dtype(jnp.bfloat16): {"atol": 2e-2, "rtol": 2e-2},
}


def tolerance(dtype, scale: float = 1.0) -> dict[str, float]:
    """``{"atol": ..., "rtol": ...}`` for ``dtype``, multiplied by ``scale``.

    ``scale`` is for comparisons whose error grows with the problem (long reductions,
    gradients through many layers); a test that uses it says why.
    """
    dtype = np.dtype(dtype)
    if dtype not in TOLERANCES:
        raise KeyError(f"no tolerance for dtype {dtype}; known: {', '.join(str(d) for d in TOLERANCES)}")
    return {name: value * scale for name, value in TOLERANCES[dtype].items()}


def assert_allclose(actual, expected, *, dtype=None, scale: float = 1.0, err_msg: str = "") -> None:
    """Asserts ``actual`` ~= ``expected`` within the tolerance of ``dtype`` (default: the
    dtype of ``actual``). Both are compared in float64; NaN never passes."""
    actual_arr = np.asarray(actual)
    dtype = actual_arr.dtype if dtype is None else dtype
    actual64 = actual_arr.astype(np.float64)
    expected64 = np.asarray(expected).astype(np.float64)
    assert not np.isnan(actual64).any(), f"NaN in actual values. {err_msg}"
    np.testing.assert_allclose(actual64, expected64, err_msg=err_msg, **tolerance(dtype, scale))

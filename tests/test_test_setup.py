"""The suite's own set-up: 8 CPU devices, XLA optimizations off unless a test is marked, and the
tolerance table."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import assert_allclose, tolerance


def test_eight_host_cpu_devices():
    assert jax.default_backend() == "cpu"
    assert jax.device_count() == 8


def test_tolerances_are_keyed_by_dtype_and_ordered_by_precision():
    widths = [tolerance(d)["atol"] for d in (np.float64, np.float32, jnp.float16, jnp.bfloat16)]
    assert widths == sorted(widths)
    assert tolerance(np.float32, scale=10)["rtol"] == pytest.approx(10 * tolerance(np.float32)["rtol"])
    with pytest.raises(KeyError, match="no tolerance for dtype int32"):
        tolerance(np.int32)


def test_assert_allclose_uses_the_dtype_of_actual(rng):
    x = jax.random.normal(rng, (64,), jnp.float32)
    assert_allclose(x.astype(jnp.bfloat16), x)  # bf16 rounding is inside the bf16 tolerance
    with pytest.raises(AssertionError):
        assert_allclose(x, x + 1e-3)  # ... but far outside the f32 one
    with pytest.raises(AssertionError, match="NaN"):
        assert_allclose(x.at[3].set(jnp.nan), x)


def test_xla_optimizations_are_off_by_default():
    assert jax.config.read("jax_disable_most_optimizations")
    assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"  # and in the subprocesses tests start


@pytest.mark.xla_optimized
def test_a_marked_test_compiles_with_xla_optimizations():
    assert not jax.config.read("jax_disable_most_optimizations")
    assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "0"

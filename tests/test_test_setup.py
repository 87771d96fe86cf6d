"""The suite's own set-up: 8 CPU devices, XLA's fast compile (optimizations and fusion emitters
off) unless a test is marked, and the tolerance table."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compiler

from tests import xla_settings
from tests.tolerances import assert_allclose, tolerance


def test_eight_host_cpu_devices():
    assert jax.default_backend() == "cpu"
    assert jax.device_count() == 8


def test_hypothesis_draws_the_same_examples_with_or_without_ci():
    """Hypothesis derandomizes and drops its example database only where ``CI`` is set (its own
    ``ci`` profile); the suite's profile does both everywhere, so a local run checks CI's examples."""
    import hypothesis

    current = hypothesis.settings()
    assert current.derandomize and current.database is None and current.deadline is None


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


def fusion_emitters_in_compile_options():
    overrides = dict(compiler.get_compile_options(num_replicas=1, num_partitions=1).env_option_overrides)
    return overrides["xla_cpu_use_fusion_emitters"]


def test_xla_optimizations_and_fusion_emitters_are_off_by_default(rng):
    assert jax.config.read("jax_disable_most_optimizations")
    # ... and in the subprocesses tests start
    assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"
    assert xla_settings.LOOP_EMITTERS in os.environ["XLA_FLAGS"].split()
    assert xla_settings.ONE_CODEGEN_PART in os.environ["XLA_FLAGS"].split()
    assert xla_settings.subprocess_xla_flags("--xla_backend_optimization_level=0").split() == [
        "--xla_backend_optimization_level=0",
        xla_settings.ONE_CODEGEN_PART,
        xla_settings.LOOP_EMITTERS,
    ]
    assert fusion_emitters_in_compile_options() is False
    # The emitters differ in tanh's last bits without optimizations: a plain jit uses the loop ones.
    x = 4 * jax.random.normal(rng, (4096,))
    by_emitters = {
        fusion: np.asarray(jax.jit(jnp.tanh, compiler_options={"xla_cpu_use_fusion_emitters": fusion})(x))
        for fusion in (False, True)
    }
    assert not np.array_equal(by_emitters[False], by_emitters[True])
    np.testing.assert_array_equal(jax.jit(jnp.tanh)(x), by_emitters[False])


@pytest.mark.xla_optimized
def test_a_marked_test_compiles_with_xla_optimizations_and_fusion_emitters():
    assert not jax.config.read("jax_disable_most_optimizations")
    assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "0"
    assert xla_settings.LOOP_EMITTERS not in os.environ["XLA_FLAGS"].split()
    assert xla_settings.ONE_CODEGEN_PART in os.environ["XLA_FLAGS"].split()
    assert xla_settings.subprocess_xla_flags("--xla_dump_to=x") == f"--xla_dump_to=x {xla_settings.ONE_CODEGEN_PART}"
    assert fusion_emitters_in_compile_options() is True
    # ... and its short programs (evaluations) can compile fast again, in this process only
    with xla_settings.fast_compiles():
        assert jax.config.read("jax_disable_most_optimizations")
        assert fusion_emitters_in_compile_options() is False
    assert not jax.config.read("jax_disable_most_optimizations")
    assert fusion_emitters_in_compile_options() is True

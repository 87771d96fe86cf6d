"""ember.core.precision: dtype names and policies."""

import jax.numpy as jnp
import numpy as np
import pytest

from ember.core.precision import Precision, parse_dtype


def test_parse_dtype_names():
    assert parse_dtype("bf16") == jnp.bfloat16 and parse_dtype("BFloat16") == jnp.bfloat16
    assert parse_dtype("fp32") == jnp.float32 and parse_dtype("half") == jnp.float16
    assert parse_dtype(np.float32) == jnp.float32
    with pytest.raises(ValueError, match=r"unknown dtype 'bf15'; valid names: .*bf16"):
        parse_dtype("bf15")
    with pytest.raises(ValueError, match="must be floating point"):
        parse_dtype(np.int32)


def test_named_and_explicit_policies():
    mixed = Precision.from_string("bf16")
    assert (mixed.param_dtype, mixed.compute_dtype, mixed.output_dtype) == (jnp.float32, jnp.bfloat16, jnp.float32)
    assert Precision.from_string("pure_bf16").param_dtype == jnp.bfloat16
    explicit = Precision.from_string("params=f32, compute=f16")
    assert (explicit.compute_dtype, explicit.output_dtype) == (jnp.float16, jnp.float32)
    with pytest.raises(ValueError, match="unknown precision policy 'bf17'"):
        Precision.from_string("bf17")
    with pytest.raises(ValueError, match="unknown dtype 'f8'"):
        Precision(compute="f8")


def test_float64_without_64_bit_jax_is_refused():
    """``precision: params=f64,compute=f64,output=f64`` was accepted while JAX ran in 32 bits:
    every array it asked for came out float32 (a UserWarning per array), so the run a researcher
    set up to check float32 against float64 silently computed in float32."""
    import jax

    from ember.core.errors import ConfigError
    from ember.models.config import ModelConfig

    assert not jax.config.jax_enable_x64
    with pytest.raises(ValueError, match=r"precision compute=f64 needs 64-bit JAX"):
        Precision(compute="f64")
    with pytest.raises(ConfigError, match="params=float64 needs 64-bit JAX") as error:
        ModelConfig(precision="params=float64,compute=f32")
    assert error.value.key == "precision"
    with jax.enable_x64(True):
        assert Precision(params="f64", compute="f64").compute_dtype == jnp.float64

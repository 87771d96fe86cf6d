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

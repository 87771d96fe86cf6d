"""Shared checks for the flash-attention tests: kernel vs reference, values and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ember.kernels_pallas.flash_attention import FlashBlockSizes, flash_attention, flash_attention_reference
from tests.host_random import numpy_rng
from tests.tolerances import assert_allclose

# Interpret-mode kernels are large while-loop programs: XLA's backend optimizations take
# seconds to compile them and buy nothing at test sizes.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def random_qkv(rng, *, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype=jnp.float32):
    """Fresh normal ``q [batch, q_len, heads, head_dim]``, ``k, v [batch, kv_len, kv_heads,
    head_dim]`` and an output cotangent shaped like ``q``."""
    gen = numpy_rng(rng)
    q_shape, kv_shape = (batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim)
    return tuple(
        jnp.asarray(gen.standard_normal(shape, dtype=np.float32), dtype)
        for shape in (q_shape, kv_shape, kv_shape, q_shape)
    )


def assert_kernel_matches_reference(
    q, k, v, d_out, *, block_sizes=None, grads=True, scale=1.0, impl="interpret", **options
):
    """``flash_attention(impl=impl)`` output (and dq, dk, dv for the cotangent ``d_out``)
    equal :func:`flash_attention_reference` evaluated in float32 on the same inputs, within
    the tolerance of the inputs' dtype times ``scale``. Returns the kernel output."""
    dtype = q.dtype
    block_sizes = block_sizes or FlashBlockSizes(32, 32)

    def kernel(q, k, v):
        return flash_attention(q, k, v, impl=impl, block_sizes=block_sizes, **options)

    def reference(q, k, v):
        return flash_attention_reference(q, k, v, **options)

    as_f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    if not grads:
        out = jax.jit(kernel, compiler_options=FAST_COMPILE)(q, k, v)
        assert_allclose(out, jax.jit(reference)(*as_f32), dtype=dtype, scale=scale, err_msg="output")
        return out
    out, kernel_grads = _value_and_vjp(kernel, (q, k, v), d_out)
    expected, reference_grads = _value_and_vjp(reference, as_f32, d_out.astype(jnp.float32))
    assert_allclose(out, expected, dtype=dtype, scale=scale, err_msg="output")
    for name, got, want in zip(("dq", "dk", "dv"), kernel_grads, reference_grads):
        assert got.dtype == dtype, name
        assert_allclose(got, want, dtype=dtype, scale=scale, err_msg=name)
    return out


def _value_and_vjp(fn, primals, cotangent):
    """``(fn(*primals), vjp(cotangent))`` computed in one jitted program (one compilation)."""

    def run(primals, cotangent):
        out, vjp = jax.vjp(fn, *primals)
        return out, vjp(cotangent)

    return jax.jit(run, compiler_options=FAST_COMPILE)(tuple(primals), cotangent)

"""``read_dtypes``: the one dtype a function converts an input to at every use, followed
through layout ops, nested jits, custom derivatives, remat, scans and conds; None as soon as
one use reads the input as it is."""

import jax
import jax.numpy as jnp
import numpy as np

from ember.core.read_dtypes import read_dtypes

BF16 = np.dtype(jnp.bfloat16)
X = jax.ShapeDtypeStruct((4, 6), jnp.float32)
Y = jax.ShapeDtypeStruct((6,), jnp.float32)


def bf16(x):
    return x.astype(jnp.bfloat16)


def test_an_input_converted_at_every_use_is_read_in_that_dtype():
    assert read_dtypes(lambda x: bf16(x) * 2, X) == [BF16]
    # after layout ops, slices and gathers, and at several uses
    layout = lambda x: (bf16(x.T.reshape(3, 8)[1:]), bf16(x[jnp.array([0, 2])]), bf16(x)[0])  # noqa: E731
    assert read_dtypes(layout, X) == [BF16]
    # through a nested jit, a custom_vjp function and remat, and out of the jit again
    custom = jax.custom_vjp(bf16)
    custom.defvjp(lambda x: (bf16(x), None), lambda _, g: (g.astype(jnp.float32),))
    nested = lambda x: (custom(x), jax.checkpoint(bf16)(x), bf16(jax.jit(lambda y: y.T)(x)))  # noqa: E731
    assert read_dtypes(nested, X) == [BF16]


def test_an_input_read_as_it_is_anywhere_is_not():
    assert read_dtypes(lambda x, y: (bf16(x) * 2, x.sum()), X, Y) == [None, None]  # arithmetic; y unused
    assert read_dtypes(lambda x: (bf16(x), x.astype(jnp.float16)), X) == [None]  # two dtypes
    assert read_dtypes(lambda x: (bf16(x), x.T), X) == [None]  # returned
    assert read_dtypes(lambda x: bf16(jax.jit(lambda y: y)(x) + 1), X) == [None]  # used after a jit returns it
    assert read_dtypes(lambda x, y: bf16(x) @ bf16(y), X, Y) == [BF16, BF16]


def test_a_scan_reads_its_constants_and_scanned_inputs_in_its_body_but_not_its_carry():
    def scanned(stacked, const, init):
        def body(carry, w):
            return carry + bf16(w).sum() + bf16(const).sum(), bf16(w)

        return jax.lax.scan(body, init.astype(jnp.bfloat16).sum(), stacked)

    stacked = jax.ShapeDtypeStruct((3, 6), jnp.float32)
    assert read_dtypes(scanned, stacked, Y, Y) == [BF16, BF16, BF16]

    def carried(init):
        return jax.lax.scan(lambda c, _: (bf16(c).astype(jnp.float32), None), init, None, length=2)

    assert read_dtypes(carried, Y) == [None]


def test_each_branch_of_a_cond_counts():
    both = lambda p, x: jax.lax.cond(p, lambda y: bf16(y), lambda y: bf16(y) + 1, x)  # noqa: E731
    one = lambda p, x: jax.lax.cond(p, lambda y: bf16(y), lambda y: bf16(y * 2), x)  # noqa: E731
    predicate = jax.ShapeDtypeStruct((), jnp.bool_)
    index = np.dtype(np.int32)  # the predicate is read as the branch index
    assert read_dtypes(both, predicate, Y) == [index, BF16]
    assert read_dtypes(one, predicate, Y) == [index, None]

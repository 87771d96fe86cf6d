"""``quantized_matmul`` against its reference ``x @ dequantize(W)`` for every format, odd
shapes, the Pallas kernel (interpreted) and the XLA path, values and gradients; the NF4 code
table against the QLoRA paper; nibble packing; errors that name the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.kernels_pallas.quantized_formats import (
    NF4_CODE,
    QuantizedMatrix,
    dequantize,
    int4_to_nibbles,
    nibbles_to_int4,
    pack_nibbles,
    unpack_nibbles,
)
from ember.kernels_pallas.quantized_matmul import (
    DECODE_ROWS,
    MIN_PROGRAMS,
    QuantizedMatmulBlockSizes,
    default_block_sizes,
    quantized_matmul,
    quantized_matmul_reference,
)
from tests.host_random import numpy_rng
from tests.tolerances import assert_allclose

# QLoRA (Dettmers et al., 2023), appendix E: the 16 NormalFloat4 values, as printed there.
QLORA_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]  # fmt: skip


def random_weight(rng, fmt, k, n, group):
    if fmt == "int8":
        values = rng.integers(-127, 128, (k, n)).astype(np.int8)
    else:
        values = rng.integers(0, 256, (k // 2, n)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.1, (k // group, n)).astype(np.float32)
    return QuantizedMatrix(jnp.asarray(values), jnp.asarray(scales), fmt)


def test_nf4_code_is_the_qlora_table():
    assert list(NF4_CODE) == QLORA_NF4
    assert np.all(np.diff(NF4_CODE) > 0) and NF4_CODE[7] == 0.0


def test_nibbles_round_trip():
    rng = np.random.default_rng(0)
    signed = jnp.asarray(rng.integers(-8, 8, (34, 5)))
    packed = pack_nibbles(int4_to_nibbles(signed))
    assert packed.dtype == jnp.uint8 and packed.shape == (17, 5)
    np.testing.assert_array_equal(nibbles_to_int4(unpack_nibbles(packed)), signed)
    # Byte i holds row 2i low and row 2i + 1 high.
    assert int(packed[0, 0]) == (int(signed[0, 0]) & 0xF) | ((int(signed[1, 0]) & 0xF) << 4)
    raw = jnp.asarray(rng.integers(0, 256, (9, 3)), jnp.uint8)
    np.testing.assert_array_equal(pack_nibbles(unpack_nibbles(raw)), raw)


def test_dequantize_by_hand():
    values = pack_nibbles(jnp.asarray([[0, 15], [7, 8]]))  # rows 0 and 1 of a [2, 2] NF4 matrix
    nf4 = dequantize(QuantizedMatrix(values, jnp.asarray([[2.0, 0.5]]), "nf4"))
    np.testing.assert_allclose(nf4, [[-2.0, 0.5], [0.0, 0.5 * NF4_CODE[8]]], rtol=1e-7)
    int4 = dequantize(QuantizedMatrix(pack_nibbles(int4_to_nibbles(jnp.asarray([[-8, 7], [1, -1]]))),
                                      jnp.asarray([[0.5, 2.0]]), "int4"))  # fmt: skip
    np.testing.assert_array_equal(int4, [[-4.0, 14.0], [0.5, -2.0]])


CASES = [  # format, m, k, n, group, k_splits (split-K: None fills MIN_PROGRAMS, here every k-tile)
    ("int8", 5, 200, 72, 200, 1),
    ("int8", 33, 64, 16, 64, None),
    ("int4", 3, 256, 40, 128, 3),  # more splits asked than k-tiles: 2
    ("int4", 17, 96, 130, 32, 2),  # 3 k-tiles in splits of 2 and 1
    ("nf4", 1, 128, 24, 64, None),
    ("nf4", 20, 192, 48, 64, 3),
]


# Batch-1 decode shapes for one_row="vector" (the row times the weight tile, summed over k).
ONE_ROW_CASES = [("int8", 1, 96, 40, 96, None), ("int4", 1, 128, 72, 32, 2), ("nf4", 1, 192, 24, 64, 1)]


@pytest.mark.parametrize(
    "impl,fmt,m,k,n,group,k_splits,one_row",
    [(impl, *case, "dot") for case in CASES for impl in ("interpret", "xla")]
    + [("interpret", *case, "vector") for case in ONE_ROW_CASES],  # the XLA path has one form
)
def test_equals_reference_values_and_gradients(impl, fmt, m, k, n, group, k_splits, one_row, rng):
    rng = numpy_rng(rng)  # seeded by the test's id: hash() of a str changes with each process's PYTHONHASHSEED
    weight = random_weight(rng, fmt, k, n, group)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    d_out = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
    blocks = QuantizedMatmulBlockSizes(block_m=16, block_n=32, block_k=32, k_splits=k_splits, one_row=one_row)

    # Each side in one program: op by op, the reference, the gradients and the casts compiled ~30 per case.
    @jax.jit
    def reference(x, weight, d_out):
        return quantized_matmul_reference(x, weight), d_out @ dequantize(weight).T

    @jax.jit
    def kernel(x, weight, d_out):
        def product(x):
            return quantized_matmul(x, weight, impl=impl, block_sizes=blocks)

        return product(x), jax.grad(lambda x: jnp.sum(product(x) * d_out))(x), product(x.astype(jnp.bfloat16))

    expected, expected_grad = reference(x, weight, d_out)
    got, grad, bf16 = kernel(x, weight, d_out)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    scale = float(np.max(np.abs(expected)))
    assert_allclose(np.asarray(got) / scale, np.asarray(expected) / scale)
    assert_allclose(grad, expected_grad, scale=10)
    assert bf16.dtype == jnp.bfloat16
    assert_allclose(np.asarray(bf16, np.float32) / scale, np.asarray(expected) / scale, dtype=jnp.bfloat16)


@pytest.mark.parametrize("fmt, group", [("int8", 96), ("nf4", 32)])
def test_default_tiles_follow_the_rows(fmt, group):
    """Prefill- and training-shaped products get 64-row tiles (each weight tile dequantised
    once for all of them), decode steps 16-row ones; both equal the reference."""
    assert default_block_sizes(1) == default_block_sizes(DECODE_ROWS) == QuantizedMatmulBlockSizes()
    assert (default_block_sizes(DECODE_ROWS + 1).block_m, default_block_sizes(4096).num_warps) == (64, 8)
    rng = np.random.default_rng(5)
    weight = random_weight(rng, fmt, 96, 40, group)
    x = jnp.asarray(rng.normal(size=(70, 96)), jnp.float32)  # two 64-row tiles, the second partial
    expected = quantized_matmul_reference(x, weight)
    scale = float(jnp.max(jnp.abs(expected)))
    assert_allclose(quantized_matmul(x, weight, impl="interpret") / scale, expected / scale)


@pytest.mark.parametrize(
    "k_splits, output_tiles, k_tiles, expected",
    [
        (None, 32, 32, (MIN_PROGRAMS // 32, 32 * 32 // MIN_PROGRAMS)),  # a decode at n = 4096: 32 tiles
        (None, 300, 32, (1, 32)),  # enough output tiles: no split
        (None, 2, 3, (3, 1)),  # at most one split per k-tile
        (5, 1, 7, (4, 2)),  # 5 asked: splits of 2 k-tiles, so 4 (none empty)
        (1, 1, 7, (1, 7)),
    ],
)
def test_split_k_fills_the_grid_without_empty_splits(k_splits, output_tiles, k_tiles, expected):
    assert QuantizedMatmulBlockSizes(k_splits=k_splits).splits(output_tiles, k_tiles) == expected


@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_gradient_has_the_dtype_of_x(impl):
    """A bf16 ``x`` with a float32 ``preferred_element_type`` gets a bf16 gradient, as
    autodiff of ``jnp.dot`` gives; the backward cast it to the output's dtype (float32)."""
    weight = random_weight(np.random.default_rng(3), "int4", 32, 16, 16)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 32)), jnp.bfloat16)
    grad = jax.grad(lambda x: jnp.sum(quantized_matmul(x, weight, impl=impl, preferred_element_type=jnp.float32)))(x)
    assert grad.dtype == jnp.bfloat16
    expected = jnp.ones((2, 16), jnp.float32) @ dequantize(weight).T
    assert_allclose(grad, expected, dtype=jnp.bfloat16)


@pytest.mark.parametrize("impl", ["interpret", "xla"])
@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_no_rows_give_an_empty_product(fmt, impl):
    """x with no rows: the kernel path used to die computing its split-K grid ('integer
    division or modulo by zero'); now both paths return [0, n] like the reference."""
    weight = random_weight(np.random.default_rng(6), fmt, 32, 8, 32 if fmt == "int8" else 16)
    x = jnp.ones((0, 32))
    out = quantized_matmul(x, weight, impl=impl)
    assert out.shape == quantized_matmul_reference(x, weight).shape == (0, 8)
    assert jax.grad(lambda x: jnp.sum(quantized_matmul(x, weight, impl=impl)))(x).shape == (0, 32)


@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_no_columns_give_an_empty_product(impl):
    """A weight with no columns: the kernel path died like the no-rows case ('integer
    division or modulo by zero'); both paths return [m, 0] like the reference."""
    weight = QuantizedMatrix(jnp.zeros((32, 0), jnp.int8), jnp.ones((1, 0)), "int8")
    x = jnp.ones((2, 32))
    assert quantized_matmul(x, weight, impl=impl).shape == quantized_matmul_reference(x, weight).shape == (2, 0)


def test_int8_takes_one_scale_row():
    """int8 is per output channel: the kernel applies one scale row to the whole product, so
    group-wise int8 scales (which the reference and XLA path would honour) are refused
    rather than giving the kernel a different answer (16 groups at 16-row tiles scaled row i
    by group i) or a broadcasting error from inside the kernel."""
    rng = np.random.default_rng(2)
    weight = random_weight(rng, "int8", 64, 16, 4)  # 16 groups of 4 rows
    x = jnp.ones((3, 64))
    for op in (quantized_matmul, quantized_matmul_reference):
        with pytest.raises(ValueError, match=r"int8 scales are per output channel, \[1, n=16\], got 16 groups"):
            op(x, weight)
    with pytest.raises(ValueError, match="int8 scales are per output channel"):
        dequantize(weight)


def test_bad_arguments_name_themselves():
    rng = np.random.default_rng(1)
    weight = random_weight(rng, "int4", 64, 16, 32)
    x = jnp.ones((2, 64))
    with pytest.raises(ValueError, match="x has k=32"):
        quantized_matmul(jnp.ones((2, 32)), weight)
    with pytest.raises(ValueError, match="format must be one of"):
        quantized_matmul(x, QuantizedMatrix(weight.values, weight.scales, "int3"))
    with pytest.raises(ValueError, match="int4 values must be uint8"):
        quantized_matmul(x, QuantizedMatrix(weight.values.astype(jnp.int8), weight.scales, "int4"))
    with pytest.raises(ValueError, match="groups must divide"):
        quantized_matmul(x, QuantizedMatrix(weight.values, jnp.ones((3, 16)), "int4"))
    with pytest.raises(ValueError, match="group_size must be a power of two"):
        quantized_matmul(jnp.ones((2, 48)), QuantizedMatrix(jnp.zeros((24, 16), jnp.uint8), jnp.ones((2, 16)), "nf4"))
    for k_splits in (0, True):
        with pytest.raises(ValueError, match=rf"k_splits must be a positive int or None \(.*\), got {k_splits}"):
            QuantizedMatmulBlockSizes(k_splits=k_splits)
    with pytest.raises(ValueError, match="num_stages must be a positive int, got True"):
        QuantizedMatmulBlockSizes(num_stages=True)
    with pytest.raises(ValueError, match="num_warps must be one of 1, 2, 4, 8, 16, got True"):
        QuantizedMatmulBlockSizes(num_warps=True)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        QuantizedMatmulBlockSizes(block_n=48)
    with pytest.raises(ValueError, match="one_row must be one of dot, vector, got 'gemv'"):
        QuantizedMatmulBlockSizes(one_row="gemv")
    with pytest.raises(ValueError, match="impl='pallas' needs"):
        quantized_matmul(x, weight, impl="pallas")

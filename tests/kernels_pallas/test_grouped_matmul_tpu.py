"""ember.kernels_pallas.grouped_matmul_tpu: the Mosaic TPU kernels, run in TPU interpret mode
(``impl="interpret_tpu"``), against the reference, values and gradients, over the group
layouts of the GPU kernels' tests; the visit lists by hand; and the lowering for a TPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.kernels_pallas.grouped_matmul import GroupedMatmulBlockSizes, grouped_matmul
from ember.kernels_pallas.grouped_matmul_tpu import gmm_metadata, grouped_matmul_tpu, tgmm_metadata
from tests.host_random import numpy_rng
from tests.kernels_pallas.test_grouped_matmul import (
    GLOBAL_GROUPS,
    GROUPS,
    OFFSET,
    M,
    layouts,
    reference,
    value_and_grads,
)
from tests.tolerances import assert_allclose

# M = 37 rows are 5 row tiles of 8 in float32 (3 of 16 in bfloat16); k is 2 lane tiles of 128,
# and so is n in float32: every last tile is partial. In bfloat16 n is one tile of the whole
# 40 columns (half the grid steps of the interpreter, the slow part of these tests).
K, N = 150, {jnp.float32: 140, jnp.bfloat16: 40}
TILES = GroupedMatmulBlockSizes(block_m=8, block_k=128, block_n=128)
# One jitted function for every call, so each (dtype, offset or not) compiles once.
OURS = value_and_grads(
    lambda a, b, sizes, *offset: grouped_matmul(
        a, b, sizes, group_offset=offset[0] if offset else None, impl="interpret_tpu", block_sizes=TILES
    )
)


def draw(key, dtype):
    gen = numpy_rng(key)
    lhs = jnp.asarray(gen.standard_normal((M, K), np.float32), dtype)
    rhs = jnp.asarray(gen.standard_normal((GROUPS, K, N[dtype]), np.float32), dtype)
    cotangent = jnp.asarray(gen.standard_normal((M, N[dtype]), np.float32))
    return gen, lhs, rhs, cotangent


def with_rows(x, rows: np.ndarray, value):
    """``x`` with ``value`` in ``rows``, set on the host (eager scatters would compile per call)."""
    x = np.array(x)
    x[rows] = value
    return jnp.asarray(x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_match_reference(rng, dtype):
    """Empty groups, a group over several tiles, group boundaries inside tiles, rows past the
    groups (NaN in lhs, inf in the cotangent there, which must not reach any result)."""
    gen, lhs, rhs, cotangent = draw(rng, dtype)
    # A reduction over k (values, d_lhs: over n) or over a group's rows (d_rhs): in bf16 each
    # product is rounded once more than the f32 reference's.
    scale = 1.0 if dtype == jnp.float32 else 4.0
    for name, group_sizes in layouts(gen).items():
        sizes = jnp.asarray(group_sizes, jnp.int32)
        unowned = np.arange(int(group_sizes.sum()), M)
        got = OURS(with_rows(lhs, unowned, np.nan), rhs, with_rows(cotangent, unowned, np.inf), sizes)
        want = reference(with_rows(lhs, unowned, 0), rhs, with_rows(cotangent, unowned, 0), sizes)
        assert [g.dtype for g in got] == [dtype, dtype, dtype], name
        out, d_lhs, d_rhs = (np.asarray(g, np.float32) for g in got)
        for label, a, b in zip(("out", "d_lhs", "d_rhs"), (out, d_lhs, d_rhs), want):
            assert_allclose(a, b, dtype=dtype, scale=scale, err_msg=f"{name} {label}")
        # Exact zeros, not merely small: rows past the groups, and empty groups' d_rhs.
        assert not np.any(out[unowned]) and not np.any(d_lhs[unowned]), name
        assert not np.any(d_rhs[group_sizes == 0]), name


def test_group_offset_leaves_rows_before_and_after_the_local_groups_zero(rng):
    gen, lhs, rhs, cotangent = draw(rng, jnp.float32)
    group_sizes = gen.multinomial(M - 4, np.full(GLOBAL_GROUPS, 1.0 / GLOBAL_GROUPS))
    group_sizes[OFFSET + 1] = 0  # an empty local group
    sizes, offset = jnp.asarray(group_sizes, jnp.int32), jnp.int32(OFFSET)
    got = OURS(lhs, rhs, cotangent, sizes, offset)
    want = reference(lhs, rhs, cotangent, sizes, offset)
    for label, a, b in zip(("out", "d_lhs", "d_rhs"), got, want):
        assert_allclose(a, b, err_msg=label)
    start = int(group_sizes[:OFFSET].sum())
    stop = start + int(group_sizes[OFFSET : OFFSET + GROUPS].sum())
    for label, a in zip(("out", "d_lhs"), got[:2]):
        a = np.asarray(a)
        assert not np.any(a[:start]) and not np.any(a[stop:]), label


def test_visit_lists_by_hand():
    """Sizes [0, 3, 0, 0, 10, 0, 5] own rows [0,3) [3,13) [13,18) of 32, in tiles of 8; the
    lists have 4 tiles + 7 groups - 1 = 10 visits. Dead visits have no rows and keep the
    previous visit's group (``gmm``) or tile (``tgmm``); the tail repeats the last visit."""
    bounds = jnp.asarray([0, 0, 3, 3, 3, 13, 13, 18], jnp.int32)
    # gmm, tile by tile: tile 0 meets groups 1 and 4, tile 1 groups 4 and 6, tile 2 group 6,
    # tile 3 none (one dead visit); empty groups are never visited.
    gmm = jax.jit(gmm_metadata, static_argnums=(1, 2))(bounds, 4, 8)
    np.testing.assert_array_equal(gmm.m_tile_ids, [0, 0, 1, 1, 2, 3, 3, 3, 3, 3])
    np.testing.assert_array_equal(gmm.group_ids, [1, 4, 4, 6, 6, 6, 6, 6, 6, 6])
    np.testing.assert_array_equal(gmm.row_starts, [0, 3, 3, 13, 13, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(gmm.row_ends, [3, 13, 13, 18, 18, 0, 0, 0, 0, 0])
    # tgmm, group by group: each empty group once (a dead visit, writing its zeros).
    tgmm = jax.jit(tgmm_metadata, static_argnums=(1, 2))(bounds, 4, 8)
    np.testing.assert_array_equal(tgmm.group_ids, [0, 1, 2, 3, 4, 4, 5, 6, 6, 6])
    np.testing.assert_array_equal(tgmm.m_tile_ids, [0, 0, 0, 0, 0, 1, 1, 1, 2, 2])
    np.testing.assert_array_equal(tgmm.row_starts, [0, 0, 0, 0, 3, 3, 0, 13, 13, 0])
    np.testing.assert_array_equal(tgmm.row_ends, [0, 3, 0, 0, 13, 13, 0, 18, 18, 0])


@pytest.mark.parametrize(
    "dtype, out_dtype, tiles, shape",
    [
        (jnp.bfloat16, jnp.bfloat16, GroupedMatmulBlockSizes(), (300, 150, 300)),
        (jnp.float32, jnp.float32, TILES, (300, 150, 300)),
        (jnp.bfloat16, jnp.float32, TILES, (37, 20, 21)),  # k and n each one block of the whole dimension
    ],
)
def test_forward_and_backward_lower_for_mosaic_tpu(dtype, out_dtype, tiles, shape):
    """Compiled (not interpreted), the three kernels pass Pallas's Mosaic TPU lowering,
    which checks the block shapes against the (8, 128) tiling; unaligned dims included."""
    m, k, n = shape

    def loss(lhs, rhs, bounds):
        return grouped_matmul_tpu(lhs, rhs, bounds, block_sizes=tiles, out_dtype=out_dtype).astype(jnp.float32).sum()

    args = [jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((4, k, n), dtype)]
    traced = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*args, jax.ShapeDtypeStruct((5,), jnp.int32))
    assert traced.lower(lowering_platforms=("tpu",)).as_text().count("tpu_custom_call") == 3


def test_float16_operands_are_refused():
    lhs, rhs, sizes = jnp.ones((6, 4), jnp.float16), jnp.ones((2, 4, 3), jnp.float16), jnp.asarray([2, 3], jnp.int32)
    with pytest.raises(ValueError, match="the TPU kernel takes float32 or bfloat16 operands, got float16"):
        grouped_matmul(lhs, rhs, sizes, impl="interpret_tpu")

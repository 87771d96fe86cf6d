"""ember.kernels_pallas.grouped_matmul: the Pallas kernels (interpreted) and the XLA path
against the reference and against ``jax.lax.ragged_dot``, values and gradients, over group
layouts that stress the tiling: empty groups, groups smaller than a tile, one group with
most rows, rows past the groups, and expert-parallel shards (``group_offset``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.kernels_pallas.grouped_matmul import GroupedMatmulBlockSizes, grouped_matmul, grouped_matmul_reference
from ember.kernels_pallas.grouped_matmul_kernels import SWIZZLE_M_TILES, swizzled_tile, tile_group_table
from tests.host_random import numpy_rng
from tests.tolerances import assert_allclose

# Shared by every test, so each (impl, dtype, offset or not) compiles once: 37 rows are 5
# tiles of 8, k = 20 and n = 21 are 3 tiles each: every last tile is partial.
M, K, N, GROUPS = 37, 20, 21, 6
TILES = GroupedMatmulBlockSizes(block_m=8, block_k=8, block_n=8)
# The expert-parallel shard: GLOBAL_GROUPS groups in all, rhs holds GROUPS of them from global group OFFSET.
GLOBAL_GROUPS, OFFSET = 9, 2


def layouts(gen: np.random.Generator) -> dict[str, np.ndarray]:
    """Group sizes ``[GROUPS]`` per layout; ``_tail`` layouts leave rows past the groups."""
    random_with_empty = gen.multinomial(M, np.full(GROUPS, 1.0 / GROUPS))
    random_with_empty[gen.choice(GROUPS, 2, replace=False)] = 0
    random_with_empty[gen.integers(GROUPS)] += M - random_with_empty.sum()
    most = gen.integers(0, 3, GROUPS)
    most[gen.integers(GROUPS)] = 0
    most[gen.integers(GROUPS)] += M - most.sum()
    small_tail = gen.integers(0, 4, GROUPS)  # every group inside one 8-row tile or two
    random_tail = gen.multinomial(M - 9, np.full(GROUPS, 1.0 / GROUPS))
    return {
        "random_with_empty": random_with_empty,
        "one_group_holds_most_rows": most,
        "smaller_than_a_tile_tail": small_tail,
        "random_tail": random_tail,
    }


def draw(key, dtype, num_groups=GROUPS):
    gen = numpy_rng(key)
    lhs = jnp.asarray(gen.standard_normal((M, K), np.float32), dtype)
    rhs = jnp.asarray(gen.standard_normal((num_groups, K, N), np.float32), dtype)
    cotangent = jnp.asarray(gen.standard_normal((M, N), np.float32))
    return gen, lhs, rhs, cotangent


def value_and_grads(fn):
    """``run(lhs, rhs, cotangent, *groups) -> (out, d_lhs, d_rhs)`` of ``fn(lhs, rhs, *groups)``,
    jitted without XLA's backend optimizations (interpreted kernels are large while-loop
    programs that they take seconds to compile, for nothing at these sizes)."""

    def run(lhs, rhs, cotangent, *groups):
        out, vjp = jax.vjp(lambda a, b: fn(a, b, *groups), lhs, rhs)
        return (out, *vjp(cotangent.astype(out.dtype)))

    return jax.jit(run, compiler_options={"xla_backend_optimization_level": 0})


def _offset(groups):
    return groups[1] if len(groups) > 1 else None


# Built once per module, so every test calling one shares its compilations.
OURS = {
    impl: value_and_grads(
        lambda a, b, *g, impl=impl: grouped_matmul(a, b, g[0], group_offset=_offset(g), impl=impl, block_sizes=TILES)
    )
    for impl in ("interpret", "xla")
}
_REFERENCE = value_and_grads(lambda a, b, *g: grouped_matmul_reference(a, b, g[0], group_offset=_offset(g)))
_RAGGED_DOT = value_and_grads(lambda a, b, g: jax.lax.ragged_dot(a, b, g, preferred_element_type=jnp.float32))


def upcast(*arrays):
    return [a.astype(jnp.float32) for a in arrays]


def reference(lhs, rhs, cotangent, *groups):
    """The reference's values and gradients on float32 inputs at full matmul precision."""
    with jax.default_matmul_precision("highest"):
        return _REFERENCE(*upcast(lhs, rhs), cotangent, *groups)


def ragged_dot_peer(lhs, rhs, cotangent, sizes):
    with jax.default_matmul_precision("highest"):
        return _RAGGED_DOT(*upcast(lhs, rhs), cotangent, sizes)


@pytest.mark.parametrize("impl", ["interpret", "xla"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_match_reference_and_ragged_dot(rng, impl, dtype):
    gen, lhs, rhs, cotangent = draw(rng, dtype)
    # A reduction over k (values, d_lhs: over n) or over a group's rows (d_rhs): in bf16 each
    # product is rounded once more than the f32 reference's.
    scale = 1.0 if dtype == jnp.float32 else 4.0
    for name, group_sizes in layouts(gen).items():
        sizes = jnp.asarray(group_sizes, jnp.int32)
        covered = int(group_sizes.sum())
        got = OURS[impl](lhs, rhs, cotangent, sizes)
        want = reference(lhs, rhs, cotangent, sizes)
        peer = ragged_dot_peer(lhs, rhs, cotangent, sizes)
        assert [g.dtype for g in got] == [dtype, dtype, dtype]
        for label, a, b, c in zip(("out", "d_lhs", "d_rhs"), got, want, peer):
            assert_allclose(a, b, dtype=dtype, scale=scale, err_msg=f"{name} {label} vs reference")
            rows = slice(None) if label == "d_rhs" else slice(0, covered)  # ragged_dot leaves the rest unspecified
            assert_allclose(a[rows], c[rows], dtype=dtype, scale=scale, err_msg=f"{name} {label} vs ragged_dot")
        # The promise of the docstring: rows past the groups are zero, and get zero gradient.
        assert not np.any(np.asarray(got[0][covered:], np.float32)), name
        assert not np.any(np.asarray(got[1][covered:], np.float32)), name
        empty = np.flatnonzero(group_sizes == 0)
        assert not np.any(np.asarray(got[2][empty], np.float32)), name


@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_group_offset_selects_the_local_groups(rng, impl):
    gen, lhs, rhs, cotangent = draw(rng, jnp.float32)
    local = rhs.shape[0]
    group_sizes = gen.multinomial(M - 4, np.full(GLOBAL_GROUPS, 1.0 / GLOBAL_GROUPS))
    group_sizes[OFFSET + 1] = 0  # an empty local group
    sizes, offset = jnp.asarray(group_sizes, jnp.int32), jnp.int32(OFFSET)
    got = OURS[impl](lhs, rhs, cotangent, sizes, offset)
    want = reference(lhs, rhs, cotangent, sizes, offset)
    for label, a, b in zip(("out", "d_lhs", "d_rhs"), got, want):
        assert_allclose(a, b, err_msg=label)
    # Hand-computed: the local groups' rows are ragged_dot's over the local sizes; the rest is 0.
    start = int(group_sizes[:OFFSET].sum())
    stop = start + int(group_sizes[OFFSET : OFFSET + local].sum())
    local_out = jax.lax.ragged_dot(lhs[start:stop], rhs, sizes[OFFSET : OFFSET + local], precision="highest")
    assert_allclose(got[0][start:stop], local_out)
    assert not np.any(np.asarray(got[0][:start])) and not np.any(np.asarray(got[0][stop:]))
    assert not np.any(np.asarray(got[1][:start])) and not np.any(np.asarray(got[1][stop:]))


def test_non_finite_rows_past_the_groups_never_reach_the_results(rng):
    _, lhs, rhs, cotangent = draw(rng, jnp.float32)
    group_sizes = jnp.asarray([5, 0, 9, 3, 8, 2], jnp.int32)  # 27 of 37 rows
    lhs = lhs.at[27:].set(jnp.nan).at[30].set(jnp.inf)
    out, d_lhs, d_rhs = OURS["interpret"](lhs, rhs, cotangent, group_sizes)
    want = reference(lhs.at[27:].set(0.0), rhs, cotangent, group_sizes)
    for label, a, b in zip(("out", "d_lhs", "d_rhs"), (out, d_lhs, d_rhs), want):
        assert_allclose(a, b, err_msg=label)


def test_default_tiles_and_preferred_element_type(rng):
    """bf16 inputs with a float32 result: the default (fitted) tiles, the kernel's output
    keeps the f32 accumulation, and the gradients come back in the inputs' dtype."""
    gen, lhs, rhs, cotangent = draw(rng, jnp.bfloat16)
    sizes = jnp.asarray(layouts(gen)["random_tail"], jnp.int32)
    fn = value_and_grads(lambda a, b, s: grouped_matmul(a, b, s, preferred_element_type=jnp.float32, impl="interpret"))
    out, d_lhs, d_rhs = fn(lhs, rhs, cotangent, sizes)
    want = reference(lhs, rhs, cotangent, sizes)
    assert (out.dtype, d_lhs.dtype, d_rhs.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
    assert_allclose(out, want[0])  # exact products of bf16 values, summed in f32
    assert_allclose(d_lhs, want[1], dtype=jnp.bfloat16, scale=4.0)  # the cotangent is rounded to bf16
    assert_allclose(d_rhs, want[2], dtype=jnp.bfloat16, scale=4.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_m=12), "block_m must be a power of two >= 8, got 12"),
        (dict(block_k=4), "block_k must be a power of two >= 8, got 4"),
        (dict(block_n=True), "block_n must be a power of two >= 8, got True"),
        (dict(num_warps=3), "num_warps must be one of 1, 2, 4, 8, 16, got 3"),
        (dict(num_warps=True), "num_warps must be one of 1, 2, 4, 8, 16, got True"),
        (dict(num_stages=0), "num_stages must be a positive int, got 0"),
    ],
)
def test_block_sizes_validate_themselves(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GroupedMatmulBlockSizes(**kwargs)


def test_bad_arguments_are_named():
    lhs, rhs, sizes = jnp.ones((6, 4)), jnp.ones((2, 4, 3)), jnp.asarray([2, 3], jnp.int32)
    cases = [
        (dict(lhs=jnp.ones((6,))), "lhs must be a float array"),
        (dict(rhs=jnp.ones((2, 5, 3))), r"rhs must be \[groups, k=4, n\]"),
        (dict(rhs=jnp.ones((2, 4, 3), jnp.bfloat16)), "rhs must have lhs's dtype"),
        (dict(group_sizes=jnp.asarray([2.0, 3.0])), "group_sizes must be an integer array"),
        (dict(group_sizes=jnp.asarray([2, 3, 1], jnp.int32)), "one entry per rhs group"),
        # A 2-D int32 group_sizes (or group_offset) was refused as "..., got int32", an integer.
        (dict(group_sizes=jnp.asarray([[2, 3]], jnp.int32)), r"integer array \[groups\], got int32\[1, 2\]"),
        (dict(group_offset=jnp.zeros((1, 1), jnp.int32)), r"group_offset must be an integer scalar, got int32\[1, 1\]"),
        (dict(group_sizes=jnp.asarray([2], jnp.int32), group_offset=jnp.int32(0)), "at least rhs's 2 local"),
        (dict(block_sizes=(8, 8, 8)), "block_sizes must be a GroupedMatmulBlockSizes, got tuple"),
        (dict(impl="triton"), "impl must be one of"),
        # A misspelt gpu_kernel on the XLA path was said to need the GPU kernels.
        (dict(gpu_kernel="trition", impl="xla"), "gpu_kernel must be one of"),
        (dict(impl="pallas"), "impl='pallas' needs a backend with a compiled kernel"),
    ]
    for overrides, message in cases:
        args = dict(lhs=lhs, rhs=rhs, group_sizes=sizes, impl="interpret") | overrides
        with pytest.raises(ValueError, match=message):
            grouped_matmul(args.pop("lhs"), args.pop("rhs"), args.pop("group_sizes"), **args)


def test_tile_table_visits_each_tile_once_per_group_meeting_it():
    """Hand-computed: sizes [0, 3, 0, 0, 10, 0, 5] own rows [0,3) [3,13) [13,18) of 24, in
    tiles of 8. Tile 0 meets groups 1..4 (2 and 3 are empty, at row 3: the kernel skips
    their k-loop), tile 1 groups 4..6 (5 empty), tile 2 group 6 only (rows 18..23 are
    nobody's); the leading empty group 0 is never visited."""
    bounds = jnp.asarray([0, 0, 3, 3, 3, 13, 13, 18], jnp.int32)
    table = tile_group_table(bounds, num_tiles=3, block_m=8)
    np.testing.assert_array_equal(np.asarray(table), [[1, 4], [4, 3], [6, 1]])
    # A tile past every group visits none: its rows come out zero without a matmul.
    np.testing.assert_array_equal(np.asarray(tile_group_table(bounds, num_tiles=4, block_m=8))[3], [7, 0])
    # One fused comparison per column: no loop of small kernels, which a GPU runs one at a time.
    jaxpr = str(jax.make_jaxpr(tile_group_table, static_argnums=(1, 2))(bounds, 3, 8))
    assert "scan[" not in jaxpr and "while[" not in jaxpr


@pytest.mark.parametrize("m, k", [(0, 5), (4, 0)])
def test_no_rows_or_no_contraction_give_zeros_like_the_reference(rng, m, k):
    gen = numpy_rng(rng)
    lhs = jnp.asarray(gen.standard_normal((m, k)), jnp.float32)
    rhs = jnp.asarray(gen.standard_normal((2, k, 3)), jnp.float32)
    sizes = jnp.asarray([m // 2, m - m // 2], jnp.int32)
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, impl="interpret"), lhs, rhs)
    d_lhs, d_rhs = vjp(jnp.ones_like(out))
    assert out.shape == (m, 3) and d_lhs.shape == (m, k) and d_rhs.shape == (2, k, 3)
    assert_allclose(out, grouped_matmul_reference(lhs, rhs, sizes))
    assert not np.any(np.asarray(out)) and not np.any(np.asarray(d_rhs))


@pytest.mark.parametrize("m_tiles, n_tiles", [(1, 1), (5, 3), (8, 2), (19, 4)])
def test_swizzled_grid_visits_every_output_tile_once(m_tiles, n_tiles):
    pids = jnp.arange(m_tiles * n_tiles)
    m_tile, n_tile = swizzled_tile(pids, m_tiles, n_tiles)
    visited = sorted(zip(np.asarray(m_tile).tolist(), np.asarray(n_tile).tolist()))
    assert visited == [(i, j) for i in range(m_tiles) for j in range(n_tiles)]
    # Consecutive programs stay within a band of SWIZZLE_M_TILES rows of tiles.
    assert np.all(np.asarray(m_tile)[: SWIZZLE_M_TILES * n_tiles] < SWIZZLE_M_TILES)

"""Block-mask descriptions: token masks against hand-written loops, the live-block grid
against a brute-force reduction, the kernels' index tables, and argument checking."""

import jax.numpy as jnp
import numpy as np
import pytest

from ember.kernels_pallas.block_mask import (
    CausalMask,
    ChunkedCausalMask,
    ExplicitBlockMask,
    LiveBlocks,
    LocalGlobalMask,
    LocalMask,
    MaskIntersection,
    combine_masks,
    live_block_grid,
)
from ember.kernels_pallas.flash_attention import flash_attention


def _loop_mask(rule, q_len, kv_len):
    return np.array([[rule(i, j) for j in range(kv_len)] for i in range(q_len)], dtype=bool)


HAND_RULES = [
    (CausalMask(), lambda i, j: j <= i),
    (LocalMask(3, 1), lambda i, j: i - 3 <= j <= i + 1),
    (LocalGlobalMask(2, 2, 3), lambda i, j: abs(i - j) <= 2 or i < 3 or j < 3),
    (ChunkedCausalMask(4), lambda i, j: j <= i and i // 4 == j // 4),
    (
        ExplicitBlockMask.from_array([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]], 5, 8),
        lambda i, j: [[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]][i // 5][j // 8] == 1,
    ),
    (
        MaskIntersection((CausalMask(), LocalMask(2, 0))),
        lambda i, j: i - 2 <= j <= i,
    ),
]


@pytest.mark.parametrize("mask, rule", HAND_RULES, ids=lambda x: type(x).__name__)
def test_dense_mask_matches_hand_rule(mask, rule):
    np.testing.assert_array_equal(mask.dense(17, 23), _loop_mask(rule, 17, 23))


def _brute_force_live(mask, q_len, kv_len, block_q, block_kv):
    nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
    padded = np.zeros((nq * block_q, nk * block_kv), dtype=bool)
    padded[:q_len, :kv_len] = mask.dense(q_len, kv_len)
    return padded.reshape(nq, block_q, nk, block_kv).any(axis=(1, 3))


@pytest.mark.parametrize("mask, _", HAND_RULES, ids=lambda x: type(x).__name__)
@pytest.mark.parametrize("lengths, blocks", [((17, 23), (4, 8)), ((1100, 40), (64, 16))])
def test_live_block_grid_is_any_visible_pair_per_block(mask, _, lengths, blocks):
    if isinstance(mask, ExplicitBlockMask) and lengths[0] > 20:
        mask = ExplicitBlockMask.from_array(np.random.default_rng(0).random((18, 3)) < 0.5, 64, 16)
    np.testing.assert_array_equal(live_block_grid(mask, *lengths, *blocks), _brute_force_live(mask, *lengths, *blocks))


def test_live_block_grid_without_mask_is_all_live():
    assert live_block_grid(None, 10, 33, 8, 16).shape == (2, 3)
    assert live_block_grid(None, 10, 33, 8, 16).all()


def test_live_blocks_tables_list_live_indices_in_order():
    live = np.array([[1, 0, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]], dtype=bool)
    tables = LiveBlocks.from_grid(live)
    np.testing.assert_array_equal(tables.kv_counts, [3, 0, 1])
    np.testing.assert_array_equal(tables.kv_indices, [[0, 2, 3], [0, 0, 0], [1, 1, 1]])
    np.testing.assert_array_equal(tables.q_counts, [1, 1, 1, 1])
    np.testing.assert_array_equal(tables.q_indices[:, 0], [0, 2, 0, 0])
    assert tables.num_live == 4


def test_combine_masks_flattens_and_ignores_none():
    assert combine_masks(None, None) is None
    assert combine_masks(None, CausalMask()) == CausalMask()
    combined = combine_masks(CausalMask(), combine_masks(LocalMask(1, 1), ChunkedCausalMask(2)))
    assert combined == MaskIntersection((CausalMask(), LocalMask(1, 1), ChunkedCausalMask(2)))


@pytest.mark.parametrize(
    "build, argument",
    [
        (lambda: LocalMask(-1, 0), "left"),
        (lambda: LocalGlobalMask(1, 1, -2), "num_global_tokens"),
        (lambda: ChunkedCausalMask(0), "chunk_size"),
        (lambda: ExplicitBlockMask(((True,), (True, False)), 8, 8), "blocks"),
        (lambda: ExplicitBlockMask.from_array(np.ones(3), 8, 8), "blocks"),
        (lambda: ExplicitBlockMask(((True,),), 0, 8), "block_q"),
        (lambda: combine_masks("causal"), "block_mask"),
    ],
)
def test_bad_descriptions_raise_value_error_naming_the_argument(build, argument):
    with pytest.raises(ValueError, match=argument):
        build()


def test_explicit_mask_takes_lists_and_arrays_as_a_hashable_grid():
    """ExplicitBlockMask(np.array(...)) died with 'The truth value of an array ... is
    ambiguous', and nested lists were kept, so flash_attention refused the mask as a
    non-hashable static argument; both now become the tuple grid."""
    grid = ((True, False), (True, True))
    for blocks in (np.array(grid), [list(row) for row in grid], ((1, 0), (1, 1))):
        mask = ExplicitBlockMask(blocks, 8, 8)
        assert mask.blocks == grid and hash(mask) == hash(ExplicitBlockMask(grid, 8, 8))
    q = jnp.ones((1, 16, 1, 8))
    out = flash_attention(q, q, q, block_mask=ExplicitBlockMask([[True, False], [True, True]], 8, 8), impl="xla")
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="blocks must be a non-empty rectangular tuple of tuples of bools, got int"):
        ExplicitBlockMask(3, 8, 8)


def test_masks_are_hashable_static_arguments():
    assert hash(LocalGlobalMask(4, 4, 2)) == hash(LocalGlobalMask(4, 4, 2))
    assert hash(ExplicitBlockMask.from_array(np.eye(2), 8, 8)) == hash(
        ExplicitBlockMask(((True, False), (False, True)), 8, 8)
    )

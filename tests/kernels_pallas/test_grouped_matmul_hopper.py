"""The Hopper (Mosaic GPU) grouped matmul without a GPU: its visit table, what it refuses
(with the reason), and which kernels a call routes to. Its values are checked on an
H100/H200 by ``python -m benchmarks.gpu`` (HOPPER_CHECKS) and, before that, in jax 0.11's
Mosaic GPU interpreter (``python -m benchmarks.mosaic_gpu_precheck``); jax 0.10 has no
interpreter for it, so here the kernel is only traced, never run."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.kernels_pallas import grouped_matmul_kernels
from ember.kernels_pallas.grouped_matmul import grouped_matmul
from ember.kernels_pallas.grouped_matmul_mgpu import HopperGmmBlockSizes, hopper_gmm_reason, visit_table
from ember.kernels_pallas.hopper import GpuInfo
from tests.kernels_pallas.traced_kernels import kernels_in_gradient

H100 = GpuInfo((9, 0), cuda_runtime=12091)


@pytest.mark.parametrize(
    "sizes, offset",
    [((70, 0, 90, 30), 5), ((64, 64, 0, 64), 0), ((1, 140), 0), ((0, 0, 0), 0), ((300,), 20)],
)
def test_the_visit_table_lists_every_group_and_tile_whose_rows_meet(sizes, offset):
    block_m = 64
    bounds = np.concatenate([[0], np.cumsum(sizes)]) + offset
    m_tiles = -(-max(int(bounds[-1]), 1) // block_m) + 1
    table = np.asarray(visit_table(jnp.asarray(bounds, jnp.int32), m_tiles, block_m))
    want = []
    for group, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        for tile in range(m_tiles):
            start = tile * block_m
            first, end = max(lo, start), min(hi, start + block_m)
            if first < end:
                want.append([group, tile, first - start, end - start])
    assert table.shape == (m_tiles + len(sizes) - 1, 4)
    valid = table[:, 0] >= 0
    assert table[valid].tolist() == want
    assert not valid[len(want) :].any() and valid[: len(want)].all()


@pytest.mark.parametrize(
    "dtypes, gpu, interpret, reason",
    [
        ((jnp.bfloat16, jnp.bfloat16), H100, False, None),
        ((jnp.float16, jnp.float16), H100, False, None),
        ((jnp.float32, jnp.float32), H100, False, "operand dtypes float32, float32"),
        ((jnp.bfloat16, jnp.float16), H100, False, "operand dtypes bfloat16, float16"),
        ((jnp.bfloat16, jnp.bfloat16), GpuInfo((8, 0)), False, "compute capability 8.0"),
        ((jnp.bfloat16, jnp.bfloat16), None, False, "not an NVIDIA GPU"),
        ((jnp.bfloat16, jnp.bfloat16), H100, True, "interpret mode"),
    ],
)
def test_hopper_gmm_reasons(dtypes, gpu, interpret, reason):
    got = hopper_gmm_reason(dtypes, gpu, interpret=interpret)
    assert got is None if reason is None else reason in got


def test_tiles_validate_and_fit_shared_memory():
    with pytest.raises(ValueError, match="block_m"):
        HopperGmmBlockSizes(block_m=96)
    with pytest.raises(ValueError, match="stages"):
        HopperGmmBlockSizes(stages=1)
    # 8 slots of 256-row lhs and 256-column rhs k-tiles: 512 KiB, beyond an SM's 227.
    too_big = hopper_gmm_reason((jnp.bfloat16,) * 2, H100, interpret=False, blocks=HopperGmmBlockSizes(256, 256, 8))
    assert "KiB of shared memory" in too_big


@pytest.mark.parametrize(
    "gpu_kernel, by_default, expected",
    [
        ("hopper", False, {"grouped_matmul_hopper", "grouped_matmul_transposed_rhs_hopper", "grouped_matmul_tgmm"}),
        ("auto", False, {"grouped_matmul", "grouped_matmul_transposed_rhs", "grouped_matmul_tgmm"}),
        ("auto", True, {"grouped_matmul_hopper", "grouped_matmul_transposed_rhs_hopper", "grouped_matmul_tgmm"}),
        ("triton", True, {"grouped_matmul", "grouped_matmul_transposed_rhs", "grouped_matmul_tgmm"}),
    ],
)
def test_the_op_on_hopper_runs_the_kernels_asked_for(monkeypatch, gpu_kernel, by_default, expected):
    """The forward and ``d_lhs`` run the Hopper gmm where chosen; ``d_rhs`` is Triton's tgmm."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(GpuInfo, "here", classmethod(lambda cls: H100))
    monkeypatch.setattr(grouped_matmul_kernels, "HOPPER_GMM_BY_DEFAULT", by_default)
    lhs = jnp.zeros((100 + by_default, 64), jnp.bfloat16)  # the jitted ops cache traces by shape
    rhs = jnp.zeros((3, 64, 128), jnp.bfloat16)
    sizes = jnp.asarray([40, 0, 50], jnp.int32)
    multiply = lambda a, b: grouped_matmul(a, b, sizes, impl="pallas", gpu_kernel=gpu_kernel)  # noqa: E731
    kernels = kernels_in_gradient(multiply, lhs, rhs)
    assert kernels == expected


def test_asking_for_the_hopper_gmm_where_it_cannot_run_names_the_reason(monkeypatch):
    lhs, rhs, sizes = jnp.zeros((32, 64), jnp.float32), jnp.zeros((2, 64, 64), jnp.float32), jnp.asarray([16, 16])
    with pytest.raises(ValueError, match="gpu_kernel='hopper' chooses among the GPU kernels"):
        grouped_matmul(lhs, rhs, sizes, impl="xla", gpu_kernel="hopper")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(GpuInfo, "here", classmethod(lambda cls: H100))
    reason = "the hopper grouped matmul kernel cannot run this call: operand dtypes float32"
    with pytest.raises(ValueError, match=reason):
        grouped_matmul(lhs, rhs, sizes, impl="pallas", gpu_kernel="hopper")
    with pytest.raises(ValueError, match="the grouped matmul kernel must be one of"):
        grouped_matmul(lhs, rhs, sizes, impl="pallas", gpu_kernel="cutlass")

"""The Hopper (Mosaic GPU) forward and backward of flash attention without a GPU: what they
support (and the reasons they give otherwise), and which kernels a call routes to for a
given device. Their values are checked on an H100/H200 by ``python -m benchmarks.gpu``
(HOPPER_CHECKS); here kernels are only traced, never run (jax 0.10 has no Mosaic GPU
interpreter; benchmarks/README.md says how they were checked before a device)."""

import re

import jax
import jax.numpy as jnp
import pytest

from ember.kernels_pallas import flash_attention_routing
from ember.kernels_pallas.block_mask import CausalMask
from ember.kernels_pallas.flash_attention import FlashBlockSizes, attention_problem, flash_attention
from ember.kernels_pallas.flash_attention_kernels import flash_attention_kernel
from ember.kernels_pallas.flash_attention_mgpu import HopperBlockSizes, hopper_supports
from ember.kernels_pallas.flash_attention_mgpu_backward import hopper_backward_supports
from ember.kernels_pallas.flash_attention_routing import backward_kernel, forward_kernel
from ember.kernels_pallas.hopper import GpuInfo, hopper_device_reason
from tests.kernels_pallas.traced_kernels import kernels_in_gradient

H100 = GpuInfo((9, 0), cuda_runtime=12091)
BF16 = (jnp.bfloat16,) * 3


def problem(head_dim=128, heads=4, kv_heads=2, q_len=300, kv_len=300, dtype=jnp.bfloat16, **options):
    q = jax.ShapeDtypeStruct((2, q_len, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, kv_len, kv_heads, head_dim), dtype)
    return attention_problem(q, kv, kv, **options)


@pytest.mark.parametrize(
    "call",
    [
        problem(),
        problem(causal=True, kv_heads=1),  # MQA
        problem(head_dim=64, q_len=77, kv_len=1000),  # lengths off the blocks: padded and masked
        problem(block_mask=CausalMask(), heads=8, kv_heads=2),
    ],
)
def test_supported_problems(call):
    assert hopper_supports(call, jnp.bfloat16) is None
    assert hopper_supports(call, jnp.float16) is None


@pytest.mark.parametrize(
    "call, dtype, blocks, reason",
    [
        (problem(score="sigmoid"), jnp.bfloat16, HopperBlockSizes(), "sigmoid scores"),
        (problem(logits_soft_cap=30.0), jnp.bfloat16, HopperBlockSizes(), "soft cap"),
        (problem(window=(64, 0)), jnp.bfloat16, HopperBlockSizes(), "LocalMask"),
        (problem(causal=True, window=(64, 0)), jnp.bfloat16, HopperBlockSizes(), "only none or causal"),
        (problem(segment_ids=jnp.zeros((2, 300), jnp.int32)), jnp.bfloat16, HopperBlockSizes(), "segment ids"),
        (problem(sm_scale=-1.0), jnp.bfloat16, HopperBlockSizes(), "sm_scale -1.0"),
        (problem(), jnp.float32, HopperBlockSizes(), "dtype float32"),
        (problem(head_dim=256), jnp.bfloat16, HopperBlockSizes(), "head_dim 256"),
        (problem(head_dim=32), jnp.bfloat16, HopperBlockSizes(), "head_dim 32"),
        (problem(), jnp.bfloat16, HopperBlockSizes(64, 256, 2), "KiB of shared memory"),
    ],
)
def test_unsupported_problems_name_the_reason(call, dtype, blocks, reason):
    assert reason in hopper_supports(call, dtype, blocks)


@pytest.mark.parametrize(
    "blocks, message",
    [(dict(block_q=32), "block_q"), (dict(block_kv=96), "block_kv"), (dict(stages=1), "stages")],
)
def test_block_sizes_validate(blocks, message):
    with pytest.raises(ValueError, match=message):
        HopperBlockSizes(**blocks)


@pytest.mark.parametrize(
    "gpu, causal, reason",
    [
        (H100, True, None),
        (GpuInfo((9, 0)), True, None),  # runtime unknown
        (None, False, "not an NVIDIA GPU"),
        (GpuInfo((8, 0)), False, "8.0"),  # Ampere: no wgmma, no TMA
        (GpuInfo((10, 0)), False, "10.0"),  # Blackwell: tcgen05, not wgmma
        (GpuInfo((9, 0), cuda_runtime=12085), True, "ptxas"),
        (GpuInfo((9, 0), cuda_runtime=12085), False, None),
    ],
)
def test_device_reasons(gpu, causal, reason):
    got = hopper_device_reason(gpu, causal)
    assert got is None if reason is None else reason in got


@pytest.mark.parametrize(
    "call, dtypes, gpu, interpret, expected",
    [
        (problem(causal=True), BF16, H100, False, "hopper"),
        (problem(causal=True), BF16, H100, True, "triton"),  # the interpreter runs Triton's kernels
        (problem(causal=True), BF16, GpuInfo((8, 6)), False, "triton"),
        (problem(causal=True), BF16, None, False, "triton"),
        (problem(causal=True), (jnp.float32,) * 3, H100, False, "triton"),
        (problem(causal=True), (jnp.bfloat16, jnp.float16, jnp.float16), H100, False, "triton"),
        (problem(score="sigmoid"), BF16, H100, False, "triton"),
    ],
)
def test_routing(call, dtypes, gpu, interpret, expected):
    assert forward_kernel(call, dtypes, gpu, interpret=interpret) == expected


def test_forcing_a_forward():
    assert forward_kernel(problem(), BF16, H100, interpret=False, forward="triton") == "triton"
    assert forward_kernel(problem(), BF16, H100, interpret=False, forward="hopper") == "hopper"
    with pytest.raises(ValueError, match="the hopper forward kernel cannot run this call: sigmoid scores"):
        forward_kernel(problem(score="sigmoid"), BF16, H100, interpret=False, forward="hopper")
    with pytest.raises(ValueError, match="the forward kernel must be one of"):
        forward_kernel(problem(), BF16, H100, interpret=False, forward="mosaic")


def test_the_backward_supports_what_the_forward_does_within_its_shared_memory():
    assert hopper_backward_supports(problem(causal=True, kv_heads=1), jnp.bfloat16) is None
    assert hopper_backward_supports(problem(head_dim=64, q_len=77, kv_len=1000), jnp.float16) is None
    assert "sigmoid scores" in hopper_backward_supports(problem(score="sigmoid"), jnp.bfloat16)
    # dk/dv, the larger kernel: K/V tiles of two warpgroups and 4 slots of Q/dO blocks, 128
    # rows by 128 in bf16 (384 KiB), and 4 slots of lse/delta rows (4 KiB).
    too_big = hopper_backward_supports(problem(), jnp.bfloat16, HopperBlockSizes(128, 128, 4))
    assert "388 KiB of shared memory" in too_big


@pytest.mark.parametrize(
    "backward, call, gpu, by_default, expected",
    [
        ("auto", problem(causal=True), H100, False, "triton"),  # until checked on a device
        ("auto", problem(causal=True), H100, True, "hopper"),
        ("auto", problem(score="sigmoid"), H100, True, "triton"),
        ("auto", problem(), GpuInfo((8, 0)), True, "triton"),
        ("hopper", problem(causal=True), H100, False, "hopper"),
        ("triton", problem(causal=True), H100, True, "triton"),
    ],
)
def test_backward_routing(monkeypatch, backward, call, gpu, by_default, expected):
    monkeypatch.setattr(flash_attention_routing, "HOPPER_BACKWARD_BY_DEFAULT", by_default)
    assert backward_kernel(call, BF16, gpu, interpret=False, backward=backward) == expected


@pytest.mark.parametrize(
    "call, gpu, interpret, message",
    [
        (problem(logits_soft_cap=5.0), H100, False, "the hopper backward kernel cannot run this call: logits soft cap"),
        (problem(), GpuInfo((8, 0)), False, "compute capability 8.0"),
        (problem(), H100, True, "interpret mode"),
    ],
)
def test_forcing_the_hopper_backward_where_it_cannot_run_names_the_reason(call, gpu, interpret, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        backward_kernel(call, BF16, gpu, interpret=interpret, backward="hopper")
    with pytest.raises(ValueError, match="the backward kernel must be one of"):
        backward_kernel(call, BF16, gpu, interpret=interpret, backward="mosaic")


# Lengths differ per case: the jitted op caches its trace by shapes, not by device.
@pytest.mark.parametrize(
    "gpu, forward, length", [(H100, "flash_attention_forward_hopper", 100), (GpuInfo((8, 0)), None, 101)]
)
def test_the_op_on_a_gpu_runs_the_hopper_forward_with_the_triton_backward(monkeypatch, gpu, forward, length):
    """``flash_attention(impl="pallas")`` with a GPU faked: an sm90 device takes the Hopper
    forward (head_dim 80 padded to 128 runs it too); the backward is Triton's dq and dk/dv."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(GpuInfo, "here", classmethod(lambda cls: gpu))
    q = jnp.zeros((1, length, 2, 80), jnp.bfloat16)
    k = jnp.zeros((1, length, 1, 80), jnp.bfloat16)
    kernels = kernels_in_gradient(lambda q, k, v: flash_attention(q, k, v, causal=True, impl="pallas"), q, k, k)
    assert kernels == {forward or "flash_attention_forward", "flash_attention_dq", "flash_attention_dkv"}


def test_forward_triton_keeps_the_triton_forward_on_hopper(monkeypatch):
    monkeypatch.setattr(GpuInfo, "here", classmethod(lambda cls: H100))
    q = jnp.zeros((1, 64, 2, 64), jnp.float16)
    call = problem(head_dim=64, heads=2, kv_heads=2, q_len=64, kv_len=64, dtype=jnp.float16)

    def run(forward):
        return kernels_in_gradient(
            lambda q, k, v: flash_attention_kernel(
                q, k, v, None, problem=call, block_sizes=FlashBlockSizes(64, 64), interpret=False, forward=forward
            ),
            q,
            q,
            q,
        )

    assert "flash_attention_forward" in run("triton") and "flash_attention_forward_hopper" not in run("triton")
    assert "flash_attention_forward_hopper" in run("auto")


@pytest.mark.parametrize(
    "forward, expected_forward", [("auto", "flash_attention_forward_hopper"), ("triton", "flash_attention_forward")]
)
def test_the_hopper_backward_runs_its_dq_and_dkv_kernels_behind_either_forward(monkeypatch, forward, expected_forward):
    """GQA with head_dim 80 (padded to 128), causal, lengths off the tiles: the gradient's
    jaxpr holds the Hopper dq and dk/dv kernels and no Triton backward kernel."""
    monkeypatch.setattr(GpuInfo, "here", classmethod(lambda cls: H100))
    q = jnp.zeros((1, 100, 4, 80), jnp.bfloat16)
    k = jnp.zeros((1, 100, 2, 80), jnp.bfloat16)
    call = attention_problem(q, k, k, causal=True)
    kernels = kernels_in_gradient(
        lambda q, k, v: flash_attention_kernel(
            q,
            k,
            v,
            None,
            problem=call,
            block_sizes=FlashBlockSizes(64, 64),
            interpret=False,
            forward=forward,
            backward="hopper",
        ),
        q,
        k,
        k,
    )
    assert kernels == {expected_forward, "flash_attention_dq_hopper", "flash_attention_dkv_hopper"}


def test_the_op_takes_the_hopper_backward_when_asked_and_refuses_it_off_the_gpu_kernels(monkeypatch):
    q = jnp.zeros((1, 102, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="backward_kernel='hopper' chooses among the GPU kernels"):
        flash_attention(q, q, q, impl="xla", backward_kernel="hopper")
    with pytest.raises(ValueError, match="the hopper backward kernel cannot run this call: interpret mode"):
        jax.grad(lambda q: flash_attention(q, q, q, impl="interpret", backward_kernel="hopper").sum())(q)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(GpuInfo, "here", classmethod(lambda cls: H100))
    attend = lambda q, k, v: flash_attention(q, k, v, impl="pallas", backward_kernel="hopper")  # noqa: E731
    kernels = kernels_in_gradient(attend, q, q, q)
    assert kernels == {"flash_attention_forward_hopper", "flash_attention_dq_hopper", "flash_attention_dkv_hopper"}

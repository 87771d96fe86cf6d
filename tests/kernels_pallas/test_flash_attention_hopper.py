"""The Hopper (Mosaic GPU) forward of flash attention without a GPU: what it supports (and
the reasons it gives otherwise), and which forward a call routes to for a given device.
Its values are checked on an H100/H200 by ``python -m benchmarks.gpu`` (HOPPER_CHECKS);
here kernels are only traced, never run."""

import re

import jax
import jax.numpy as jnp
import pytest

from ember.kernels_pallas.block_mask import CausalMask
from ember.kernels_pallas.flash_attention import FlashBlockSizes, attention_problem, flash_attention
from ember.kernels_pallas.flash_attention_kernels import flash_attention_kernel, forward_kernel
from ember.kernels_pallas.flash_attention_mgpu import (
    GpuInfo,
    HopperBlockSizes,
    hopper_device_reason,
    hopper_supports,
)

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
    with pytest.raises(ValueError, match="forward='hopper' cannot run this call: sigmoid scores"):
        forward_kernel(problem(score="sigmoid"), BF16, H100, interpret=False, forward="hopper")
    with pytest.raises(ValueError, match="forward must be one of"):
        forward_kernel(problem(), BF16, H100, interpret=False, forward="mosaic")


def kernels_in(fn, *args) -> set[str]:
    """The Pallas kernels in the jaxpr of ``fn``'s gradient (traced, not run)."""
    grad = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    return set(re.findall(r"flash_attention_\w+", str(jax.make_jaxpr(grad)(*args))))


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
    kernels = kernels_in(lambda q, k, v: flash_attention(q, k, v, causal=True, impl="pallas"), q, k, k)
    assert kernels == {forward or "flash_attention_forward", "flash_attention_dq", "flash_attention_dkv"}


def test_forward_triton_keeps_the_triton_forward_on_hopper(monkeypatch):
    monkeypatch.setattr(GpuInfo, "here", classmethod(lambda cls: H100))
    q = jnp.zeros((1, 64, 2, 64), jnp.float16)
    call = problem(head_dim=64, heads=2, kv_heads=2, q_len=64, kv_len=64, dtype=jnp.float16)

    def run(forward):
        return kernels_in(
            lambda q, k, v: flash_attention_kernel(
                q, k, v, None, problem=call, block_sizes=FlashBlockSizes(64, 64), interpret=False, forward=forward
            ),
            q,
            q,
            q,
        )

    assert "flash_attention_forward" in run("triton") and "flash_attention_forward_hopper" not in run("triton")
    assert "flash_attention_forward_hopper" in run("auto")

"""Which kernels run a flash-attention call on a GPU: the Hopper (Mosaic GPU) forward and
backward of :mod:`ember.kernels_pallas.flash_attention_mgpu` and
:mod:`ember.kernels_pallas.flash_attention_mgpu_backward`, or the Triton kernels of
:mod:`ember.kernels_pallas.flash_attention_kernels`, which run everything.

Each choice is one of :data:`ember.kernels_pallas.dispatch.GPU_KERNELS`, resolved by
:func:`ember.kernels_pallas.dispatch.choose_gpu_kernel`.
"""

from __future__ import annotations

import jax.numpy as jnp

from ember.kernels_pallas.block_mask import CausalMask
from ember.kernels_pallas.dispatch import choose_gpu_kernel
from ember.kernels_pallas.flash_attention_mgpu import DEFAULT_HOPPER_BLOCKS, HopperBlockSizes, hopper_supports
from ember.kernels_pallas.flash_attention_mgpu_backward import (
    DEFAULT_HOPPER_BACKWARD_BLOCKS,
    hopper_backward_supports,
)
from ember.kernels_pallas.hopper import GpuInfo, hopper_device_reason

# "auto" takes the Hopper backward once its values have been checked on an sm90 device
# (python -m benchmarks.gpu, check flash_attention[hopper_backward,...]). Until then it has
# been checked in jax's Mosaic GPU interpreter and lowered for CUDA on CPU only, so "auto"
# keeps the Triton backward and backward="hopper" asks for it.
HOPPER_BACKWARD_BY_DEFAULT = False


def _reason(supports, problem, dtypes, gpu: GpuInfo | None, interpret: bool, blocks: HopperBlockSizes) -> str | None:
    if interpret:
        return "interpret mode (the Pallas interpreter runs the Triton kernels)"
    if len(set(map(jnp.dtype, dtypes))) != 1:
        return f"q, k, v dtypes differ: {', '.join(jnp.dtype(d).name for d in dtypes)}"
    causal = isinstance(problem.mask, CausalMask)
    return supports(problem, dtypes[0], blocks) or hopper_device_reason(gpu, causal)


def hopper_reason(problem, dtypes, gpu: GpuInfo | None, *, interpret: bool, blocks: HopperBlockSizes) -> str | None:
    """None when the Hopper forward runs ``problem`` with inputs of ``dtypes`` (q, k, v) on
    ``gpu`` (None: not an NVIDIA GPU), else why not."""
    return _reason(hopper_supports, problem, dtypes, gpu, interpret, blocks)


def hopper_backward_reason(
    problem, dtypes, gpu: GpuInfo | None, *, interpret: bool, blocks: HopperBlockSizes
) -> str | None:
    """None when the Hopper backward computes ``problem``'s gradients, else why not."""
    return _reason(hopper_backward_supports, problem, dtypes, gpu, interpret, blocks)


def forward_kernel(
    problem,
    dtypes,
    gpu: GpuInfo | None,
    *,
    interpret: bool,
    forward: str = "auto",
    hopper_blocks: HopperBlockSizes = DEFAULT_HOPPER_BLOCKS,
) -> str:
    """Which forward runs a call: ``"hopper"`` where :func:`hopper_reason` has nothing
    against it, else ``"triton"``; ``forward`` forces one.

    Raises:
      ValueError: for an unknown ``forward``, or ``forward="hopper"`` where it cannot run.
    """
    reason = hopper_reason(problem, dtypes, gpu, interpret=interpret, blocks=hopper_blocks)
    return choose_gpu_kernel("forward", forward, reason, hopper_by_default=True)


def backward_kernel(
    problem,
    dtypes,
    gpu: GpuInfo | None,
    *,
    interpret: bool,
    backward: str = "auto",
    hopper_blocks: HopperBlockSizes = DEFAULT_HOPPER_BACKWARD_BLOCKS,
) -> str:
    """Which backward computes a call's gradients: ``"hopper"`` where asked for (or, once
    :data:`HOPPER_BACKWARD_BY_DEFAULT`, by ``"auto"``) and :func:`hopper_backward_reason`
    has nothing against it, else ``"triton"``.

    Raises:
      ValueError: for an unknown ``backward``, or ``backward="hopper"`` where it cannot run.
    """
    reason = hopper_backward_reason(problem, dtypes, gpu, interpret=interpret, blocks=hopper_blocks)
    return choose_gpu_kernel("backward", backward, reason, hopper_by_default=HOPPER_BACKWARD_BY_DEFAULT)

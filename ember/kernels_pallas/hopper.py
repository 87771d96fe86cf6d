"""What the Hopper (sm90) kernels written for Mosaic GPU share: whether a device runs them
(:class:`GpuInfo`, :func:`hopper_device_reason`), the shared-memory budget of a CTA, the
shared-memory tiling of 16-bit tiles for TMA and wgmma, and the launch of a warp-specialised
kernel (compute warpgroups beside one memory warpgroup).

The kernels: flash attention's forward (:mod:`ember.kernels_pallas.flash_attention_mgpu`)
and backward (:mod:`ember.kernels_pallas.flash_attention_mgpu_backward`), and the grouped
matmul's ``gmm`` (:mod:`ember.kernels_pallas.grouped_matmul_mgpu`). Mosaic GPU is imported
lazily, so this module imports (and the device checks answer) on any backend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

WGMMA_DTYPES: tuple[str, ...] = ("bfloat16", "float16")  # wgmma's 16-bit operand types

# Shared memory per CTA on sm90 is 227 KiB; keep room for barriers and reduction scratch.
SMEM_BUDGET_BYTES = 220 * 1024
# The ptxas of these CUDA runtimes miscompiles causal masking in this kind of kernel
# (JAX's attention_mgpu refuses them too): [12.8.0, 12.9.1).
_BAD_CUDA_FOR_CAUSAL = (12080, 12091)


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """What decides whether the Hopper kernel can run on a device: its compute capability
    and, when known, the CUDA runtime version (``12090`` for 12.9.0)."""

    capability: tuple[int, int]
    cuda_runtime: int | None = None

    @classmethod
    def here(cls) -> GpuInfo | None:
        """The default device's, or None when it is not an NVIDIA GPU."""
        device = jax.devices()[0]
        capability = getattr(device, "compute_capability", None)
        if device.platform != "gpu" or not capability:
            return None
        return cls(tuple(int(part) for part in str(capability).split(".")[:2]), _cuda_runtime_version())


def _cuda_runtime_version() -> int | None:
    try:  # private to jax; only a guard against a known ptxas bug, so absence is fine
        from jax._src.lib import cuda_versions

        return int(cuda_versions.cuda_runtime_get_version())
    except Exception:
        return None


def hopper_device_reason(gpu: GpuInfo | None, causal: bool) -> str | None:
    """None when ``gpu`` runs the Hopper kernel, else why not."""
    if gpu is None:
        return "not an NVIDIA GPU (Mosaic GPU compiles for CUDA devices only)"
    if gpu.capability[0] != 9:
        # wgmma exists on sm90 only: Blackwell has tcgen05 instead, Ampere neither.
        return f"compute capability {gpu.capability[0]}.{gpu.capability[1]}: wgmma needs 9.x (Hopper)"
    low, high = _BAD_CUDA_FOR_CAUSAL
    if causal and gpu.cuda_runtime is not None and low <= gpu.cuda_runtime < high:
        return f"causal on CUDA runtime {gpu.cuda_runtime}: ptxas 12.8-12.9.0 miscompiles the causal mask"
    return None


def shared_memory_reason(blocks, smem_bytes: int) -> str | None:
    """None when a CTA of ``smem_bytes`` (a kernel's with ``blocks``) fits
    :data:`SMEM_BUDGET_BYTES`, else the reason it does not."""
    if smem_bytes > SMEM_BUDGET_BYTES:
        return f"{blocks} need {smem_bytes // 1024} KiB of shared memory (> {SMEM_BUDGET_BYTES // 1024} KiB)"
    return None


def tma_transforms() -> tuple:
    """Shared-memory tiling of 16-bit ``[rows, head_dim]`` tiles for TMA and wgmma: 64-element
    rows are 128 bytes, the widest swizzle."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def feed_ring(load: Callable, steps, stages: int, consumed, max_steps: int | None = None) -> None:
    """A memory warpgroup's side of a ring of ``stages`` shared-memory slots: ``load(step,
    slot)`` for the steps ``0 .. steps - 1`` (``steps`` may be traced; ``max_steps`` bounds it
    statically), step ``s`` into slot ``s % stages``, each refill once ``consumed.at[slot]``
    (the barrier the compute warpgroups arrive on when done with a slot) has completed. Then
    it waits out the last releases too, so that no barrier phase is left unobserved at exit."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    static = isinstance(steps, int)
    for slot in range(min(stages, steps if static else (max_steps or stages))):
        if static:
            load(slot, slot)
        else:  # a short causal tile may need fewer steps than slots
            pl.when(slot < steps)(functools.partial(load, slot, slot))

    @pl.loop(stages, steps)
    def _(step):
        slot = lax.rem(step, jnp.int32(stages))
        plgpu.barrier_wait(consumed.at[slot])
        load(step, slot)

    @pl.loop(max(steps - stages, 0) if static else jnp.maximum(steps - stages, 0), steps)
    def _(step):
        plgpu.barrier_wait(consumed.at[lax.rem(step, jnp.int32(stages))])


def warp_specialized(compute: Callable, memory: Callable, compute_warpgroups: int) -> None:
    """The body of a kernel launched with ``compute_warpgroups + 1`` threads named ``"wg"``:
    warpgroups ``0 .. compute_warpgroups - 1`` run ``compute(wg)``, the last ``memory()``."""
    wg = lax.axis_index("wg")
    pl.when(wg < compute_warpgroups)(lambda: compute(wg))
    pl.when(wg == compute_warpgroups)(memory)

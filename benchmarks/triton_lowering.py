"""Lowers every kernel of the GPU command for CUDA on a machine without a GPU.

    python -m benchmarks.triton_lowering                 # table; exit code 1 if a kernel fails
    python -m benchmarks.triton_lowering flash_attention # only checks whose name contains it

``jax.export(..., platforms=["cuda"])`` runs JAX's whole Pallas-to-Triton-IR lowering (the
kernels of :data:`benchmarks.device_checks.KERNEL_CHECKS` at the GPU check sizes, forward
and backward) on any machine, so errors such as a non-power-of-two tile, mismatched dot
operand types or a primitive the Triton lowering lacks show up without device time. It
cannot catch what happens after: Triton's own compilation to PTX (register or shared-memory
limits) and wrong values; ``python -m benchmarks.gpu`` on the device does.

Two stand-ins make the lowering run without a GPU: while tracing, the kernels' dispatch
sees the backend ``"gpu"`` (so ``impl="auto"`` picks the kernel and its Triton compiler
parameters), and on JAX 0.11 the Triton lowering is told it targets compute capability 9.0
(an H100), which it would otherwise read from a device.
"""

from __future__ import annotations

import contextlib
import sys
import types
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from benchmarks.device_checks import GPU_CHECK_SIZES, KERNEL_CHECKS, CheckSizes, Problem, program, random_cotangents
from benchmarks.harness import print_table

TRITON_CALL = "__gpu$xla.gpu.triton"
HOPPER_COMPUTE_CAPABILITY = 90


@contextlib.contextmanager
def pretend_gpu():
    """Kernels dispatch as on a GPU, and the Triton lowering targets an H100."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(unittest.mock.patch.object(jax, "default_backend", lambda: "gpu"))
        try:  # JAX 0.11 reads the compute capability from a device (or an abstract one)
            from jax._src.pallas.triton import pallas_call_registration
        except ImportError:
            pallas_call_registration = None
        gpu_info = getattr(pallas_call_registration, "gpu_info_lib", None)
        if gpu_info is not None:
            hopper = types.SimpleNamespace(compute_capability=HOPPER_COMPUTE_CAPABILITY)
            stack.enter_context(unittest.mock.patch.object(gpu_info, "get_gpu_info", lambda: hopper))
        yield


def triton_kernels_in(problem: Problem) -> int:
    """How many Triton kernels the lowering of the kernel (and its VJP) for CUDA holds."""
    cotangents = random_cotangents(problem, np.random.default_rng(0))
    exported = export.export(
        jax.jit(program(problem.kernel, problem.differentiable)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
    )(problem.inputs, cotangents)
    return exported.mlir_module().count(f"custom_call @{TRITON_CALL}")


def lower_all(sizes: CheckSizes = GPU_CHECK_SIZES, only: tuple[str, ...] = ()) -> dict[str, dict]:
    """``{"<kernel> <dtype>": {"lowered": bool, "triton_kernels": n} or {"lowered": False,
    "error": text}}`` for every check (with ``only``: whose name contains one of them)."""
    results = {}
    with pretend_gpu():
        for check in KERNEL_CHECKS:
            if only and not any(part in check.name for part in only):
                continue
            for dtype in sizes.dtypes:
                try:
                    problem = check.problem(sizes, jnp.dtype(dtype), np.random.default_rng(0))
                    record = {"lowered": True, "triton_kernels": triton_kernels_in(problem)}
                except Exception as error:
                    record = {"lowered": False, "error": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
                results[f"{check.name} {dtype}"] = record
    return results


def main(argv=None) -> int:
    results = lower_all(only=tuple(sys.argv[1:] if argv is None else argv))
    print_table(
        [dict(kernel=name, **record) for name, record in results.items()],
        ["kernel", "lowered", "triton_kernels", "error"],
    )
    return 0 if all(record["lowered"] for record in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

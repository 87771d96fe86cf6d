"""Compiles every Triton kernel of the GPU checks for an H100 on a machine without a GPU, and
reports what each asks of the hardware: shared memory, registers and spills.

    python -m benchmarks.triton_compile                  # every check; exit code 1 if one fails
    python -m benchmarks.triton_compile linear_attention # only checks whose name contains it

Needs JAX 0.11 with the CUDA plugin wheels and ``pip install triton`` (3.9 read JAX 0.11.2's
Triton IR); no GPU or NVIDIA libraries. :mod:`benchmarks.triton_lowering` stops at the Triton
IR that JAX's lowering writes; this goes on, with Triton's own compiler, to a cubin for
sm_90, whose resource usage the ``cuobjdump`` bundled with Triton prints: registers per
thread and the stack frame that spilled registers live in. So a kernel that would need more
than the 227 KB of shared memory a block may have, or that spills registers to local memory,
shows up before a device call, not in it.
Values and times still need the device (``python -m benchmarks.gpu``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
import subprocess
import sys
import tempfile
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_checks import GPU_CHECK_SIZES, KERNEL_CHECKS, CheckSizes
from benchmarks.harness import print_table
from benchmarks.triton_lowering import pretend_gpu, triton_kernels_in

SHARED_MEMORY_PER_BLOCK = 227 * 1024  # an H100's (and H200's) opt-in maximum
RESOURCE_USAGE = re.compile(r"REG:(\d+) STACK:(\d+)")


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One kernel as JAX hands it to Triton: its IR and launch options."""

    name: str
    ir: str
    num_warps: int
    num_stages: int


@contextlib.contextmanager
def captured_kernels():
    """Collects, into the list it yields, every Triton kernel that JAX's lowering writes
    inside the block (lower for CUDA under :func:`benchmarks.triton_lowering.pretend_gpu`)."""
    from jax._src.pallas.triton import lowering, pallas_call_registration

    captured: list[TritonKernel] = []
    lower = lowering.lower_jaxpr_to_triton_module

    def lower_and_keep(*args, **kwargs):
        result = lower(*args, **kwargs)
        # The launch options are locals of the pallas_call lowering rule that called us.
        caller = sys._getframe(1).f_locals
        captured.append(
            TritonKernel(caller["name"], result.module.operation.get_asm(), caller["num_warps"], caller["num_stages"])
        )
        return result

    with unittest.mock.patch.object(pallas_call_registration.lowering, "lower_jaxpr_to_triton_module", lower_and_keep):
        yield captured


def compile_for_hopper(kernel: TritonKernel, workdir: pathlib.Path) -> dict:
    """``{"shared_kb", "registers", "stack_bytes"}`` of ``kernel`` compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    source = workdir / f"{kernel.name}.ttir"
    source.write_text(kernel.ir)
    compiled = triton.compile(
        str(source),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages),
    )
    cubin = workdir / f"{kernel.name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run(
        [str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    registers, stack = RESOURCE_USAGE.search(usage).groups()
    return {
        "shared_kb": round(compiled.metadata.shared / 1024, 1),
        "registers": int(registers),
        "stack_bytes": int(stack),
    }


def compile_all(sizes: CheckSizes = GPU_CHECK_SIZES, only: tuple[str, ...] = ()) -> list[dict]:
    """One row per Triton kernel of every check (with ``only``: whose name contains one of
    them) and dtype: the check, the kernel, its launch options and :func:`compile_for_hopper`'s
    figures, or the error that stopped it."""
    rows = []
    with pretend_gpu(), tempfile.TemporaryDirectory() as workdir:
        for check in KERNEL_CHECKS:
            if only and not any(part in check.name for part in only):
                continue
            for dtype in sizes.dtypes:
                label = f"{check.name} {dtype}"
                try:
                    problem = check.problem(sizes, jnp.dtype(dtype), np.random.default_rng(0))
                    with captured_kernels() as kernels:
                        triton_kernels_in(problem)
                except Exception as error:
                    rows.append(dict(check=label, error=_first_line(error)))
                    continue
                for kernel in kernels:
                    row = dict(check=label, kernel=kernel.name, warps=kernel.num_warps, stages=kernel.num_stages)
                    try:
                        row |= compile_for_hopper(kernel, pathlib.Path(workdir))
                    except Exception as error:
                        row["error"] = _first_line(error)
                    rows.append(row)
    return rows


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


def fits(row: dict) -> bool:
    """Compiled, within the shared memory a block may have, and without spills (no stack)."""
    return "error" not in row and row["shared_kb"] * 1024 <= SHARED_MEMORY_PER_BLOCK and row["stack_bytes"] == 0


def main(argv=None) -> int:
    jax.config.update("jax_platforms", "cpu")
    rows = compile_all(only=tuple(sys.argv[1:] if argv is None else argv))
    for row in rows:
        row["fits"] = fits(row)
    print_table(rows, ["check", "kernel", "warps", "stages", "shared_kb", "registers", "stack_bytes", "fits", "error"])
    return 0 if all(row["fits"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

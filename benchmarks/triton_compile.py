"""Compiles every Triton kernel of the GPU checks (or of the timed calls) for an H100 on a
machine without a GPU, and reports what each asks of the hardware: shared memory, registers
and spills.

    python -m benchmarks.triton_compile                    # every check; exit code 1 if one does not fit
    python -m benchmarks.triton_compile linear_attention   # only checks whose name contains it
    python -m benchmarks.triton_compile --benchmark-shapes # the shapes the GPU command times

Needs JAX 0.11 with the CUDA plugin wheels and ``pip install triton`` (3.9 reads JAX 0.11.2's
Triton IR); no GPU or NVIDIA libraries. :mod:`benchmarks.triton_lowering` stops at the Triton
IR that JAX's lowering writes; this goes on, with Triton's own compiler, to a cubin for
sm_90, whose resource usage the ``cuobjdump`` bundled with Triton prints: registers per
thread and the stack frame that spilled registers live in. So a kernel that would need more
than the 227 KB of shared memory a block may have, or that spills registers to local memory,
shows up before a device call, not in it. Values and times still need the device
(``python -m benchmarks.gpu``).
"""

from __future__ import annotations

import argparse
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


def _compiled_rows(label: str, lower, workdir: pathlib.Path) -> list[dict]:
    """One row per Triton kernel that ``lower()`` hands JAX's lowering: the kernel, its launch
    options and :func:`compile_for_hopper`'s figures, or the error that stopped it."""
    try:
        with captured_kernels() as kernels:
            lower()
    except Exception as error:
        return [dict(check=label, error=_first_line(error))]
    rows = []
    for kernel in kernels:
        row = dict(check=label, kernel=kernel.name, warps=kernel.num_warps, stages=kernel.num_stages)
        try:
            row |= compile_for_hopper(kernel, workdir)
        except Exception as error:
            row["error"] = _first_line(error)
        rows.append(row)
    return rows


def compile_all(sizes: CheckSizes = GPU_CHECK_SIZES, only: tuple[str, ...] = ()) -> list[dict]:
    """:func:`_compiled_rows` of every check (with ``only``: whose name contains one of them),
    forward and backward, in each dtype."""
    rows = []
    with pretend_gpu(), tempfile.TemporaryDirectory() as workdir:
        for check in KERNEL_CHECKS:
            if only and not any(part in check.name for part in only):
                continue
            for dtype in sizes.dtypes:

                def lower(check=check, dtype=dtype):
                    triton_kernels_in(check.problem(sizes, jnp.dtype(dtype), np.random.default_rng(0)))

                rows += _compiled_rows(f"{check.name} {dtype}", lower, pathlib.Path(workdir))
    return rows


def compile_benchmark_shapes(only: tuple[str, ...] = ()) -> list[dict]:
    """:func:`_compiled_rows` of the Triton kernels at the shapes the GPU command times
    (:func:`benchmark_shapes`), with their default tiles."""
    rows = []
    with pretend_gpu(), tempfile.TemporaryDirectory() as workdir:
        for label, fn, args in benchmark_shapes():
            if only and not any(part in label for part in only):
                continue

            def lower(fn=fn, args=args):
                jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))

            rows += _compiled_rows(label, lower, pathlib.Path(workdir))
    return rows


def benchmark_shapes() -> list[tuple[str, object, tuple]]:
    """``(label, fn, abstract args)`` of the calls ``benchmarks.gpu`` times on the device
    (bf16; gradients where the rows time a backward): flash attention at the goal's 8k and the
    350M train step's shape, linear attention at 16k, the grouped matmul at the Mixtral shape,
    a ragged paged decode step and quantized matmuls of a decode step's and a prefill's rows."""
    from benchmarks import gpu, sequence_mixers
    from ember.kernels_pallas.flash_attention import flash_attention
    from ember.kernels_pallas.grouped_matmul import grouped_matmul
    from ember.kernels_pallas.linear_attention import linear_attention
    from ember.kernels_pallas.quantized_formats import QuantizedMatrix
    from ember.kernels_pallas.quantized_matmul import quantized_matmul
    from ember.kernels_pallas.ragged_paged_attention import ragged_paged_attention
    from ember.models.config import ModelConfig

    sizes, bf16, int32 = gpu.GPU_SIZES, jnp.bfloat16, jnp.int32
    array = jax.ShapeDtypeStruct

    def gradient(fn):
        return jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=tuple(range(3)))

    def flash(q, k, v):
        return flash_attention(q, k, v, causal=True, impl="pallas")

    preset, train_batch, train_len = sizes.train
    model = gpu.load_config(ModelConfig, gpu.PRESETS / f"{preset}.yaml")
    shapes = [
        (
            f"flash fwd+bwd causal {sizes.goal_len}, head_dim {sizes.head_dim}",
            (sizes.batch, sizes.goal_len, sizes.heads, sizes.head_dim),
        ),
        (
            f"flash fwd+bwd causal {train_len}, head_dim {model.d_model // model.num_heads} ({preset})",
            (train_batch, train_len, model.num_heads, model.d_model // model.num_heads),
        ),
    ]
    calls = [(label, gradient(flash), (array(shape, bf16),) * 3) for label, shape in shapes]

    mixers = sequence_mixers.GPU_SIZES
    seq = max(length for length in mixers.seq_lens if length <= mixers.scan_max_seq)
    qkv = array((mixers.batch, seq, mixers.heads, mixers.head_dim), bf16)

    def linear(q, k, v, log_decay):
        return linear_attention(q, k, v, log_decay=log_decay, impl="pallas")

    linear_gradient = jax.grad(lambda *a: linear(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))
    calls.append(
        (f"linear attention fwd+bwd {seq}", linear_gradient, (qkv, qkv, qkv, array(qkv.shape[:3], jnp.float32)))
    )

    problem = sizes.moe.problems[0]
    grouped = jax.grad(
        lambda lhs, rhs, groups: grouped_matmul(lhs, rhs, groups, impl="pallas").astype(jnp.float32).sum(), (0, 1)
    )
    calls.append(
        (
            f"grouped matmul fwd+bwd {problem}",
            grouped,
            (
                array((problem.rows, problem.k), bf16),
                array((problem.experts, problem.k, problem.n), bf16),
                array((problem.experts,), int32),
            ),
        )
    )

    d = sizes.decode
    pages = d["num_seqs"] * d["length"] // d["page_size"]
    cache = array((pages, d["page_size"], d["kv_heads"], d["head_dim"]), bf16)
    decode_args = (
        array((d["num_seqs"], d["heads"], d["head_dim"]), bf16),
        cache,
        cache,
        array((d["num_seqs"], d["length"] // d["page_size"]), int32),
        *(array((d["num_seqs"],), int32),) * 3,
    )
    calls.append(("ragged paged decode step", lambda *a: ragged_paged_attention(*a, impl="pallas"), decode_args))

    k, batches = sizes.quantized_matmul[:2]
    for fmt in ("int8", "int4", "nf4"):
        codes = array((k, k), jnp.int8) if fmt == "int8" else array((k // 2, k), jnp.uint8)
        groups = 1 if fmt == "int8" else k // 64
        for rows in (16, max(batches)):  # a decode step's tiles, and a prefill's
            calls.append(
                (
                    f"quantized matmul {fmt} {rows} x {k} x {k}",
                    lambda x, codes, scales, fmt=fmt: quantized_matmul(
                        x, QuantizedMatrix(codes, scales, fmt), impl="pallas"
                    ),
                    (array((rows, k), bf16), codes, array((groups, k), jnp.float32)),
                )
            )
    return calls


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


def fits(row: dict) -> bool:
    """Compiled, within the shared memory a block may have, and without spills (no stack)."""
    return "error" not in row and row["shared_kb"] * 1024 <= SHARED_MEMORY_PER_BLOCK and row["stack_bytes"] == 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="only checks (or shapes) whose name contains one of these")
    parser.add_argument(
        "--benchmark-shapes", action="store_true", help="the shapes the GPU command times, not the checks'"
    )
    args = parser.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    names = tuple(args.names)
    rows = compile_benchmark_shapes(names) if args.benchmark_shapes else compile_all(only=names)
    for row in rows:
        row["fits"] = fits(row)
    print_table(rows, ["check", "kernel", "warps", "stages", "shared_kb", "registers", "stack_bytes", "fits", "error"])
    return 0 if all(row["fits"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

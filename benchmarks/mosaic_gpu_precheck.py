"""The Hopper (Mosaic GPU) kernels checked without a GPU, before a device call: flash
attention's forward and backward, and the grouped matmul's ``gmm``.

    python -m benchmarks.mosaic_gpu_precheck     # jax 0.11.2 + CUDA plugin wheels; no GPU

The suite's jax (0.10) only traces these kernels. With jax 0.11.2 and the CUDA plugin wheels
(``jax-cuda12-plugin``, ``jax-cuda12-pjrt``: no NVIDIA libraries or driver needed) in a
Python 3.12 venv, this command:

1. **lowers** the Hopper flash-attention forward and backward for CUDA at the GPU benchmark's
   sizes (batch 8, 16 heads, head_dim 128, 8k, causal and not, and GQA), and the Hopper
   ``gmm`` at both MoE benchmark problems, plain and with ``rhs`` transposed (``d_lhs``):
   Mosaic GPU's layout inference, lowering and shared-memory check all run on the CPU;
2. **runs** them in jax's Mosaic GPU interpreter at small sizes. Flash attention goes
   through the op's kernel path (``forward="hopper"``, ``backward="hopper"``, an sm90
   device faked): GQA and MQA, causal and not, head_dim 64, 80 (padded to 128) and 128,
   lengths off the tiles, bf16 and f16; output and dq/dk/dv are compared with
   ``flash_attention_reference`` under one random cotangent. ``gmm`` runs with groups that
   straddle tiles, an empty group, a one-row group and rows of no group (NaN there): against
   per-group matmuls, and its no-group rows must be exactly 0. Limits:
   :data:`benchmarks.device_checks.RELATIVE_ERROR_LIMITS`.

jax 0.11.2's interpreter lacks two things the kernels use, which this module adds to the
running process only (nothing on disk changes): ``pl.run_state`` over WGMMA accumulators
(each accumulator becomes a register buffer for the body, read back at the end) and
``wgmma`` with its A operand in registers (staged in a buffer for the call). The
interpreter runs warpgroups as threads with their barriers, so a wrong barrier protocol
hangs or fails; it does not model timing or register pressure, which are the device's.
Exit status 1 if any case fails.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import itertools
import re
import sys
import textwrap
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_checks import RELATIVE_ERROR_LIMITS, relative_error
from ember.kernels_pallas.flash_attention import FlashBlockSizes, attention_problem, flash_attention_reference
from ember.kernels_pallas.flash_attention_kernels import flash_attention_kernel
from ember.kernels_pallas.grouped_matmul_mgpu import HopperGmmBlockSizes, hopper_gmm
from ember.kernels_pallas.hopper import GpuInfo

PATCHED_JAX = "0.11.2"
# (batch, q_len, kv_len, heads, kv_heads, head_dim, causal, dtype)
INTERPRETED_CASES = (
    (1, 256, 256, 2, 1, 64, True, "bfloat16"),
    (2, 200, 250, 4, 2, 64, True, "bfloat16"),
    (1, 100, 100, 4, 2, 80, True, "bfloat16"),
    (2, 77, 200, 2, 1, 64, False, "float16"),
    (1, 200, 130, 3, 3, 128, True, "bfloat16"),
)
LOWERED_CASES = ((8, 8192, 16, 16, True), (8, 8192, 16, 16, False), (2, 4096, 32, 8, True))
# (rows, k, n, group sizes, rows before the first group, transpose_rhs, dtype); blocks 64x64
INTERPRETED_GMM_CASES = (
    (200, 100, 130, (70, 0, 90, 30), 5, False, "bfloat16"),
    (192, 128, 64, (64, 64, 0, 64), 0, True, "bfloat16"),
    (150, 64, 128, (1, 140), 0, False, "float16"),
)
# (groups, rows, k, n, transpose_rhs): the MoE benchmark's problems, and d_lhs of the first
LOWERED_GMM_CASES = ((8, 16384, 4096, 14336, False), (8, 16384, 14336, 4096, True), (64, 32768, 2048, 1408, False))


def _patch_interpreter() -> None:
    """Teach jax 0.11.2's Mosaic GPU interpreter ``run_state`` over accumulators and wgmma
    with A in registers (see the module docstring)."""
    from jax._src import callback
    from jax._src.pallas.mosaic_gpu import core as mgpu_core
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret
    from jax._src.state import discharge
    from jax._src.state import types as state_types

    interpreter = jaxpr_interpret.JaxprInterpreter
    if getattr(interpreter, "_ember_patched", False):
        return
    if jax.__version__ != PATCHED_JAX:
        raise SystemExit(f"the interpreter patch is written against jax {PATCHED_JAX}; this is {jax.__version__}")
    regs = gpu_callbacks.memory.get_memory_space_idx(mgpu_core.MemorySpace.REGS)

    def allocate(self, token, value, source_info):
        token, request = gpu_callbacks.call_make_allocation_request_array(
            token=token, compute_unit=self.thread, memory_space_id=regs, initial_ref_count=1
        )
        return gpu_callbacks.call_allocate_buffer(
            token=token,
            mesh_location=self.mesh_location,
            thread=self.thread,
            allocation_request_as_array=request,
            value=value,
            source_info=source_info,
        )

    def free(self, token, key, source_info):
        return gpu_callbacks.call_deallocate_buffer(
            token=token,
            mesh_location=self.mesh_location,
            thread=self.thread,
            allocation_key_as_array=key,
            source_info=source_info,
        )

    def run_state(self, eqn, token, values):
        keys = []
        for var, value in zip(eqn.invars, values, strict=True):
            if isinstance(var.aval, state_types.AbstractRef):  # a ref closed over: passed on
                keys.append(value)
            else:
                token, key = allocate(self, token, value, eqn.source_info)
                keys.append(key)
        token, _ = self.interpret(eqn.params["jaxpr"], token, *keys)
        outs = []
        for var, key, value in zip(eqn.invars, keys, values, strict=True):
            if isinstance(var.aval, state_types.AbstractRef):
                outs.append(value)
                continue
            token, final = callback.io_callback(
                functools.partial(gpu_callbacks.wgmma_accumulator_deref, source_info=eqn.source_info),
                (gpu_callbacks.TOKEN_SHAPE_DTYPE, jax.core.ShapedArray(value.shape, value.dtype)),
                token=token,
                mesh_location=self.mesh_location,
                thread=self.thread,
                acc_allocation_key_as_array=key,
                wait_n=None,
            )
            outs.append(final)
            token = free(self, token, key, eqn.source_info)
        return token, outs

    wgmma = interpreter._interpret_wgmma_ref_p

    def wgmma_with_register_operand(self, eqn, token, get_values):
        values = list(get_values())
        if isinstance(eqn.invars[1].aval, state_types.AbstractRef):
            return wgmma(self, eqn, token, lambda: values)
        token, values[1] = allocate(self, token, values[1], eqn.source_info)
        token, out = wgmma(self, eqn, token, lambda: values)
        return free(self, token, values[1], eqn.source_info), out

    # run_state falls through to the arithmetic case, which cannot thread the token: add a
    # case for it to the dispatch of `interpret` (its source, recompiled in its module).
    source = textwrap.dedent(inspect.getsource(interpreter.interpret))
    anchor = re.search(r"^( *)case lax\.cond_p:\n", source, re.MULTILINE)
    if anchor is None:
        raise SystemExit("jax's Mosaic GPU interpreter changed: the run_state patch no longer applies")
    indent = anchor.group(1)
    call = "token, out = self._ember_run_state(eqn, token, deferred_invals())"
    case = f"{indent}case _ember.run_state_p:\n{indent}  {call}\n"
    source = source[: anchor.start()] + case + source[anchor.start() :]
    namespace = dict(vars(jaxpr_interpret), _ember=types.SimpleNamespace(run_state_p=discharge.run_state_p))
    exec(compile(source, jaxpr_interpret.__file__, "exec"), namespace)
    interpreter.interpret = namespace["interpret"]
    interpreter._ember_run_state = run_state
    interpreter._interpret_wgmma_ref_p = wgmma_with_register_operand
    interpreter._ember_patched = True


def _inputs(key, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype):
    keys = jax.random.split(key, 4)
    q_shape, kv_shape = (batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim)
    shapes = (q_shape, kv_shape, kv_shape, q_shape)
    return tuple(jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes, strict=True))


def _hopper_op(causal: bool):
    def attend(q, k, v):
        call = attention_problem(q, k, v, causal=causal)
        return flash_attention_kernel(
            q,
            k,
            v,
            None,
            problem=call,
            block_sizes=FlashBlockSizes(64, 64),
            interpret=False,
            forward="hopper",
            backward="hopper",
        )

    return attend


def interpreted(case, seed: int = 0) -> dict:
    """One case run in the interpreter: relative errors of out, dq, dk, dv and the verdict."""
    *sizes, causal, dtype = case
    q, k, v, d_out = _inputs(jax.random.key(seed), *sizes, jnp.dtype(dtype))
    got, vjp = jax.vjp(_hopper_op(causal), q, k, v)
    got = (got, *vjp(d_out))
    upcast = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    want, vjp = jax.vjp(lambda q, k, v: flash_attention_reference(q, k, v, causal=causal), *upcast[:3])
    want = (want, *vjp(upcast[3]))
    errors = {name: relative_error(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True)}
    limit = RELATIVE_ERROR_LIMITS[dtype]
    return dict(errors=errors, limit=limit, passed=max(errors.values()) < limit)


def lowered(batch, length, heads, kv_heads, causal) -> None:
    """Lowers forward and backward for CUDA (raises on a layout, lowering or shared-memory
    error)."""
    q = jax.ShapeDtypeStruct((batch, length, heads, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, length, kv_heads, 128), jnp.bfloat16)
    attend = _hopper_op(causal)
    grad = jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    jax.jit(grad).trace(q, kv, kv).lower(lowering_platforms=("cuda",))


def interpreted_gmm(case, seed: int = 0) -> dict:
    """One ``gmm`` case run in the interpreter: its relative error against per-group matmuls
    in float32, whether the rows of no group are exactly 0, and the verdict."""
    m, k, n, sizes, offset, transpose_rhs, dtype = case
    lhs_key, rhs_key = jax.random.split(jax.random.key(seed))
    bounds = np.concatenate([[0], np.cumsum(sizes)]) + offset
    lhs = jax.random.normal(lhs_key, (m, k), jnp.float32).astype(dtype)
    if bounds[-1] < m:
        lhs = lhs.at[-1].set(jnp.nan)  # a row of no group: it must not reach any result
    rhs_shape = (len(sizes), n, k) if transpose_rhs else (len(sizes), k, n)
    rhs = jax.random.normal(rhs_key, rhs_shape, jnp.float32).astype(dtype)
    blocks = HopperGmmBlockSizes(64, 64, 2)
    got = np.asarray(hopper_gmm(lhs, rhs, jnp.asarray(bounds, jnp.int32), transpose_rhs=transpose_rhs, blocks=blocks))
    matrices = np.asarray(rhs, np.float32).swapaxes(1, 2) if transpose_rhs else np.asarray(rhs, np.float32)
    want = np.zeros((m, n), np.float32)
    for group, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        want[lo:hi] = np.asarray(lhs[lo:hi], np.float32) @ matrices[group]
    owned = (np.arange(m) >= bounds[0]) & (np.arange(m) < bounds[-1])
    error = relative_error(got[owned], want[owned])
    limit = RELATIVE_ERROR_LIMITS[dtype]
    zeros = bool(np.all(got[~owned] == 0))
    return dict(error=error, unowned_rows_zero=zeros, limit=limit, passed=error < limit and zeros)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-lowering", action="store_true")
    args = parser.parse_args(argv)
    GpuInfo.here = classmethod(lambda cls: GpuInfo((9, 0), cuda_runtime=12091))  # an H100, faked
    failed = 0
    if not args.skip_lowering:
        for case in LOWERED_CASES:
            started = time.perf_counter()
            lowered(*case)
            print(f"[lowered] batch, length, heads, kv_heads, causal = {case}: {time.perf_counter() - started:.1f} s")
        for groups, m, k, n, transpose_rhs in LOWERED_GMM_CASES:
            lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
            rhs = jax.ShapeDtypeStruct((groups, n, k) if transpose_rhs else (groups, k, n), jnp.bfloat16)
            bounds = jax.ShapeDtypeStruct((groups + 1,), jnp.int32)
            gmm = functools.partial(hopper_gmm, transpose_rhs=transpose_rhs)
            jax.jit(gmm).trace(lhs, rhs, bounds).lower(lowering_platforms=("cuda",))
            print(f"[lowered] gmm groups, rows, k, n, transpose_rhs = {(groups, m, k, n, transpose_rhs)}")
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _patch_interpreter()
    plgpu.kernel = functools.partial(plgpu.kernel, interpret=InterpretGPUParams())
    for case in INTERPRETED_CASES:
        started = time.perf_counter()
        result = interpreted(case)
        failed += not result["passed"]
        errors = ", ".join(f"{name} {error:.1e}" for name, error in result["errors"].items())
        verdict = "ok" if result["passed"] else "FAILED"
        seconds = time.perf_counter() - started
        print(f"[interpreted] {case}: {errors} (limit {result['limit']:.0e}) {verdict}, {seconds:.1f} s")
    for case in INTERPRETED_GMM_CASES:
        result = interpreted_gmm(case)
        failed += not result["passed"]
        verdict = "ok" if result["passed"] else "FAILED"
        print(
            f"[interpreted] gmm {case}: error {result['error']:.1e} (limit {result['limit']:.0e}), "
            f"rows of no group zero: {result['unowned_rows_zero']}, {verdict}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

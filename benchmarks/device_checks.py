"""Every Pallas kernel checked against its reference on the device it runs on.

    from benchmarks.device_checks import KERNEL_CHECKS, GPU_CHECK_SIZES, run_checks

    results = run_checks(GPU_CHECK_SIZES, seed=1234)   # {name: {"passed": ..., ...}}

On a GPU the kernels are compiled for real (``impl="pallas"``); on a CPU they run in the
Pallas interpreter (``impl="interpret"``) at toy sizes, so the same code is exercised by
the test suite between GPU sessions. Each check draws fresh random inputs (the seed is
recorded), runs the kernel and its values' and gradients' VJP under one random cotangent,
runs the op's ``*_reference`` (or, for ``short_conv``, which has no kernel, XLA's own
convolution) on the inputs upcast to float32 at full matmul precision, and reports the
relative error ``||got - want|| / ||want||`` of every output and gradient.

A check is isolated: one that fails to compile or disagrees records the error text and
the next one runs. Adding or removing a kernel is one line of :data:`KERNEL_CHECKS`.

:data:`HOPPER_CHECKS` check the Hopper (Mosaic GPU) forward of flash attention, with the
Triton backward and with the Hopper backward, and the Hopper grouped matmul, in bf16 and
f16. They run only where those kernels do (compiled, on an sm90 GPU:
:func:`hopper_skip_reason`); elsewhere the GPU command records them as skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ember.kernels_pallas.block_mask import ChunkedCausalMask, ExplicitBlockMask, LocalGlobalMask
from ember.kernels_pallas.flash_attention import (
    FlashBlockSizes,
    attention_problem,
    flash_attention,
    flash_attention_reference,
)
from ember.kernels_pallas.flash_attention_kernels import flash_attention_kernel
from ember.kernels_pallas.flash_attention_routing import forward_kernel
from ember.kernels_pallas.grouped_matmul import GroupedMatmulBlockSizes, grouped_matmul, grouped_matmul_reference
from ember.kernels_pallas.hopper import GpuInfo, hopper_device_reason
from ember.kernels_pallas.linear_attention import linear_attention, linear_attention_reference, state_shape
from ember.kernels_pallas.quantized_formats import QuantizedMatrix
from ember.kernels_pallas.quantized_matmul import (
    QuantizedMatmulBlockSizes,
    quantized_matmul,
    quantized_matmul_reference,
)
from ember.kernels_pallas.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from ember.kernels_pallas.short_conv import short_conv
from ember.kernels_pallas.ssd import ssd, ssd_reference

RELATIVE_ERROR_LIMITS: dict[str, float] = {
    "float32": 2e-3,  # Triton's float32 dot runs in tf32 (~3e-4 relative), plus long sums
    "bfloat16": 2e-2,  # bf16 operands and outputs: 1e-3 .. 1e-2, gradients at the top
    "float16": 1e-2,  # 3 more mantissa bits than bf16 (the Hopper checks)
}
"""Largest passing ``||got - want|| / ||want||`` per kernel input dtype (METHOD.md's scale)."""


@dataclasses.dataclass(frozen=True)
class CheckSizes:
    """Shapes of the value checks. Lengths are deliberately not block multiples."""

    impl: str  # "pallas" (compiled) or "interpret"
    dtypes: tuple[str, ...]
    batch: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    head_dim: int
    block: int  # flash attention tiles; explicit block masks use 2x this
    chunk_size: int  # linear attention / SSD
    ssd_state: int
    page_size: int


GPU_CHECK_SIZES = CheckSizes(
    impl="pallas",
    dtypes=("bfloat16", "float32"),
    batch=2,
    q_len=333,
    kv_len=461,
    heads=4,
    kv_heads=2,
    head_dim=128,
    block=64,
    chunk_size=64,
    ssd_state=64,
    page_size=16,
)
TOY_CHECK_SIZES = CheckSizes(
    impl="interpret",
    dtypes=("float32",),
    batch=1,
    q_len=21,
    kv_len=27,
    heads=2,
    kv_heads=1,
    head_dim=16,
    block=8,
    chunk_size=8,
    ssd_state=8,
    page_size=4,
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One kernel call and its reference: ``kernel(**inputs)`` against ``reference(**inputs)``
    on the floating inputs upcast to float32; with ``differentiable``, also their VJPs with
    respect to every input (pass non-differentiable ones, e.g. integer ids, by closure)."""

    kernel: Callable
    reference: Callable
    inputs: dict[str, jax.Array]
    differentiable: bool = True


@dataclasses.dataclass(frozen=True)
class KernelCheck:
    """One kernel's check: ``problem(sizes, dtype, rng)`` draws fresh inputs.
    ``limit_scale`` multiplies the dtype's limit, for a kernel whose error grows with the
    problem (its check says why)."""

    name: str
    problem: Callable[[CheckSizes, Any, np.random.Generator], Problem]
    limit_scale: float = 1.0


def relative_error(got, want) -> float:
    """``||got - want|| / ||want||`` in float64 on the host; ``inf`` if ``got`` is not finite."""
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got64.shape != want64.shape:
        raise ValueError(f"shape {got64.shape} != reference shape {want64.shape}")
    if not np.all(np.isfinite(got64)):
        return math.inf
    return float(np.linalg.norm(got64 - want64) / max(np.linalg.norm(want64), np.finfo(np.float64).tiny))


def _jit(fn, **kwargs):
    """``jax.jit``; on CPU without XLA's backend optimizations, which take seconds on the
    interpreter's large while-loop programs and buy nothing at toy sizes."""
    options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    return jax.jit(fn, compiler_options=options, **kwargs)


def _normal(gen: np.random.Generator, shape, dtype) -> jax.Array:
    return jnp.asarray(gen.standard_normal(shape, dtype=np.float32), dtype)


def _upcast(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def program(fn: Callable, differentiable: bool) -> Callable:
    """``run(inputs, cotangents) -> (outputs, input gradients or {})``: ``fn(**inputs)`` and,
    if ``differentiable``, its VJP under ``cotangents`` (shaped like the outputs, float32)."""

    def run(inputs, cotangents):
        if not differentiable:
            return fn(**inputs), {}
        outputs, vjp = jax.vjp(lambda p: fn(**p), inputs)
        return outputs, vjp(jax.tree.map(lambda c, o: c.astype(o.dtype), cotangents, outputs))[0]

    return run


def random_cotangents(problem: Problem, gen: np.random.Generator):
    """Float32 normals shaped like the kernel's outputs (``None`` if not differentiable)."""
    if not problem.differentiable:
        return None
    shapes = jax.eval_shape(lambda p: problem.kernel(**p), problem.inputs)
    return jax.tree.map(lambda s: _normal(gen, s.shape, jnp.float32), shapes)


def compare(problem: Problem, gen: np.random.Generator) -> dict[str, tuple[Any, Any]]:
    """``{name: (got, want)}`` for every output and input gradient of the kernel, against
    the reference on the inputs upcast to float32, evaluated at full matmul precision."""
    cotangents = random_cotangents(problem, gen)
    got = _jit(program(problem.kernel, problem.differentiable))(problem.inputs, cotangents)
    with jax.default_matmul_precision("highest"):
        want = _jit(program(problem.reference, problem.differentiable))(_upcast(problem.inputs), cotangents)
    return _named_pairs(got, want)


def _named_pairs(got, want) -> dict[str, tuple[Any, Any]]:
    outputs, grads = got
    ref_outputs, ref_grads = want
    pairs = {}
    for prefix, a, b in (("out", outputs, ref_outputs), ("d", grads, ref_grads)):
        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
            key = jax.tree_util.keystr(path, simple=True, separator=".")
            pairs[prefix + key if prefix == "d" or not key else f"{prefix}[{key}]"] = (x, y)
    return pairs


# ----------------------------------------------------------------------------- flash attention


def _flash(**options) -> Callable:
    """A flash-attention check with these options (``segments=True``: random documents)."""
    segments = options.pop("segments", False)
    kv_heads_override = options.pop("kv_heads", None)
    heads_override = options.pop("heads", None)
    head_dim_override = options.pop("head_dim", None)

    def problem(sizes: CheckSizes, dtype, gen):
        kv_heads = kv_heads_override or sizes.kv_heads
        heads, head_dim = heads_override or sizes.heads, head_dim_override or sizes.head_dim
        q_len, kv_len = (sizes.q_len, sizes.q_len) if segments or options.get("causal") else (sizes.q_len, sizes.kv_len)
        primals = dict(
            q=_normal(gen, (sizes.batch, q_len, heads, head_dim), dtype),
            k=_normal(gen, (sizes.batch, kv_len, kv_heads, head_dim), dtype),
            v=_normal(gen, (sizes.batch, kv_len, kv_heads, head_dim), dtype),
        )
        extra = dict(options)
        if segments:
            boundaries = np.sort(gen.integers(1, q_len, size=(sizes.batch, 3)), axis=1)
            documents = (np.arange(q_len)[None, None] >= boundaries[..., None]).sum(1)  # [batch, q_len], 0..3
            extra["segment_ids"] = jnp.asarray(documents, jnp.int32)
        if extra.pop("explicit_blocks", False):
            grid = gen.random((-(-q_len // (2 * sizes.block)), -(-kv_len // (2 * sizes.block)))) < 0.5
            grid[:, 0] = True  # every query row sees something
            extra["block_mask"] = ExplicitBlockMask.from_array(grid, 2 * sizes.block, 2 * sizes.block)
        tiles = FlashBlockSizes(sizes.block, sizes.block)

        def kernel(q, k, v):
            return flash_attention(q, k, v, impl=sizes.impl, block_sizes=tiles, **extra)

        def reference(q, k, v):
            return flash_attention_reference(q, k, v, **extra)

        return Problem(kernel, reference, primals)

    return problem


def _hopper_flash(**options) -> Callable:
    """A flash-attention check that must run the Hopper forward (the backward is Triton's):
    making the problem raises, naming the reason, where the call would take another one."""
    flash_problem = _flash(**options)

    def problem(sizes: CheckSizes, dtype, gen):
        checked = flash_problem(sizes, dtype, gen)
        q, k, v = (checked.inputs[name] for name in ("q", "k", "v"))
        call = attention_problem(q, k, v, causal=options.get("causal", False))
        interpret = sizes.impl != "pallas"
        forward_kernel(call, (q.dtype, k.dtype, v.dtype), GpuInfo.here(), interpret=interpret, forward="hopper")
        return checked

    return problem


def _hopper_backward_flash(**options) -> Callable:
    """A flash-attention check through the Hopper forward and the Hopper backward: the op's
    kernel path with ``backward="hopper"`` (the check fails naming the reason where that
    backward cannot run), against the same reference as :func:`_flash`."""
    flash_problem = _flash(**options)

    def problem(sizes: CheckSizes, dtype, gen):
        checked = flash_problem(sizes, dtype, gen)
        tiles = FlashBlockSizes(sizes.block, sizes.block)

        def kernel(q, k, v):
            call = attention_problem(q, k, v, causal=options.get("causal", False))
            interpret = sizes.impl != "pallas"
            return flash_attention_kernel(
                q, k, v, None, problem=call, block_sizes=tiles, interpret=interpret, backward="hopper"
            )

        return dataclasses.replace(checked, kernel=kernel)

    return problem


def hopper_skip_reason(sizes: CheckSizes) -> str | None:
    """Why :data:`HOPPER_CHECKS` cannot run with ``sizes`` on this machine (None: they can)."""
    if sizes.impl != "pallas":
        # jax's Mosaic GPU interpreter lacks what the kernel uses (run_state, wgmma from registers).
        return f"impl={sizes.impl!r}: the Hopper kernel runs compiled only (no Mosaic GPU interpreter path)"
    return hopper_device_reason(GpuInfo.here(), causal=False)


# ----------------------------------------------------------------------------- ragged paged attention


def _random_paged_cache(gen, sizes: CheckSizes, dtype, num_seqs: int, pages_per_seq: int):
    num_pages = num_seqs * pages_per_seq + 3
    shape = (num_pages, sizes.page_size, sizes.kv_heads, sizes.head_dim)
    table = gen.permutation(num_pages)[: num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq)
    return _normal(gen, shape, dtype), _normal(gen, shape, dtype), jnp.asarray(table, jnp.int32)


def _ragged(**options) -> Callable:
    """A ragged paged attention check over a mixed budget: a long prefill chunk, decodes,
    an empty slot and trailing padding rows."""

    def problem(sizes: CheckSizes, dtype, gen):
        pages_per_seq = -(-sizes.kv_len // sizes.page_size)
        query_lens = np.array([sizes.q_len // 2, 1, 0, 1, sizes.q_len // 3])
        kv_lens = np.array([sizes.q_len // 2 + 3, sizes.kv_len, 0, 2, sizes.kv_len])
        starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]])
        k_pages, v_pages, table = _random_paged_cache(gen, sizes, dtype, len(query_lens), pages_per_seq)
        q = _normal(gen, (int(query_lens.sum()) + 5, sizes.heads, sizes.head_dim), dtype)
        metadata = dict(
            page_table=table,
            **{
                n: jnp.asarray(a, jnp.int32)
                for n, a in (("query_starts", starts), ("query_lens", query_lens), ("kv_lens", kv_lens))
            },
        )
        block_q = 16 if sizes.impl == "pallas" else 8
        return _ragged_problem(sizes, q, k_pages, v_pages, metadata, block_q=block_q, **options)

    return problem


def _ragged_decode(sizes: CheckSizes, dtype, gen):
    """A decode step (one token for each of seven sequences, some a page boundary away from
    their last one) with ``block_q`` left to the kernel: on a GPU its 16-row decode blocks."""
    pages_per_seq = -(-sizes.kv_len // sizes.page_size)
    kv_lens = np.array(
        [1, sizes.page_size, sizes.page_size + 1, 2 * sizes.page_size, 5, sizes.kv_len, sizes.kv_len - 1]
    )
    k_pages, v_pages, table = _random_paged_cache(gen, sizes, dtype, len(kv_lens), pages_per_seq)
    metadata = dict(
        page_table=table,
        query_starts=jnp.arange(len(kv_lens), dtype=jnp.int32),
        query_lens=jnp.ones(len(kv_lens), jnp.int32),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
    )
    q = _normal(gen, (len(kv_lens), sizes.heads, sizes.head_dim), dtype)
    return _ragged_problem(sizes, q, k_pages, v_pages, metadata, block_q=None)


def _ragged_problem(sizes: CheckSizes, q, k_pages, v_pages, metadata, *, block_q, **options) -> Problem:
    def kernel(**a):
        return ragged_paged_attention(**a, **metadata, impl=sizes.impl, block_q=block_q, **options)

    def reference(**a):
        return ragged_paged_attention_reference(**a, **metadata, **options)

    return Problem(kernel, reference, dict(q=q, k_pages=k_pages, v_pages=v_pages), differentiable=False)


# ----------------------------------------------------------------------------- sequence mixers


def _linear_attention(**options) -> Callable:
    def problem(sizes: CheckSizes, dtype, gen):
        f32 = jnp.float32
        shape = (sizes.batch, sizes.q_len, sizes.kv_heads, sizes.head_dim)
        v_shape = (sizes.batch, sizes.q_len, sizes.heads, sizes.head_dim)
        primals = dict(
            q=jax.nn.softplus(_normal(gen, shape, dtype)) / sizes.head_dim,
            k=jax.nn.softplus(_normal(gen, shape, dtype)),
            v=_normal(gen, v_shape, dtype),
            log_decay=-jax.nn.softplus(_normal(gen, v_shape[:3], f32)),
            initial_state=_normal(gen, state_shape(shape, v_shape, normalize=options.get("normalize", False)), f32),
        )
        segment_ids = jnp.asarray(np.arange(sizes.q_len)[None] * 3 // sizes.q_len, jnp.int32)
        segment_ids = jnp.broadcast_to(segment_ids, (sizes.batch, sizes.q_len))

        def form(fn, **impl):
            return lambda **p: fn(**p, return_final_state=True, segment_ids=segment_ids, **options, **impl)

        kernel = form(linear_attention, impl=sizes.impl, chunk_size=sizes.chunk_size)
        return Problem(kernel, form(linear_attention_reference), primals)

    return problem


def _ssd(sizes: CheckSizes, dtype, gen):
    b, t, h, p, n = sizes.batch, sizes.q_len, sizes.heads, sizes.head_dim // 2, sizes.ssd_state
    primals = dict(
        x=_normal(gen, (b, t, h, p), dtype),
        dt=_normal(gen, (b, t, h), jnp.float32) - 2.0,
        A=-jnp.exp(_normal(gen, (h,), jnp.float32)),
        B=_normal(gen, (b, t, 1, n), dtype),
        C=_normal(gen, (b, t, 1, n), dtype),
        D=_normal(gen, (h,), jnp.float32),
        dt_bias=_normal(gen, (h,), jnp.float32) * 0.1,
        initial_state=_normal(gen, (b, h, p, n), jnp.float32),
    )

    def kernel(**args):
        return ssd(**args, return_final_state=True, chunk_size=sizes.chunk_size, impl=sizes.impl)

    return Problem(kernel, lambda **args: ssd_reference(**args, return_final_state=True), primals)


def _short_conv(sizes: CheckSizes, dtype, gen):
    """``short_conv`` (no Pallas kernel: its XLA path) against XLA's depthwise convolution."""
    width, channels = 4, sizes.heads * sizes.head_dim
    primals = dict(
        x=_normal(gen, (sizes.batch, sizes.q_len, channels), dtype),
        weight=_normal(gen, (width, channels), dtype),
        bias=_normal(gen, (channels,), dtype),
    )

    def peer(x, weight, bias):
        y = jax.lax.conv_general_dilated(
            x,
            weight[:, None, :],
            window_strides=(1,),
            padding=[(width - 1, 0)],
            dimension_numbers=("NWC", "WIO", "NWC"),
            feature_group_count=channels,
        )
        return y + bias

    return Problem(lambda **a: short_conv(**a, impl="auto"), peer, primals)


# ----------------------------------------------------------------------------- grouped matmul


def _grouped_matmul(sizes: CheckSizes, dtype, gen, gpu_kernel: str = "auto"):
    """Expert-parallel shard: ``rhs`` holds global groups 1..groups-2 of ``groups``; random
    sizes with an empty local group, one local group holding most rows, and rows past the
    groups. Rows ``q_len``, contraction ``head_dim``, output ``kv_len`` (not tile multiples).
    ``gpu_kernel="hopper"``: the Hopper gmm (forward and ``d_lhs``; raises where it cannot run)."""
    groups, m = 2 * sizes.heads + 1, sizes.q_len
    group_sizes = gen.multinomial(m - 3, np.full(groups, 1.0 / groups))
    group_sizes[2] = 0
    group_sizes[3] += group_sizes[4:-1].sum() // 2
    group_sizes[4:-1] -= group_sizes[4:-1] // 2
    primals = dict(
        lhs=_normal(gen, (m, sizes.head_dim), dtype),
        rhs=_normal(gen, (groups - 2, sizes.head_dim, sizes.kv_len), dtype),
    )
    extra = dict(group_sizes=jnp.asarray(group_sizes, jnp.int32), group_offset=jnp.int32(1))
    tiles = GroupedMatmulBlockSizes(sizes.block, sizes.block, sizes.block)

    def kernel(lhs, rhs):
        return grouped_matmul(lhs, rhs, impl=sizes.impl, block_sizes=tiles, gpu_kernel=gpu_kernel, **extra)

    return Problem(kernel, lambda lhs, rhs: grouped_matmul_reference(lhs, rhs, **extra), primals)


# ----------------------------------------------------------------------------- quantized matmul


def _quantized_matmul(fmt: str, one_row: str | None = None, default_tiles: bool = False) -> Callable:
    """``x [q_len, 4 head_dim] @ W [4 head_dim, kv_len]`` with ``W`` random codes in ``fmt``
    and random scales (groups of ``2 block`` rows for the 4-bit formats); the gradient is ``x``'s.
    With ``one_row`` (a :class:`QuantizedMatmulBlockSizes` ``one_row`` form), ``x`` is one row:
    a batch-1 decode step's product. With ``default_tiles`` the kernel picks its own tiles
    (``default_block_sizes``: a prefill's 64-row tiles at ``q_len`` rows)."""

    def problem(sizes: CheckSizes, dtype, gen):
        k, n = 4 * sizes.head_dim, sizes.kv_len
        group = k if fmt == "int8" else 2 * sizes.block
        if fmt == "int8":
            values = jnp.asarray(gen.integers(-127, 128, (k, n)), jnp.int8)
        else:
            values = jnp.asarray(gen.integers(0, 256, (k // 2, n)), jnp.uint8)
        scales = jnp.asarray(gen.uniform(0.005, 0.02, (k // group, n)), jnp.float32)
        weight = QuantizedMatrix(values, scales, fmt)
        tile = max(16, sizes.block)
        tiles = QuantizedMatmulBlockSizes(block_m=16, block_n=tile, block_k=tile, one_row=one_row or "dot")
        rows = 1 if one_row else sizes.q_len

        def kernel(x):
            return quantized_matmul(x, weight, impl=sizes.impl, block_sizes=None if default_tiles else tiles)

        return Problem(kernel, lambda x: quantized_matmul_reference(x, weight), dict(x=_normal(gen, (rows, k), dtype)))

    return problem


KERNEL_CHECKS: tuple[KernelCheck, ...] = (
    KernelCheck("flash_attention[dense,cross_lengths]", _flash()),
    KernelCheck("flash_attention[causal,mqa]", _flash(causal=True, kv_heads=1)),
    KernelCheck("flash_attention[causal,group_3,head_dim_80]", _flash(causal=True, heads=6, kv_heads=2, head_dim=80)),
    KernelCheck("flash_attention[window,soft_cap]", _flash(window=(40, 9), logits_soft_cap=5.0)),
    KernelCheck("flash_attention[local_global]", _flash(block_mask=LocalGlobalMask(24, 24, 5))),
    KernelCheck("flash_attention[chunked_causal]", _flash(block_mask=ChunkedCausalMask(50))),
    KernelCheck("flash_attention[explicit_blocks]", _flash(explicit_blocks=True)),
    KernelCheck("flash_attention[causal,segments]", _flash(causal=True, segments=True)),
    KernelCheck("flash_attention[sigmoid,causal]", _flash(score="sigmoid", causal=True)),
    KernelCheck("ragged_paged_attention[softmax]", _ragged()),
    KernelCheck(
        "ragged_paged_attention[sigmoid,window,global,soft_cap]",
        _ragged(score="sigmoid", sigmoid_bias=-3.0, window=(9, 0), global_tokens=5, logits_soft_cap=4.0),
    ),
    KernelCheck("ragged_paged_attention[decode,default_block]", _ragged_decode),
    KernelCheck("linear_attention[normalize,decay,state,segments]", _linear_attention(normalize=True)),
    # Linear attention's kernels without normalize. dA's gradient sums over every position
    # through tf32 dots: f32 errors 1.87e-3 (H200) and 2.02e-3 (H100, another seed) against
    # the 2e-3 limit, so twice it.
    KernelCheck("ssd[groups,D,dt_bias,state]", _ssd, limit_scale=2.0),
    KernelCheck("short_conv[xla_path]", _short_conv),
    KernelCheck("grouped_matmul[group_offset,empty,skewed,tail_rows]", _grouped_matmul),
    *(KernelCheck(f"quantized_matmul[{fmt}]", _quantized_matmul(fmt)) for fmt in ("int8", "int4", "nf4")),
    *(
        KernelCheck(f"quantized_matmul[{fmt},one_row_vector]", _quantized_matmul(fmt, one_row="vector"))
        for fmt in ("int8", "int4")
    ),
    *(
        KernelCheck(f"quantized_matmul[{fmt},default_tiles]", _quantized_matmul(fmt, default_tiles=True))
        for fmt in ("int8", "int4")
    ),
)
"""The kernels the GPU command checks, in order. One line per kernel (and option set)."""

HOPPER_CHECKS: tuple[KernelCheck, ...] = (
    # Lengths off the block multiples: queries padded to 128, keys masked in the last block.
    KernelCheck("flash_attention[hopper,causal,gqa]", _hopper_flash(causal=True)),
    KernelCheck("flash_attention[hopper,cross_lengths,mqa,head_dim_64]", _hopper_flash(kv_heads=1, head_dim=64)),
    # The Hopper backward, behind the Hopper forward: GQA dk/dv summed per key head in the
    # kernel, causal tiles skipped and masked, queries padded (lse +inf) and keys masked.
    KernelCheck("flash_attention[hopper_backward,causal,gqa]", _hopper_backward_flash(causal=True)),
    KernelCheck(
        "flash_attention[hopper_backward,cross_lengths,mqa,head_dim_80]",
        _hopper_backward_flash(kv_heads=1, head_dim=80),
    ),
    KernelCheck(
        "grouped_matmul[hopper,group_offset,empty,skewed,tail_rows]",
        functools.partial(_grouped_matmul, gpu_kernel="hopper"),
    ),
)
"""The Hopper kernels' checks, in :data:`HOPPER_CHECK_DTYPES`: flash attention's forward
(with the Triton backward), then with the Hopper backward; the Hopper grouped matmul."""
HOPPER_CHECK_DTYPES: tuple[str, ...] = ("bfloat16", "float16")


def run_check(check: KernelCheck, sizes: CheckSizes, dtype: str, seed: int) -> dict[str, Any]:
    """One check's record: ``passed``, the relative error of every output and gradient and
    the limit, or ``passed: False`` with the error text if it raised."""
    started = time.perf_counter()
    limit = RELATIVE_ERROR_LIMITS[dtype] * check.limit_scale
    record: dict[str, Any] = {"dtype": dtype, "impl": sizes.impl, "seed": seed, "limit": limit}
    try:
        gen = np.random.default_rng(seed)
        pairs = compare(check.problem(sizes, jnp.dtype(dtype), gen), gen)
        errors = {name: relative_error(got, want) for name, (got, want) in pairs.items()}
        record.update(
            passed=all(e <= record["limit"] for e in errors.values()),
            max_relative_error=max(errors.values()),
            relative_errors=errors,
        )
    except Exception as error:
        lines = traceback.format_exception(error)
        record.update(passed=False, error=f"{type(error).__name__}: {error}"[:2000], traceback="".join(lines)[-4000:])
    record["seconds"] = time.perf_counter() - started
    return record


def run_checks(
    sizes: CheckSizes,
    seed: int,
    only: tuple[str, ...] = (),
    deadline: float | None = None,
    on_result: Callable | None = None,
    checks: tuple[KernelCheck, ...] = KERNEL_CHECKS,
) -> dict:
    """``{"<kernel> <dtype>": record}`` for every check in ``checks`` (with ``only``, those
    whose name contains one of its strings) and dtype of ``sizes``; ``on_result(results)``
    after each. Checks due after ``deadline`` (``time.monotonic()``) are recorded as skipped
    (``passed: None``)."""
    results: dict[str, dict] = {}
    for index, check in enumerate(checks):
        if only and not any(part in check.name for part in only):
            continue
        for dtype in sizes.dtypes:
            if deadline is not None and time.monotonic() > deadline:
                results[f"{check.name} {dtype}"] = {"dtype": dtype, "passed": None, "skipped": "time budget spent"}
                continue
            record = run_check(check, sizes, dtype, seed + index)
            results[f"{check.name} {dtype}"] = record
            status = "ok  " if record["passed"] else "FAIL"
            if "max_relative_error" in record:
                detail = f"max rel err {record['max_relative_error']:.2e}"
            else:
                detail = record["error"][:200]
            print(f"[check] {status} {check.name} {dtype} ({record['seconds']:.1f} s): {detail}", flush=True)
            if on_result:
                on_result(results)
    return results

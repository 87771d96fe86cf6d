"""Attention kernels against cuDNN, XLA and JAX's own Pallas attention, side by side.

    python -m benchmarks.attention            # full sweep on a GPU or TPU, a quick XLA-path run on CPU

Sections (each row prints ours and the baselines, and the ratios):

- dense: bf16, batch 8, 16 heads, head_dim 128, q_len 1k..16k, causal and not; forward and
  forward+backward TFLOP/s of ``flash_attention`` vs :data:`BASELINES` (on a GPU: cuDNN, XLA,
  JAX's Pallas Triton ``mha`` and its Mosaic GPU Hopper attention; on a TPU: JAX's splash
  attention and XLA); each baseline's output is also compared with ours
  (``max_rel_diff``), so both sides compute the same function;
- hopper_backward: on an sm90 GPU, forward+backward with the Hopper backward vs the same
  forward with the Triton backward and vs cuDNN's forward+backward;
- block_sparse: local + global (Longformer) at 16k; ours visiting live blocks only, vs cuDNN
  (XLA on a TPU) given the same mask as an explicit boolean array, vs our dense causal kernel;
- sigmoid: ``score="sigmoid"`` vs our softmax kernel, same shapes;
- ragged_decode: ``ragged_paged_attention`` on a decode-only budget, GB/s of KV cache read
  vs the measured HBM bandwidth; one row per ``kv_splits`` (1, the GPU kernel's default,
  twice and four times that).

Before timing, every attention kernel is checked against its reference on the device
(:mod:`benchmarks.device_checks`, compiled for real instead of interpreted); a failure
stops the run. On a TPU the same sections time the TPU kernels (no TPU figure has been
measured yet). On a machine without an accelerator the script says so and times the XLA
paths at small sizes only. ``python -m benchmarks.gpu`` runs these sections too, with every other
kernel. Results: ``benchmarks/results/attention-<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_checks import GPU_CHECK_SIZES, relative_error, run_checks
from benchmarks.harness import (
    device_label,
    measured_bandwidth_gbs,
    on_gpu,
    on_tpu,
    print_table,
    time_fn,
    write_results,
)
from ember.kernels_pallas.block_mask import LocalGlobalMask, live_block_grid
from ember.kernels_pallas.flash_attention import FlashBlockSizes, attention_problem, flash_attention
from ember.kernels_pallas.flash_attention_kernels import flash_attention_kernel
from ember.kernels_pallas.flash_attention_mgpu import DEFAULT_HOPPER_BLOCKS
from ember.kernels_pallas.flash_attention_mgpu_backward import DEFAULT_HOPPER_BACKWARD_BLOCKS
from ember.kernels_pallas.flash_attention_routing import hopper_backward_reason, hopper_reason
from ember.kernels_pallas.hopper import GpuInfo
from ember.kernels_pallas.ragged_paged_attention import check_paged_cache, ragged_paged_attention
from ember.kernels_pallas.ragged_paged_attention_kernel import default_kv_splits, gpu_block_q

# Forward+backward FLOPs over forward FLOPs: backward recomputes QK^T and adds four more
# matmuls (dV, dP, dQ, dK): 2 + 5 = 7 matmuls against the forward's 2.
FWD_BWD_FLOP_RATIO = 3.5


@dataclasses.dataclass(frozen=True)
class AttentionBaseline:
    """A peer implementation of softmax attention, ``attend(q, k, v, causal)`` over
    ``[batch, seq, heads, head_dim]``. ``prescaled_q``: it applies no ``1/sqrt(head_dim)``
    itself, so it is given ``q`` already scaled; ``input_dtype``: the dtype it takes, cast to
    (both outside the timed function)."""

    name: str
    attend: Callable
    prescaled_q: bool = False
    input_dtype: str | None = None

    def inputs(self, q, q_scaled, k, v):
        args = (q_scaled if self.prescaled_q else q, k, v)
        return args if self.input_dtype is None else tuple(x.astype(self.input_dtype) for x in args)


def _jax_nn(implementation):
    def attend(q, k, v, causal):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)

    return attend


def _pallas_triton(q, k, v, causal):
    """JAX's Pallas flash attention for GPUs (Triton lowering), its default tiles."""
    from jax.experimental.pallas.ops.gpu.attention import mha

    return mha(q, k, v, None, sm_scale=1.0 / math.sqrt(q.shape[-1]), causal=causal)


def _pallas_mosaic(q, k, v, causal):
    """JAX's Pallas flash attention for Hopper (Mosaic GPU: wgmma, TMA); unscaled logits.
    Tiles of its own benchmark (``attention_mgpu.main``); no causal backward there yet.
    float16 only (jax 0.11.2 rejected bf16 on an H200: "src had type bfloat16 and dst had
    type float16"); the tensor cores run f16 at bf16's rate."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = attention_mgpu.TuningConfig(
        block_q=64,
        block_kv=128,
        max_concurrent_steps=2,
        causal=causal,
        block_q_dkv=64,
        block_kv_dkv=64,
        block_q_dq=64,
        block_kv_dq=64,
    )
    return attention_mgpu.attention(q, k, v, config)


def _splash(q, k, v, causal, interpret=False):
    """JAX's splash attention for TPUs (Mosaic TPU), its default blocks; MHA over each batch
    row's ``[heads, seq, head_dim]``; unscaled logits. ``interpret``: run it in the Pallas
    interpreter (how it is checked without a TPU)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    shape, heads = (q.shape[1], k.shape[1]), q.shape[2]
    head_mask = masks.CausalMask(shape) if causal else masks.FullMask(shape)
    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([head_mask] * heads), head_shards=1, q_seq_shards=1, interpret=interpret
    )
    out = jax.vmap(kernel)(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)))
    return jnp.swapaxes(out, 1, 2)


BASELINES: dict[str, AttentionBaseline] = {
    "cudnn": AttentionBaseline("cudnn", _jax_nn("cudnn")),
    "xla": AttentionBaseline("xla", _jax_nn("xla")),
    "pallas_triton": AttentionBaseline("pallas_triton", _pallas_triton),
    "pallas_mosaic": AttentionBaseline("pallas_mosaic", _pallas_mosaic, prescaled_q=True, input_dtype="float16"),
    "splash": AttentionBaseline("splash", _splash, prescaled_q=True),
}


def _attention_flops(batch, heads, q_len, kv_len, head_dim, pair_fraction):
    """Forward FLOPs of the two matmuls over the visible fraction of score pairs."""
    return 4.0 * batch * heads * q_len * kv_len * head_dim * pair_fraction


def _qkv(shape_q, shape_kv, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], shape_q, dtype),
        jax.random.normal(keys[1], shape_kv, dtype),
        jax.random.normal(keys[2], shape_kv, dtype),
    )


def _fwd_and_fwd_bwd(attend: Callable):
    fwd = jax.jit(attend)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
    return fwd, grad


def _error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def _time_or_error(fn, *args, repeats=10):
    """Seconds per call, or the error text (e.g. a baseline that does not support a case)."""
    try:
        return time_fn(fn, *args, warmup=2, repeats=repeats)
    except Exception as error:
        return _error_text(error)


def _tflops(flops, seconds):
    return flops / seconds / 1e12 if isinstance(seconds, float) else None


def _ratio(ours, theirs):
    return theirs / ours if isinstance(ours, float) and isinstance(theirs, float) else None


def _ms(seconds):
    return seconds * 1e3 if isinstance(seconds, float) else seconds


def _diff_or_error(fn, args, want):
    """``||fn(*args) - want|| / ||want||``, or the error text."""
    try:
        return relative_error(fn(*args), want)
    except Exception as error:
        return _error_text(error)


def dense_rows(impl, baselines, q_lens, batch, heads, head_dim, dtype, causal_values=(False, True), repeats=10):
    rows = []
    for q_len in q_lens:
        q, k, v = _qkv((batch, q_len, heads, head_dim), (batch, q_len, heads, head_dim), dtype)
        q_scaled = (q.astype(jnp.float32) / math.sqrt(head_dim)).astype(dtype)
        for causal in causal_values:
            flops = _attention_flops(batch, heads, q_len, q_len, head_dim, 0.5 if causal else 1.0)
            row = dict(section="dense", q_len=q_len, batch=batch, causal=causal)
            fwd, fwd_bwd = _fwd_and_fwd_bwd(lambda q, k, v, c=causal: flash_attention(q, k, v, causal=c, impl=impl))
            ours = tuple(_time_or_error(fn, q, k, v, repeats=repeats) for fn in (fwd, fwd_bwd))
            row.update(
                ours_fwd_tflops=_tflops(flops, ours[0]),
                ours_fwd_bwd_tflops=_tflops(FWD_BWD_FLOP_RATIO * flops, ours[1]),
            )
            ours_out = np.asarray(fwd(q, k, v).astype(jnp.float32)) if isinstance(ours[0], float) else None
            for name in baselines:
                baseline = BASELINES[name]
                fwd, fwd_bwd = _fwd_and_fwd_bwd(lambda q, k, v, c=causal, b=baseline: b.attend(q, k, v, c))
                args = baseline.inputs(q, q_scaled, k, v)
                theirs = tuple(_time_or_error(fn, *args, repeats=repeats) for fn in (fwd, fwd_bwd))
                row[f"{name}_fwd_tflops"] = _tflops(flops, theirs[0])
                row[f"{name}_fwd_bwd_tflops"] = _tflops(FWD_BWD_FLOP_RATIO * flops, theirs[1])
                row[f"fwd_speedup_vs_{name}"] = _ratio(ours[0], theirs[0])
                row[f"fwd_bwd_speedup_vs_{name}"] = _ratio(ours[1], theirs[1])
                if ours_out is not None and isinstance(theirs[0], float):
                    row[f"{name}_rel_diff"] = _diff_or_error(fwd, args, ours_out)
                for part, value in (("fwd", theirs[0]), ("fwd_bwd", theirs[1])):
                    if isinstance(value, str):
                        row[f"{name}_{part}_error"] = value
            for part, value in (("fwd", ours[0]), ("fwd_bwd", ours[1])):
                if isinstance(value, str):
                    row[f"ours_{part}_error"] = value
            rows.append(row)
    return rows


def tile_rows(impl, tiles, q_len, batch, heads, head_dim, dtype, causal=True, repeats=10):
    """Our flash attention forward and forward+backward at one size under each of ``tiles``
    (:class:`FlashBlockSizes`: blocks, warps, pipeline stages), for choosing the defaults."""
    q, k, v = _qkv((batch, q_len, heads, head_dim), (batch, q_len, heads, head_dim), dtype)
    flops = _attention_flops(batch, heads, q_len, q_len, head_dim, 0.5 if causal else 1.0)
    rows = []
    for tile in tiles:
        fwd, fwd_bwd = _fwd_and_fwd_bwd(
            lambda q, k, v, t=tile: flash_attention(q, k, v, causal=causal, block_sizes=t, impl=impl)
        )
        seconds = tuple(_time_or_error(fn, q, k, v, repeats=repeats) for fn in (fwd, fwd_bwd))
        row = dict(section="flash_tiles", q_len=q_len, batch=batch, causal=causal, **dataclasses.asdict(tile))
        row.update(
            fwd_tflops=_tflops(flops, seconds[0]), fwd_bwd_tflops=_tflops(FWD_BWD_FLOP_RATIO * flops, seconds[1])
        )
        for part, value in zip(("fwd", "fwd_bwd"), seconds, strict=True):
            if isinstance(value, str):
                row[f"{part}_error"] = value
        rows.append(row)
    return rows


def _our_flash(forward: str, backward: str = "triton") -> Callable:
    """Our flash attention with its forward and backward kernels chosen, each ``"hopper"``
    or ``"triton"``: the op's kernel path below its dispatcher, the A/B."""

    def attend(q, k, v, causal):
        problem = attention_problem(q, k, v, causal=causal)
        tiles = FlashBlockSizes().fitted(problem.q_len, problem.kv_len)
        return flash_attention_kernel(
            q, k, v, None, problem=problem, block_sizes=tiles, interpret=False, forward=forward, backward=backward
        )

    return attend


def _hopper_not_run(impl, q, causal: bool, backward: bool = False) -> str | None:
    """Why the Hopper forward (with ``backward``: the Hopper backward) cannot run ``q``'s
    self-attention here (None: it can)."""
    if impl != "pallas":
        return f"impl={impl!r}: the Hopper kernels run compiled on an sm90 GPU only"
    problem = attention_problem(q, q, q, causal=causal)
    reason, blocks = (
        (hopper_backward_reason, DEFAULT_HOPPER_BACKWARD_BLOCKS) if backward else (hopper_reason, DEFAULT_HOPPER_BLOCKS)
    )
    return reason(problem, (q.dtype,) * 3, GpuInfo.here(), interpret=False, blocks=blocks)


def _timed_forms(forms: dict, causal: bool, flops: float, repeats: int) -> tuple[dict, dict]:
    """``forms``: ``{name: (attend(q, k, v, causal), args, with_backward)}``. Returns the
    row's columns (ms, TFLOP/s, relative difference from the first form that ran, error
    text) and each form's forward seconds (or its error text)."""
    columns, seconds, first = {}, {}, None
    for name, (attend, args, with_backward) in forms.items():
        fwd, fwd_bwd = _fwd_and_fwd_bwd(lambda q, k, v, a=attend: a(q, k, v, causal))
        seconds[name] = _time_or_error(fwd, *args, repeats=repeats)
        columns[f"{name}_fwd_ms"] = _ms(seconds[name])
        columns[f"{name}_fwd_tflops"] = _tflops(flops, seconds[name])
        if with_backward:
            both = _time_or_error(fwd_bwd, *args, repeats=repeats)
            columns[f"{name}_fwd_bwd_ms"] = _ms(both)
            columns[f"{name}_fwd_bwd_tflops"] = _tflops(FWD_BWD_FLOP_RATIO * flops, both)
        if isinstance(seconds[name], str):
            columns[f"{name}_fwd_error"] = seconds[name]
        elif first is None:
            first = (name, np.asarray(fwd(*args).astype(jnp.float32)))
        else:
            columns[f"{name}_rel_diff_vs_{first[0]}"] = _diff_or_error(fwd, args, first[1])
    return columns, seconds


def hopper_forward_rows(impl, baselines, q_len, batch, heads, head_dim, dtype, repeats=10):
    """Causal and not: our forward through the Hopper kernel and through Triton (forward
    and forward+backward; the backward is Triton's in both), and the forward of each of
    ``baselines`` (e.g. cuDNN, JAX's attention_mgpu). Where the Hopper kernel cannot run,
    ``hopper_not_run`` says why and the rest are timed (with ``impl`` other than
    ``"pallas"``, our flash attention under that ``impl``)."""
    shape = (batch, q_len, heads, head_dim)
    q, k, v = _qkv(shape, shape, dtype)
    q_scaled = (q.astype(jnp.float32) / head_dim**0.5).astype(dtype)
    if impl == "pallas":
        ours = {"hopper": _our_flash("hopper"), "triton": _our_flash("triton")}
    else:
        ours = {f"ours_{impl}": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal, impl=impl)}
    rows = []
    for causal in (True, False):
        row = dict(section="hopper_forward", q_len=q_len, batch=batch, causal=causal)
        reason = _hopper_not_run(impl, q, causal)
        if reason is not None:
            row["hopper_not_run"] = reason
        forms = {name: (attend, (q, k, v), True) for name, attend in ours.items() if name != "hopper" or not reason}
        for name in baselines:
            baseline = BASELINES[name]
            forms[name] = (baseline.attend, baseline.inputs(q, q_scaled, k, v), False)
        flops = _attention_flops(batch, heads, q_len, q_len, head_dim, 0.5 if causal else 1)
        columns, seconds = _timed_forms(forms, causal, flops, repeats)
        row.update(columns)
        if "hopper" in seconds:
            for name in (name for name in forms if name != "hopper"):
                row[f"hopper_fwd_speedup_vs_{name}"] = _ratio(seconds["hopper"], seconds[name])
            row["hopper_fwd_bwd_speedup_vs_triton"] = _ratio(
                columns.get("hopper_fwd_bwd_ms"), columns.get("triton_fwd_bwd_ms")
            )
        rows.append(row)
    return rows


def hopper_backward_rows(impl, baselines, q_len, batch, heads, head_dim, dtype, repeats=10):
    """Causal and not: forward+backward through the Hopper forward with the Hopper backward
    (``hopper_bwd``) and with the Triton backward (``triton_bwd``, what ``impl="auto"``
    runs today), and each of ``baselines``' forward+backward (e.g. cuDNN). The gradients of
    the two backwards are compared (``grad_rel_diff``). Where the Hopper backward cannot
    run, ``hopper_backward_not_run`` says why and nothing is timed."""
    shape = (batch, q_len, heads, head_dim)
    q, k, v = _qkv(shape, shape, dtype)
    q_scaled = (q.astype(jnp.float32) / head_dim**0.5).astype(dtype)
    rows = []
    for causal in (True, False):
        row = dict(section="hopper_backward", q_len=q_len, batch=batch, causal=causal)
        reason = _hopper_not_run(impl, q, causal, backward=True)
        if reason is not None:
            rows.append(dict(row, hopper_backward_not_run=reason))
            continue
        forms = {f"{kernel}_bwd": (_our_flash("hopper", kernel), (q, k, v)) for kernel in ("hopper", "triton")}
        forms.update({name: (BASELINES[name].attend, BASELINES[name].inputs(q, q_scaled, k, v)) for name in baselines})
        flops = FWD_BWD_FLOP_RATIO * _attention_flops(batch, heads, q_len, q_len, head_dim, 0.5 if causal else 1)
        seconds, grads = {}, {}
        for name, (attend, args) in forms.items():
            grads[name] = _fwd_and_fwd_bwd(lambda q, k, v, a=attend, c=causal: a(q, k, v, c))[1]
            seconds[name] = _time_or_error(grads[name], *args, repeats=repeats)
            row[f"{name}_fwd_bwd_ms"] = _ms(seconds[name])
            row[f"{name}_fwd_bwd_tflops"] = _tflops(flops, seconds[name])
            if isinstance(seconds[name], str):
                row[f"{name}_fwd_bwd_error"] = seconds[name]
        for name in forms:
            if name != "hopper_bwd":
                row[f"hopper_bwd_fwd_bwd_speedup_vs_{name}"] = _ratio(seconds["hopper_bwd"], seconds[name])
        if all(isinstance(seconds[name], float) for name in ("hopper_bwd", "triton_bwd")):
            pairs = zip(grads["hopper_bwd"](q, k, v), grads["triton_bwd"](q, k, v), strict=True)
            row["grad_rel_diff"] = max(relative_error(got, want) for got, want in pairs)
        rows.append(row)
    return rows


def block_sparse_rows(impl, baseline, batch, q_len, heads, head_dim, dtype, mask, repeats=10):
    q, k, v = _qkv((batch, q_len, heads, head_dim), (batch, q_len, heads, head_dim), dtype)
    block = FlashBlockSizes()
    live = live_block_grid(mask, q_len, q_len, block.block_q, block.block_kv)
    dense_mask = jnp.asarray(mask.dense(q_len, q_len))[None, None]
    pair_fraction = float(mask.dense(q_len, q_len).mean())
    flops = _attention_flops(batch, heads, q_len, q_len, head_dim, pair_fraction)
    forms = {
        "ours": lambda q, k, v: flash_attention(q, k, v, block_mask=mask, impl=impl),
        "ours_dense_causal": lambda q, k, v: flash_attention(q, k, v, causal=True, impl=impl),
        f"{baseline}_masked": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=dense_mask, implementation=None if baseline == "default" else baseline
        ),
    }
    times = {}
    for name, attend in forms.items():
        fwd, fwd_bwd = _fwd_and_fwd_bwd(attend)
        times[name] = tuple(_time_or_error(fn, q, k, v, repeats=repeats) for fn in (fwd, fwd_bwd))
    row = dict(
        section="block_sparse",
        q_len=q_len,
        batch=batch,
        mask=repr(mask),
        live_blocks=int(live.sum()),
        total_blocks=int(live.size),
        live_fraction=float(live.mean()),
        ours_fwd_tflops=_tflops(flops, times["ours"][0]),
    )
    for name, (fwd_s, fwd_bwd_s) in times.items():
        row[f"{name}_fwd_ms"], row[f"{name}_fwd_bwd_ms"] = _ms(fwd_s), _ms(fwd_bwd_s)
    for part, index in (("fwd", 0), ("fwd_bwd", 1)):
        theirs = times[f"{baseline}_masked"][index]
        row[f"{part}_speedup_vs_{baseline}_with_mask"] = _ratio(times["ours"][index], theirs)
        row[f"{part}_speedup_vs_our_dense_causal"] = _ratio(times["ours"][index], times["ours_dense_causal"][index])
    return [row]


def sigmoid_rows(impl, q_len, batch, heads, head_dim, dtype, causal_values=(False, True), repeats=10):
    q, k, v = _qkv((batch, q_len, heads, head_dim), (batch, q_len, heads, head_dim), dtype)
    rows = []
    for causal in causal_values:
        times = {}
        for score in ("softmax", "sigmoid"):
            fwd, fwd_bwd = _fwd_and_fwd_bwd(
                lambda q, k, v, s=score, c=causal: flash_attention(q, k, v, score=s, causal=c, impl=impl)
            )
            times[score] = tuple(_time_or_error(fn, q, k, v, repeats=repeats) for fn in (fwd, fwd_bwd))
        rows.append(
            dict(
                section="sigmoid",
                q_len=q_len,
                batch=batch,
                causal=causal,
                softmax_fwd_ms=_ms(times["softmax"][0]),
                sigmoid_fwd_ms=_ms(times["sigmoid"][0]),
                softmax_fwd_bwd_ms=_ms(times["softmax"][1]),
                sigmoid_fwd_bwd_ms=_ms(times["sigmoid"][1]),
                fwd_speedup_sigmoid_vs_softmax=_ratio(times["sigmoid"][0], times["softmax"][0]),
                fwd_bwd_speedup_sigmoid_vs_softmax=_ratio(times["sigmoid"][1], times["softmax"][1]),
            )
        )
    return rows


def ragged_decode_rows(impl, num_seqs, heads, kv_heads, head_dim, page_size, length, dtype, bandwidth_gbs, repeats=10):
    """One decode token per sequence, every sequence ``length`` tokens long: GB/s of KV
    cache read (each cached key and value once) against the measured bandwidth. One row per
    ``kv_splits``: 1 (no split), the GPU kernel's default (``kv_splits=None``, the row with
    ``kv_splits_default``), twice and four times that; the XLA path ignores it."""
    pages_per_seq = length // page_size
    num_pages = num_seqs * pages_per_seq
    keys = jax.random.split(jax.random.key(4), 4)
    k_pages = jax.random.normal(keys[0], (num_pages, page_size, kv_heads, head_dim), dtype)
    v_pages = jax.random.normal(keys[1], (num_pages, page_size, kv_heads, head_dim), dtype)
    table = jax.random.permutation(keys[2], num_pages).reshape(num_seqs, pages_per_seq).astype(jnp.int32)
    q = jax.random.normal(keys[3], (num_seqs, heads, head_dim), dtype)
    starts, query_lens = jnp.arange(num_seqs, dtype=jnp.int32), jnp.ones((num_seqs,), jnp.int32)
    kv_lens = jnp.full((num_seqs,), length, jnp.int32)
    cache_bytes = 2 * num_seqs * length * kv_heads * head_dim * jnp.dtype(dtype).itemsize
    # The kernel's own choice for this step, block_q and pages_per_block left to it too.
    cache = check_paged_cache(k_pages, v_pages, table, num_seqs=num_seqs, heads=heads, head_dim=head_dim)
    block_q = gpu_block_q(num_seqs, num_seqs, heads, kv_heads)
    default = default_kv_splits(num_seqs, num_seqs, heads, block_q, None, cache)
    rows = []
    for kv_splits in dict.fromkeys((1, default, 2 * default, 4 * default)):
        chosen = None if kv_splits == default else kv_splits
        step = jax.jit(lambda *a, chosen=chosen: ragged_paged_attention(*a, kv_splits=chosen, impl=impl))
        seconds = _time_or_error(step, q, k_pages, v_pages, table, starts, query_lens, kv_lens, repeats=repeats)
        gbs = cache_bytes / seconds / 1e9 if isinstance(seconds, float) else None
        rows.append(
            dict(
                section="ragged_decode",
                num_seqs=num_seqs,
                length=length,
                page_size=page_size,
                heads=heads,
                kv_heads=kv_heads,
                kv_splits=kv_splits,
                kv_splits_default=kv_splits == default,
                cache_gb=cache_bytes / 1e9,
                ours_ms=_ms(seconds),
                ours_gbs=gbs,
                measured_bandwidth_gbs=bandwidth_gbs,
                fraction_of_bandwidth=gbs / bandwidth_gbs if gbs else None,
            )
        )
    return rows


def print_sections(rows, title: str) -> None:
    """One table per ``section`` of ``rows`` (error columns left out)."""
    for section in dict.fromkeys(r["section"] for r in rows):
        section_rows = [r for r in rows if r["section"] == section]
        columns = list(dict.fromkeys(c for r in section_rows for c in r if c != "section" and not c.endswith("_error")))
        print(f"\n== {section} ({title}) ==")
        print_table(section_rows, columns)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes even on a GPU or TPU")
    args = parser.parse_args(argv)
    gpu, tpu = on_gpu(), on_tpu()
    accelerator = gpu or tpu
    masked_baseline = "cudnn" if gpu else "xla"  # jax.nn.dot_product_attention given the dense mask
    if accelerator and not args.quick:
        impl, dtype = "pallas", jnp.bfloat16
        baselines = ("cudnn", "pallas_triton", "pallas_mosaic", "xla") if gpu else ("splash", "xla")
        sizes = dict(q_lens=(1024, 2048, 4096, 8192, 16384), batch=8, heads=16, head_dim=128)
        sparse_len, decode = 16384, dict(num_seqs=64, heads=32, kv_heads=8, head_dim=128, page_size=16, length=4096)
        bandwidth_bytes = 4 << 30
    else:
        if not accelerator:
            print(f"No GPU or TPU found (device: {device_label()}): timing the XLA paths at small sizes only.")
        impl, baselines = ("pallas" if accelerator else "xla"), ("xla",)
        dtype = jnp.bfloat16 if accelerator else jnp.float32
        sizes = dict(q_lens=(256, 512), batch=2, heads=4, head_dim=64)
        sparse_len, decode = 1024, dict(num_seqs=4, heads=8, kv_heads=2, head_dim=64, page_size=16, length=512)
        bandwidth_bytes = 256 << 20
    checks = (
        run_checks(GPU_CHECK_SIZES, seed=0, only=("flash_attention", "ragged_paged_attention")) if accelerator else {}
    )
    failed = [name for name, record in checks.items() if not record["passed"]]
    if failed:
        raise SystemExit(f"kernels disagree with their references on {device_label()}: {failed}")
    bandwidth = measured_bandwidth_gbs(bandwidth_bytes)
    sparse_mask = LocalGlobalMask(256, 256, 64) if accelerator and not args.quick else LocalGlobalMask(64, 64, 16)
    rows = []
    rows += dense_rows(impl, baselines, dtype=dtype, **sizes)
    rows += block_sparse_rows(
        impl, masked_baseline, 1, sparse_len, sizes["heads"], sizes["head_dim"], dtype, sparse_mask
    )
    rows += sigmoid_rows(impl, sizes["q_lens"][-1], sizes["batch"], sizes["heads"], sizes["head_dim"], dtype)
    rows += ragged_decode_rows(impl, dtype=dtype, bandwidth_gbs=bandwidth, **decode)
    print_sections(rows, f"{impl}, {jnp.dtype(dtype).name}")
    path = write_results(
        "attention",
        dict(
            impl=impl,
            dtype=jnp.dtype(dtype).name,
            gpu=gpu,
            tpu=tpu,
            device_value_checks=checks,
            measured_bandwidth_gbs=bandwidth,
            rows=rows,
            note=None
            if accelerator
            else "no GPU or TPU found: XLA paths at small sizes; the test suite checks kernels in interpret mode",
        ),
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

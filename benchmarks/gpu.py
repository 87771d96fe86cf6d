"""The GPU session's one command: check every Pallas kernel on the device, then time the
issue's performance rows, writing ``gpu-<device>.json`` after every step.

    python -m benchmarks.gpu                        # on a GPU: real compiles, H100 sizes
    python -m benchmarks.gpu --toy                  # anywhere: toy sizes; kernels interpreted
    python -m benchmarks.gpu --results-dir $OUT     # where the JSON goes (default benchmarks/results)

1. ``device_value_checks``: every kernel of :data:`benchmarks.device_checks.KERNEL_CHECKS`
   (flash attention forward + backward with every mask kind, paged and ragged paged
   attention, linear attention, SSD, short conv, grouped matmul, quantized matmul in int8,
   int4 and NF4) against its reference on
   the device, in bf16 and f32, errors recorded per kernel; a kernel that breaks does not
   stop the run. Then ``hopper_value_checks``: the Hopper (Mosaic GPU) forward of flash
   attention with the Triton backward, and with the Hopper backward
   (:data:`benchmarks.device_checks.HOPPER_CHECKS`, bf16 and f16), recorded as skipped with
   the reason where those kernels cannot run (not an sm90 GPU, or the toy run's
   interpreted kernels).
2. ``rows``: the performance rows of :data:`MEASUREMENTS`, most important first, each
   reusing :mod:`benchmarks.attention`, :mod:`benchmarks.sequence_mixers`,
   :mod:`benchmarks.moe` and :mod:`benchmarks.train_step`: the measured ceilings (HBM
   bandwidth, bf16 matmul rate);
   flash attention forward and forward+backward vs cuDNN and JAX's Pallas attention
   (Triton and Mosaic GPU), batch 8, 16 heads, head_dim 128, 1k-16k, causal and not;
   the Hopper forward against our Triton forward (an A/B of the same call), cuDNN and
   JAX's attention_mgpu at 8k; forward+backward with the Hopper backward against the Triton
   backward and cuDNN at 8k;
   block-sparse local + global vs cuDNN given the mask; sigmoid vs softmax scores; linear
   attention and SSD vs our flash attention and their naive scans at 16k; the grouped
   matmul vs ``ragged_dot``, a per-expert loop and the equal-FLOP dense matmul; ragged paged
   decode vs the measured bandwidth (a row per ``kv_splits``, the goal the default's); a
   decode step with int8 / int4 / NF4 weights vs bf16 (:mod:`benchmarks.quantization`, batch
   1-64), and at batch 1 with the layers scanned and unrolled; the quantized matmul vs the
   bf16 one on weights streamed from HBM, with its XLA path and
   :attr:`PerfSizes.quantized_tiles` beside the default tiles;
   the ~350M preset's train step MFU in bf16.
3. ``goals``: the issue's targets as measured ratios, each with its threshold.

A time budget (``--budget-s``, default 500 s on a GPU) keeps the whole run inside one
600 s device call: a measurement that would start with less than its reserve left is
recorded as skipped. Results are rewritten after every check and row, so a run killed at
its limit still leaves everything it measured.

On the device machine (see benchmarks/README.md for the exact ``run`` call): the image has
JAX but not omegaconf, which ember's config loader imports; ``make gpu-wheels`` downloads
it here into ``.whl/`` (ignored by git) to be carried along.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from omegaconf import OmegaConf

from benchmarks import attention, moe, quantization, sequence_mixers, train_step
from benchmarks.device_checks import (
    GPU_CHECK_SIZES,
    HOPPER_CHECK_DTYPES,
    HOPPER_CHECKS,
    KERNEL_CHECKS,
    TOY_CHECK_SIZES,
    CheckSizes,
    hopper_skip_reason,
    run_checks,
)
from benchmarks.harness import (
    device_label,
    measured_bandwidth_gbs,
    measured_matmul_tflops,
    on_gpu,
    print_table,
    write_results,
)
from ember.core.config import load_config
from ember.kernels_pallas.block_mask import LocalGlobalMask
from ember.kernels_pallas.flash_attention import FlashBlockSizes
from ember.kernels_pallas.grouped_matmul import GroupedMatmulBlockSizes
from ember.kernels_pallas.quantized_matmul import QuantizedMatmulBlockSizes
from ember.models.config import ModelConfig

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "models"


@dataclasses.dataclass(frozen=True)
class PerfSizes:
    """Sizes of the performance rows (``impl`` of our kernels: "pallas" on a GPU; on CPU
    "xla", since the Pallas interpreter is far too slow to time)."""

    impl: str
    dtype: str
    batch: int
    heads: int
    head_dim: int
    goal_len: int  # the flash-vs-cuDNN goal's length (8k)
    long_len: int  # block-sparse, linear attention and SSD goals (16k)
    sweep_lens: tuple[int, ...]  # the rest of the dense sweep, at most 4 (one measurement each)
    causal_values: tuple[bool, ...]
    baselines: tuple[str, ...]
    hopper_baselines: tuple[str, ...]  # peers of the Hopper forward's A/B at goal_len
    tiles: tuple[FlashBlockSizes, ...]  # flash attention tiles timed at goal_len, causal
    sparse_mask: LocalGlobalMask  # ~10% live blocks at long_len
    mixers: sequence_mixers.Sizes
    moe: moe.Sizes
    decode: dict[str, int]
    quantized_decode: tuple[ModelConfig, int, tuple[int, ...]]  # model, context, batches
    quantized_layouts: tuple[str, ...]  # formats timed with scanned and unrolled layers
    quantized_matmul: tuple[int, tuple[int, ...], int]  # k = n, batches, weight copies per call
    quantized_tiles: tuple[QuantizedMatmulBlockSizes, ...]  # timed beside the default tiles
    train: tuple[str, int, int]  # preset, batch, seq_len
    train_overrides: dict[str, Any]
    bandwidth_bytes: int
    matmul_size: int
    repeats: int


GPU_SIZES = PerfSizes(
    impl="pallas",
    dtype="bfloat16",
    batch=8,
    heads=16,
    head_dim=128,
    goal_len=8192,
    long_len=16384,
    sweep_lens=(16384, 4096, 2048, 1024),
    causal_values=(True, False),
    baselines=("cudnn", "pallas_triton", "pallas_mosaic"),
    hopper_baselines=("cudnn", "pallas_mosaic"),
    tiles=(
        FlashBlockSizes(128, 64, num_warps=4, num_stages=3),
        FlashBlockSizes(128, 64, num_warps=8, num_stages=3),
        FlashBlockSizes(128, 64, num_warps=8, num_stages=2),
        FlashBlockSizes(64, 64, num_warps=4, num_stages=3),
        FlashBlockSizes(64, 128, num_warps=4, num_stages=2),
        FlashBlockSizes(128, 32, num_warps=4, num_stages=4),
    ),
    # 16k / 128-blocks: a 640-token window each side is ~11 live blocks of 128 per row, plus
    # one global block row and column: ~10% live.
    sparse_mask=LocalGlobalMask(640, 640, 128),
    mixers=dataclasses.replace(
        sequence_mixers.GPU_SIZES, seq_lens=(16384,), scan_max_seq=16384, quadratic_max_seq=0, repeats=5
    ),
    moe=moe.GPU_SIZES,
    decode=dict(num_seqs=64, heads=32, kv_heads=8, head_dim=128, page_size=16, length=4096),
    quantized_decode=(quantization.GPU_DECODE_MODEL, 256, (1, 8, 16, 64)),
    quantized_layouts=("int8", "int4"),
    # 16 copies of a 4096 x 4096 weight: 134 MB in int4, past the 50 MB L2 cache. 4096 rows:
    # a prefill- or QLoRA-training-shaped product (64-row tiles), bound by the dot, not HBM.
    quantized_matmul=(4096, (1, 16, 64, 4096), 16),
    quantized_tiles=(
        QuantizedMatmulBlockSizes(block_n=64),
        QuantizedMatmulBlockSizes(block_n=256, num_warps=8),
        QuantizedMatmulBlockSizes(block_k=256, num_stages=4),
        QuantizedMatmulBlockSizes(num_warps=8),
        QuantizedMatmulBlockSizes(k_splits=1),
        QuantizedMatmulBlockSizes(one_row="vector"),
        QuantizedMatmulBlockSizes(block_n=64, block_k=256, one_row="vector"),
    ),
    train=("350m", 16, 2048),
    train_overrides=dict(precision="bf16", remat="none"),
    bandwidth_bytes=4 << 30,
    matmul_size=8192,
    repeats=10,
)
TOY_SIZES = PerfSizes(
    impl="xla",
    dtype="float32",
    batch=1,
    heads=2,
    head_dim=16,
    goal_len=64,
    long_len=128,
    sweep_lens=(),
    causal_values=(True,),
    baselines=("xla",),
    hopper_baselines=("xla",),
    tiles=(FlashBlockSizes(16, 16), FlashBlockSizes(32, 16, num_warps=4, num_stages=3)),
    sparse_mask=LocalGlobalMask(8, 8, 4),
    mixers=dataclasses.replace(
        sequence_mixers.CPU_SIZES, seq_lens=(128,), scan_max_seq=128, quadratic_max_seq=0, repeats=1
    ),
    moe=moe.Sizes(
        problems=(moe.Problem(4, 64, 16, 32),),
        loads=("skewed",),
        dtype="float32",
        impl="xla",
        repeats=1,
        tiles=(GroupedMatmulBlockSizes(16, 16, 16),),
    ),
    decode=dict(num_seqs=2, heads=2, kv_heads=1, head_dim=16, page_size=8, length=64),
    quantized_decode=(
        ModelConfig(vocab_size=64, d_model=64, num_layers=1, num_heads=2, mlp_dim=128, max_seq_len=32),
        16,
        (1,),
    ),
    quantized_layouts=("int8",),
    quantized_matmul=(128, (1,), 2),
    quantized_tiles=(QuantizedMatmulBlockSizes(block_n=32, one_row="vector"),),
    train=("tiny", 8, 32),
    train_overrides=dict(max_seq_len=32),
    bandwidth_bytes=1 << 20,
    matmul_size=64,
    repeats=1,
)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One step of the sweep: ``run(sizes, context) -> rows``; started only with at least
    ``reserve_s`` of the budget left (a rough cost on an H100, compiles included)."""

    name: str
    run: Callable[[PerfSizes, dict], list[dict]]
    reserve_s: float


def _ceilings(sizes: PerfSizes, context: dict) -> list[dict]:
    context["bandwidth_gbs"] = measured_bandwidth_gbs(sizes.bandwidth_bytes)
    matmul = measured_matmul_tflops(sizes.matmul_size, jnp.dtype(sizes.dtype))
    return [
        dict(
            section="ceilings",
            measured_bandwidth_gbs=context["bandwidth_gbs"],
            matmul_tflops=matmul,
            matmul_size=sizes.matmul_size,
            dtype=sizes.dtype,
        )
    ]


def _dense(lengths: Callable[[PerfSizes], tuple[int, ...]]):
    def run(sizes: PerfSizes, context: dict) -> list[dict]:
        return attention.dense_rows(
            sizes.impl,
            sizes.baselines,
            lengths(sizes),
            sizes.batch,
            sizes.heads,
            sizes.head_dim,
            jnp.dtype(sizes.dtype),
            causal_values=sizes.causal_values,
            repeats=sizes.repeats,
        )

    return run


def _hopper_rows(rows_fn: Callable, baselines: Callable[[PerfSizes], tuple[str, ...]]):
    """A Hopper A/B at the goal length: ``rows_fn`` of :mod:`benchmarks.attention`
    (``hopper_forward_rows`` or ``hopper_backward_rows``) against ``baselines(sizes)``."""

    def run(sizes: PerfSizes, context: dict) -> list[dict]:
        dtype = jnp.dtype(sizes.dtype)
        shape = (sizes.goal_len, sizes.batch, sizes.heads, sizes.head_dim)
        return rows_fn(sizes.impl, baselines(sizes), *shape, dtype, repeats=sizes.repeats)

    return run


def _block_sparse(sizes: PerfSizes, context: dict) -> list[dict]:
    return attention.block_sparse_rows(
        sizes.impl,
        sizes.baselines[0],
        sizes.batch,
        sizes.long_len,
        sizes.heads,
        sizes.head_dim,
        jnp.dtype(sizes.dtype),
        sizes.sparse_mask,
        repeats=sizes.repeats,
    )


def _sigmoid(sizes: PerfSizes, context: dict) -> list[dict]:
    return attention.sigmoid_rows(
        sizes.impl,
        sizes.goal_len,
        sizes.batch,
        sizes.heads,
        sizes.head_dim,
        jnp.dtype(sizes.dtype),
        causal_values=sizes.causal_values,
        repeats=sizes.repeats,
    )


def _tiles(sizes: PerfSizes, context: dict) -> list[dict]:
    return attention.tile_rows(
        sizes.impl,
        sizes.tiles,
        sizes.goal_len,
        sizes.batch,
        sizes.heads,
        sizes.head_dim,
        jnp.dtype(sizes.dtype),
        repeats=sizes.repeats,
    )


def _ragged_decode(sizes: PerfSizes, context: dict) -> list[dict]:
    bandwidth = context.get("bandwidth_gbs") or measured_bandwidth_gbs(sizes.bandwidth_bytes)
    return attention.ragged_decode_rows(
        sizes.impl, dtype=jnp.dtype(sizes.dtype), bandwidth_gbs=bandwidth, repeats=sizes.repeats, **sizes.decode
    )


def _mixer_rows(rows_fn):
    def run(sizes: PerfSizes, context: dict) -> list[dict]:
        mixers = sizes.mixers
        keys = jax.random.split(jax.random.key(0), 6)
        return [dict(section="sequence_mixers", **row) for row in rows_fn(mixers, jnp.dtype(mixers.dtype), keys)]

    return run


def _grouped_matmul(sizes: PerfSizes, context: dict) -> list[dict]:
    return moe.grouped_matmul_rows(sizes.moe)


def _grouped_matmul_tiles(sizes: PerfSizes, context: dict) -> list[dict]:
    return moe.grouped_matmul_tile_rows(sizes.moe)


def _quantized_decode(sizes: PerfSizes, context: dict) -> list[dict]:
    model, context_len, batches = sizes.quantized_decode
    return quantization.decode_rows(model, context_len, batches)


def _quantized_layouts(sizes: PerfSizes, context: dict) -> list[dict]:
    model, context_len, _ = sizes.quantized_decode
    return quantization.layout_rows(model, context_len, formats=sizes.quantized_layouts)


def _quantized_matmul(sizes: PerfSizes, context: dict) -> list[dict]:
    size, batches, copies = sizes.quantized_matmul
    dtype = jnp.dtype(sizes.dtype)
    return quantization.matmul_rows(size, dtype, batches, sizes.impl, copies, sizes.quantized_tiles)


def _train_step(sizes: PerfSizes, context: dict) -> list[dict]:
    preset, batch, seq_len = sizes.train
    config = load_config(ModelConfig, PRESETS / f"{preset}.yaml")
    config = dataclasses.replace(config, **sizes.train_overrides)
    row = train_step.measure(preset, config, batch, seq_len, repeats=sizes.repeats, compare_plain=False)
    return [dict(section="train_step", preset=preset, remat=config.remat, scan_layers=config.scan_layers, **row)]


MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement("ceilings", _ceilings, 10),
    Measurement("dense_goal", _dense(lambda s: (s.goal_len,)), 40),
    Measurement("hopper_forward", _hopper_rows(attention.hopper_forward_rows, lambda s: s.hopper_baselines), 40),
    # cuDNN's fwd+bwd (the first baseline) against the Hopper backward
    Measurement("hopper_backward", _hopper_rows(attention.hopper_backward_rows, lambda s: s.baselines[:1]), 40),
    Measurement("block_sparse", _block_sparse, 40),
    Measurement("linear_attention", _mixer_rows(sequence_mixers.linear_attention_rows), 40),
    Measurement("ssd", _mixer_rows(sequence_mixers.ssd_rows), 40),
    Measurement("grouped_matmul", _grouped_matmul, 90),
    Measurement("ragged_decode", _ragged_decode, 15),
    Measurement("quantized_decode", _quantized_decode, 60),
    Measurement("quantized_layouts", _quantized_layouts, 40),
    Measurement("quantized_matmul", _quantized_matmul, 90),
    Measurement("train_step", _train_step, 120),
    Measurement("sigmoid", _sigmoid, 30),
    Measurement("flash_tiles", _tiles, 50),
    Measurement("grouped_matmul_tiles", _grouped_matmul_tiles, 60),
    *(Measurement(f"dense_sweep[{i}]", _dense(lambda s, i=i: s.sweep_lens[i : i + 1]), 40) for i in range(4)),
)
"""The performance rows, most important first; one line per measurement."""


def _first(rows: list[dict], **match) -> dict:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), {})


def goals(rows: list[dict], sizes: PerfSizes) -> dict[str, dict]:
    """The issue's targets as ``{name: {"value": measured ratio or None, "target": ..., "met": ...}}``."""
    baseline = sizes.baselines[0]
    dense = _first(rows, section="dense", q_len=sizes.goal_len, causal=True)
    sparse = _first(rows, section="block_sparse")
    chunked = f"chunked[{sizes.impl}]"
    linear = _first(rows, section="sequence_mixers", op="linear_attention", seq=sizes.long_len, form=chunked)
    flash = _first(rows, section="sequence_mixers", op="linear_attention", seq=sizes.long_len, form="flash attention")
    ssd_chunked = _first(rows, section="sequence_mixers", op="ssd", seq=sizes.long_len, form=chunked)
    ssd_scan = _first(rows, section="sequence_mixers", op="ssd", seq=sizes.long_len, form="scan")
    train = _first(rows, section="train_step")
    # the kernel's default kv_splits (rows kept from before the column: their only row)
    decode = _first(rows, section="ragged_decode", kv_splits_default=True) or _first(rows, section="ragged_decode")
    load, problem = sizes.moe.loads[0], sizes.moe.problems[0]
    moe_row = dict(section="grouped_matmul", experts=problem.experts, k=problem.k, n=problem.n, load=load)
    grouped = _first(rows, **moe_row, form=f"grouped_matmul[{sizes.moe.impl}]")
    dense_matmul = _first(rows, **moe_row, form="dense_equal_flops")

    def over(a, b):
        return a / b if isinstance(a, float) and isinstance(b, float) else None

    measured = {
        f"flash_fwd_{sizes.goal_len}_causal_speed_vs_{baseline}": (dense.get(f"fwd_speedup_vs_{baseline}"), 0.8),
        f"block_sparse_{sizes.long_len}_fwd_speedup_vs_{baseline}_with_mask": (
            sparse.get(f"fwd_speedup_vs_{baseline}_with_mask"),
            3.0,
        ),
        f"linear_attention_fwd_bwd_{sizes.long_len}_speedup_vs_our_flash": (
            over(flash.get("fwd_bwd_ms"), linear.get("fwd_bwd_ms")),
            4.0,
        ),
        f"ssd_fwd_bwd_{sizes.long_len}_speedup_vs_naive_scan": (
            over(ssd_scan.get("fwd_bwd_ms"), ssd_chunked.get("fwd_bwd_ms")),
            5.0,
        ),
        "ragged_decode_fraction_of_measured_bandwidth": (decode.get("fraction_of_bandwidth"), 0.7),
        f"grouped_matmul_fwd_{load}_tflops_vs_equal_flop_dense_matmul": (
            over(grouped.get("fwd_tflops"), dense_matmul.get("fwd_tflops")),
            0.8,
        ),
        f"{sizes.train[0]}_train_step_mfu": (train.get("ember_mfu"), 0.45),
    }
    float_name = "float"
    for batch in sizes.quantized_decode[2]:
        if batch > 16:
            continue  # the goal's batch range: 1-16, where the step is bound by reading weights
        for fmt, target in (("int8", 1.6), ("int4", 2.5)):
            row = _first(rows, section="quantized_decode", batch=batch, weights=fmt)
            floats = _first(rows, section="quantized_decode", batch=batch, weights=float_name)
            measured[f"{fmt}_decode_step_speedup_vs_{sizes.dtype}_batch_{batch}"] = (
                over(floats.get("step_ms"), row.get("step_ms")),
                target,
            )
    return {
        name: dict(value=value, target=target, met=None if value is None else bool(value >= target))
        for name, (value, target) in measured.items()
    }


def _run_measurement(measurement: Measurement, sizes: PerfSizes, context: dict, deadline: float) -> list[dict]:
    left = deadline - time.monotonic()
    if left < measurement.reserve_s:
        print(f"[perf] skip {measurement.name}: {left:.0f} s left < {measurement.reserve_s:.0f} s reserve", flush=True)
        return [dict(section=measurement.name, skipped=f"budget: {left:.0f} s left")]
    started = time.perf_counter()
    try:
        rows = measurement.run(sizes, context)
    except Exception as error:
        rows = [
            dict(
                section=measurement.name,
                error=f"{type(error).__name__}: {error}"[:2000],
                traceback="".join(traceback.format_exception(error))[-4000:],
            )
        ]
    seconds = time.perf_counter() - started
    print(f"[perf] {measurement.name}: {len(rows)} rows in {seconds:.1f} s", flush=True)
    for row in rows:
        row.setdefault("measurement", measurement.name)
        row.setdefault("measurement_seconds", seconds)
    return rows


def kept_results(previous: dict, device: str) -> dict[str, Any]:
    """What an earlier results record of the same ``device`` measured, for a run that repeats
    only part of it (``--keep-from``): its device and Hopper value checks, each marked with the
    date and seed of the run that made it (``checked_on``, ``checked_with_seed``), and its rows,
    marked ``measured_on``; marks already there stand. A session whose device time allows one
    short call rechecks and re-times only what it changed and keeps the rest."""
    if previous.get("device") != device or previous.get("toy"):
        raise ValueError(
            f"--keep-from needs a non-toy results file of this device ({device!r}), "
            f"got one of {previous.get('device')!r} (toy: {previous.get('toy')})"
        )
    origin = dict(checked_on=previous["date"], checked_with_seed=previous["seed"])

    def checks(name):
        return {check: {**origin, **result} for check, result in previous.get(name, {}).items()}

    return dict(
        device_value_checks=checks("device_value_checks"),
        hopper_value_checks=checks("hopper_value_checks"),
        rows=[{"measured_on": previous["date"], **row} for row in previous.get("rows", ()) if "skipped" not in row],
    )


def previous_record(path: Path, device: str) -> dict | None:
    """The record ``--keep-from`` names: a results file, or in a folder the file of this
    ``device`` (None if it has none: a call that lands on another kind of GPU starts afresh)."""
    if path.is_dir():
        path = path / f"gpu-{device}.json"
        if not path.exists():
            print(f"--keep-from: no {path.name} in {path.parent}; nothing kept", flush=True)
            return None
    return json.loads(path.read_text())


def _measured(rows: list[dict]) -> bool:
    """Whether a measurement's rows hold a result (not only a budget skip)."""
    return any("skipped" not in row for row in rows)


def run(
    toy: bool,
    results_dir: Path | None,
    budget_s: float,
    seed: int,
    only_checks: tuple[str, ...] = (),
    skip: tuple[str, ...] = (),
    keep_from: dict | None = None,
    first: tuple[str, ...] = (),
    train_overrides: dict[str, Any] | None = None,
) -> Path:
    """Runs the checks and the measurements; returns the results file's path. With
    ``keep_from`` (an earlier record), its checks and a measurement's rows stand where this
    run repeats none of them (:func:`kept_results`). The measurements named in ``first`` run
    first, in that order (a short call's budget then skips the least important).
    ``train_overrides`` replace ``ModelConfig`` fields of the timed training step."""
    check_sizes: CheckSizes = TOY_CHECK_SIZES if toy else GPU_CHECK_SIZES
    sizes = TOY_SIZES if toy else GPU_SIZES
    if train_overrides:
        sizes = dataclasses.replace(sizes, train_overrides={**sizes.train_overrides, **train_overrides})
    deadline = time.monotonic() + budget_s
    nothing_kept = dict(device_value_checks={}, hopper_value_checks={}, rows=[])
    kept = kept_results(keep_from, device_label()) if keep_from else nothing_kept
    record: dict[str, Any] = dict(
        toy=toy,
        seed=seed,
        budget_s=budget_s,
        check_sizes=dataclasses.asdict(check_sizes),
        perf_sizes={k: repr(v) for k, v in dataclasses.asdict(sizes).items()},
        kernels=[check.name for check in KERNEL_CHECKS],
        device_value_checks=kept["device_value_checks"],
        hopper_value_checks=kept["hopper_value_checks"],
        rows=list(kept["rows"]),
        goals={},
    )

    def save() -> Path:
        return write_results("gpu", record, results_dir)

    def run_checks_in(dtypes, deadline=None):
        if "checks" not in skip and dtypes:
            results = record["device_value_checks"]
            run_checks(
                dataclasses.replace(check_sizes, dtypes=dtypes),
                seed,
                only=only_checks,
                deadline=deadline,
                on_result=lambda new: (results.update(new), save()),
            )

    def run_hopper_checks():
        if "checks" in skip:
            return
        results, reason = record["hopper_value_checks"], hopper_skip_reason(check_sizes)
        if reason is None:
            hopper_sizes = dataclasses.replace(check_sizes, dtypes=HOPPER_CHECK_DTYPES)
            on_result = lambda new: (results.update(new), save())  # noqa: E731
            run_checks(hopper_sizes, seed, only_checks, checks=HOPPER_CHECKS, on_result=on_result)
        else:
            for check in HOPPER_CHECKS:
                if not only_checks or any(part in check.name for part in only_checks):
                    for dtype in HOPPER_CHECK_DTYPES:
                        results[f"{check.name} {dtype}"] = dict(dtype=dtype, passed=None, skipped=reason)
            print(f"[check] skip the Hopper checks: {reason}", flush=True)
        save()

    # The first dtype (bf16 on a GPU) is checked first; the others after the timings, in
    # what is left of the budget: they compile the same kernels again. A named subset of
    # checks is short: all its dtypes run first.
    first_dtypes = check_sizes.dtypes if only_checks else check_sizes.dtypes[:1]
    run_checks_in(first_dtypes)
    run_hopper_checks()
    context: dict[str, Any] = {}
    ordered = sorted(MEASUREMENTS, key=lambda m: first.index(m.name) if m.name in first else len(first))
    for measurement in ordered:
        if measurement.name in skip:
            continue
        rows = _run_measurement(measurement, sizes, context, deadline)
        if _measured(rows):  # new rows replace kept ones
            record["rows"] = [row for row in record["rows"] if row.get("measurement") != measurement.name]
        record["rows"] += rows
        record["goals"] = goals(record["rows"], sizes)
        save()
    run_checks_in(check_sizes.dtypes[len(first_dtypes) :], deadline)
    path = save()
    _print_summary(record)
    print(f"\nwrote {path}")
    return path


def _print_summary(record: dict) -> None:
    checks = {**record["device_value_checks"], **record["hopper_value_checks"]}
    print("\n== device value checks ==")
    print_table(
        [
            dict(
                kernel=name,
                passed=r["passed"],
                max_rel_error=r.get("max_relative_error"),
                error=(r.get("error") or r.get("skipped") or "")[:80],
            )
            for name, r in checks.items()
        ],
        ["kernel", "passed", "max_rel_error", "error"],
    )
    attention.print_sections(
        [r for r in record["rows"] if "section" in r and r.get("section") != "sequence_mixers"],
        "see the JSON for every column",
    )
    mixers = [r for r in record["rows"] if r.get("section") == "sequence_mixers"]
    if mixers:
        print("\n== sequence_mixers ==")
        print_table(mixers, ["op", "seq", "form", "fwd_ms", "fwd_bwd_ms"])
    print("\n== goals (measured ratio vs target) ==")
    print_table([dict(goal=k, **v) for k, v in record["goals"].items()], ["goal", "value", "target", "met"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toy", action="store_true", help="toy sizes, kernels interpreted (the default without a GPU)")
    parser.add_argument("--results-dir", type=Path, default=None, help="where gpu-<device>.json goes")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run (GPU default 500)")
    parser.add_argument("--seed", type=int, default=None, help="inputs of the value checks (default: fresh)")
    parser.add_argument("--only-checks", nargs="*", default=(), help="run only checks whose name contains one of these")
    parser.add_argument("--skip", nargs="*", default=(), help="'checks' and/or measurement names to leave out")
    parser.add_argument("--only", nargs="*", default=None, help="the measurements to run, in this order (default: all)")
    parser.add_argument(
        "--keep-from",
        type=Path,
        default=None,
        help="an earlier gpu-<device>.json (or a folder holding one for this device) whose checks and rows "
        "stand where this run repeats none of them",
    )
    parser.add_argument(
        "--train-overrides",
        nargs="*",
        default=(),
        metavar="FIELD=VALUE",
        help="ModelConfig fields of the timed training step, e.g. remat=dots scan_layers=false",
    )
    args = parser.parse_args(argv)
    train_overrides = OmegaConf.to_container(OmegaConf.from_dotlist(list(args.train_overrides)))
    unknown_fields = sorted(set(train_overrides) - {field.name for field in dataclasses.fields(ModelConfig)})
    if unknown_fields:
        parser.error(f"--train-overrides: {unknown_fields} are not ModelConfig fields")
    names = [measurement.name for measurement in MEASUREMENTS]
    unknown = [name for name in (*args.skip, *(args.only or ())) if name not in (*names, "checks")]
    if unknown:
        parser.error(f"unknown measurement(s) {unknown}; known: checks, {', '.join(names)}")
    skip = tuple(args.skip) + tuple(name for name in names if args.only is not None and name not in args.only)
    toy = args.toy or not on_gpu()
    if toy and not args.toy:
        print(f"No GPU found (device: {device_label()}): toy sizes, kernels in the Pallas interpreter.")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "little")
    budget = args.budget_s if args.budget_s is not None else (1e9 if toy else 500.0)
    previous = previous_record(args.keep_from, device_label()) if args.keep_from else None
    run(
        toy, args.results_dir, budget, seed, tuple(args.only_checks), skip, previous, tuple(args.only or ()),
        train_overrides,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

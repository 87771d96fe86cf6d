"""Quantized weights against float ones: bytes, decode speed and validation loss.

    python -m benchmarks.quantization                    # every section
    python -m benchmarks.quantization --section decode   # one section (repeat for more)

``matmul`` section: products ``x [batch, k] @ W [k, n]`` (batch 1, 8, 64: decode-shaped)
with ``W`` float (bf16 on a GPU, f32 on CPU) and as int8 / int4 / NF4 through
``quantized_matmul`` (the Pallas kernel on a GPU, the XLA path on CPU) and its XLA path; on a
GPU, 16 products per call, each with its own copy of ``W``, so that weights come from HBM,
not the L2 cache; ms per product, the weight's GB/s and the float product's time over each.

``decode`` section: one serving decode step (the engine's jitted ragged step, one new token
per sequence over a short context) of the same decoder LM with float weights and with its
projections stored int8 / int4 / NF4, at batch 1, 8 and 64, each in the layer layout
serving gives them (unrolled on a GPU); weight bytes, ms, and the float
step's time over each format's. On a GPU the step is memory-bound, so the goal there is int8
>= 1.6x and int4 >= 2.5x the bf16 step at batch 1-16 (MARLIN reports near 4x for its 4-bit
GEMM up to batch 16-32).

``layouts`` section: the decode step at batch 1 with its layers scanned (the default) and
unrolled (``scan_layers=false``), float and int8 / int4: what slicing a stacked quantized
weight for the kernel costs. It costs a copy of every layer's weights a step: compiled for an
H100 without one (``python -m benchmarks.deviceless_compile``) the scanned int8 step writes
67 MB of int8 copies, one layer's weights, in its loop body; the unrolled step none.

``loss`` section: a tiny byte-level LM trained briefly on the stdlib corpus (float, and with
int4 QAT over the last half or the last fifth of its steps), then quantized every way (``ember quantize``'s
``quantize_model``); validation loss and its delta against float for each format and method.

Results: ``benchmarks/results/quantization-<device>.json`` (a run of some sections keeps the
other sections' figures already in that file).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import tempfile
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks.harness import on_gpu, print_table, run_sections, time_fn
from benchmarks.serving import decode_step_seconds
from ember.core.config import load_config
from ember.kernels_pallas.quantized_formats import FORMATS
from ember.kernels_pallas.quantized_matmul import quantized_matmul
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.layer_layout import convert_layer_layout
from ember.models.quantization import QuantizeConfig, quantize_params, weight_bytes
from ember.models.quantization.numerics import quantize_matrix
from ember.serving.loading import serving_overrides
from ember.training.lm.config import LMConfig
from ember.training.lm.trainer import train
from ember.training.quantization.ptq import EvalConfig, quantize_model

BATCHES = (1, 8, 64)


def _copies(tree, copies: int) -> list:
    """``copies`` distinct buffers holding ``tree``: products that each read their own weight."""
    return [tree] + [jax.tree.map(jnp.copy, tree) for _ in range(copies - 1)]


def matmul_rows(size: int, dtype, batches=BATCHES, impl: str = "auto", copies: int = 1, tiles=()) -> list[dict]:
    """``x [batch, size] @ W [size, size]``: float ``W`` in ``dtype``, and each format through
    ``quantized_matmul(impl=...)`` (form ``impl``) and through its XLA path (form ``xla``); the
    goal formats (int8, int4) also with each of ``tiles`` (a :class:`QuantizedMatmulBlockSizes`
    each, form ``tile i``) at the goal's batches (up to 16).

    One jitted call makes ``copies`` products, each with its own copy of the weight: with
    enough copies to overflow a GPU's L2 cache (50 MB on an H100) every product reads its
    weight from HBM, as a decode step does, and the call is long enough that dispatch does not
    dominate. ms per product, the weight's GB/s and the float product's time over each form's."""
    w = jax.random.normal(jax.random.key(0), (size, size), jnp.float32) * 0.02
    # Jitted: op by op, quantizing compiled each of its ops (about 40, a second and a half of a toy-sized run).
    quantize = jax.jit(quantize_matrix, static_argnums=(1, 2))
    weights = {fmt: quantize(w, fmt, None if fmt == "int8" else 128 if fmt == "int4" else 64) for fmt in FORMATS}
    forms = {impl: {"impl": impl}} | ({} if impl == "xla" else {"xla": {"impl": "xla"}})
    forms |= {f"tile {i}": {"impl": impl, "block_sizes": tile} for i, tile in enumerate(tiles)}

    def products(product):
        return jax.jit(lambda x, ws: [product(x, w) for w in ws])

    @jax.jit  # one program, not one compiled per op
    def relative_difference(got, want):
        """max |form - XLA path| / max |XLA path|: a fast wrong kernel shows here."""
        got, want = got.astype(jnp.float32), want.astype(jnp.float32)
        return jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))

    def row(batch, fmt, form, seconds, stored, float_s, **extra):
        per_product = seconds / copies
        return dict(section="quantized_matmul", batch=batch, format=fmt, form=form, ms=per_product * 1e3,
                    speedup=float_s / seconds, weight_mb=stored / 1e6, weight_gb_s=stored / per_product / 1e9,
                    copies=copies, **extra)  # fmt: skip

    dense = products(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    dense_ws = _copies(w.astype(dtype), copies)
    quantized_ws = {fmt: _copies(weight, copies) for fmt, weight in weights.items()}
    rows = []
    for batch in batches:
        x = jax.random.normal(jax.random.key(batch), (batch, size), dtype)
        float_s = time_fn(dense, x, dense_ws, repeats=20)
        rows.append(row(batch, f"float ({jnp.dtype(dtype).name})", "xla", float_s, dense_ws[0].nbytes, float_s))
        for fmt, ws in quantized_ws.items():
            stored = ws[0].values.nbytes + ws[0].scales.nbytes
            want = quantized_matmul(x, ws[0], impl="xla")
            for form, options in forms.items():
                tile = dataclasses.asdict(options["block_sizes"]) if "block_sizes" in options else {}
                # one_row="vector" only changes a one-row call: elsewhere it repeats its dot twin
                if tile and (batch > 16 or fmt == "nf4" or (tile["one_row"] == "vector" and batch > 1)):
                    continue
                timed = products(functools.partial(quantized_matmul, **options))
                try:
                    seconds = time_fn(timed, x, ws, repeats=20)
                    difference = float(relative_difference(timed(x, ws)[0], want))
                except Exception as error:  # a tile the compiler rejects costs its row only
                    if not tile:
                        raise
                    rows.append(dict(section="quantized_matmul", batch=batch, format=fmt, form=form, **tile,
                                     error=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"))  # fmt: skip
                    continue
                rows.append(row(batch, fmt, form, seconds, stored, float_s, rel_diff_vs_xla=difference, **tile))
    return rows


def matmul_section() -> list[dict]:
    if on_gpu():
        rows = matmul_rows(4096, jnp.bfloat16, impl="pallas", copies=16)
    else:
        rows = matmul_rows(2048, jnp.float32, impl="xla")  # no kernel to compare with on CPU
    print_table(rows, ["batch", "format", "form", "ms", "weight_gb_s", "speedup", "weight_mb"])
    return rows


GPU_DECODE_MODEL = ModelConfig(vocab_size=32000, d_model=2048, num_layers=8, num_heads=16, mlp_dim=8192,
                               max_seq_len=512, precision="bf16", tie_embeddings=False)  # fmt: skip
CPU_DECODE_MODEL = ModelConfig(vocab_size=512, d_model=512, num_layers=4, num_heads=8, mlp_dim=2048, max_seq_len=128)


def _weight_variants(config: ModelConfig, formats=FORMATS) -> dict:
    """``{"float": params, fmt: params with the projections stored in fmt}`` for ``config``."""
    # Jitted: op by op, initialising and quantizing took most of a toy-sized run.
    params = nn.meta.unbox(jax.jit(DecoderLM(config).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    quantize = jax.jit(quantize_params, static_argnums=1)
    return {"float": params, **{fmt: quantize(params, QuantizeConfig(format=fmt)) for fmt in formats}}


def decode_rows(config: ModelConfig, context: int, batches=BATCHES) -> list[dict]:
    """One serving decode step with float weights and with the projections stored in each
    format, in the layer layout ``load_model`` serves them in (unrolled on a GPU:
    ``ember.serving.loading.serving_overrides``); ms and the float step's time over each
    format's. The program stores each weight as its step reads it (a bf16 model's float
    projections in bf16: ``ember.serving.model_program.read_weight_dtypes``); ``weight_mb``
    is what it stores."""
    served = dataclasses.replace(config, **serving_overrides())
    variants = _weight_variants(config)
    if served.scan_layers != config.scan_layers:
        variants = {name: convert_layer_layout(weights, config, served) for name, weights in variants.items()}
    rows = []
    for batch in batches:
        float_s = None
        for name, weights in variants.items():
            seconds, program = decode_step_seconds(served, weights, batch, context)
            float_s = float_s or seconds
            rows.append(dict(section="quantized_decode", batch=batch, weights=name, step_ms=seconds * 1e3,
                             speedup=float_s / seconds, weight_mb=weight_bytes(program.params) / 1e6,
                             layers="scanned" if served.scan_layers else "unrolled"))  # fmt: skip
    return rows


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(s8|u8)\[([\d,]*)\]\S*\s+([\w-]+)\(")
_ALIASES = {"parameter", "get-tuple-element", "bitcast", "tuple"}


def materialized_weight_mb(hlo: str) -> tuple[int, float]:
    """``(instructions, MB)`` of the int8 / uint8 arrays of rank >= 2 that a compiled
    program's instructions write, outside fused computations: copies or slices of quantized
    weights, as nothing else a step computes has those types. A loop body counts once (for
    scanned layers: one layer's)."""
    count, size, fused = 0, 0, False
    for line in hlo.splitlines():
        if line.startswith(("%", "ENTRY")):  # a computation's header
            name = line.split(" ", 1)[0]
            fused = "fused" in name or "wrapped" in name
            continue
        match = _INSTRUCTION.match(line)
        if fused or not match or match.group(3) in _ALIASES or "," not in match.group(2):
            continue
        count += 1
        size += math.prod(int(d) for d in match.group(2).split(","))
    return count, size / 1e6


def layout_rows(config: ModelConfig, context: int, batch: int = 1, formats=("int8", "int4")) -> list[dict]:
    """The decode step of :func:`decode_rows` at ``batch`` with the layers scanned (one stacked
    parameter per weight, the layer's slice taken inside the loop) and unrolled (a parameter
    per layer; the same weights): whether the slice costs the quantized matmul, a custom call, a copy of its
    weight that XLA's own dot is spared. ms and the float step's time (same layout) over
    each, and :func:`materialized_weight_mb` of the compiled step (``weight_copies``,
    ``weight_copies_mb``): a copy shows there whatever the timings say."""
    scanned = dataclasses.replace(config, scan_layers=True)
    variants = _weight_variants(scanned, formats)
    rows = []
    for layers, scan in (("scanned", True), ("unrolled", False)):
        layout = dataclasses.replace(config, scan_layers=scan)
        float_s = None
        for name, weights in variants.items():
            weights = convert_layer_layout(weights, scanned, layout) if not scan else weights
            seconds, program = decode_step_seconds(layout, weights, batch, context)
            copies, copied_mb = materialized_weight_mb(program.steps[batch].as_text())
            float_s = float_s or seconds
            rows.append(dict(section="quantized_decode_layouts", batch=batch, layers=layers, weights=name,
                             step_ms=seconds * 1e3, speedup=float_s / seconds, weight_copies=copies,
                             weight_copies_mb=copied_mb))  # fmt: skip
    return rows


def layouts_section() -> list[dict]:
    rows = layout_rows(GPU_DECODE_MODEL, 256) if on_gpu() else layout_rows(CPU_DECODE_MODEL, 64)
    print_table(rows, ["batch", "layers", "weights", "step_ms", "speedup", "weight_copies", "weight_copies_mb"])
    return rows


def decode_section() -> list[dict]:
    rows = decode_rows(GPU_DECODE_MODEL, 256) if on_gpu() else decode_rows(CPU_DECODE_MODEL, 64)
    print_table(rows, ["batch", "weights", "layers", "step_ms", "speedup", "weight_mb"])
    return rows


LOSS_RUN = [
    "model.vocab_size=384", "model.d_model=128", "model.num_layers=2", "model.num_heads=4", "model.mlp_dim=512",
    "model.max_seq_len=128", "train.batch_size=16", "train.seq_len=128", "train.steps=600", "train.log_every=100",
    "train.eval_every=100000", "train.eval_batches=0", "optim.lr=3e-3", "checkpoint.every=600",
    "logging.progress=false", "logging.tensorboard=false", "sample.prompts=[]",
]  # fmt: skip
LOSS_VARIANTS = (("int8", "rtn"), ("int4", "rtn"), ("int4", "gptq"), ("nf4", "rtn"), ("nf4", "gptq"))


def loss_section() -> list[dict]:
    windows = EvalConfig(seq_len=128, calibration_windows=64, eval_windows=64)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        runs = {
            "float": Path(root) / "float",
            "qat int4 50%": Path(root) / "qat50",
            "qat int4 20%": Path(root) / "qat20",
        }
        for name, path in runs.items():
            extra = ["qat.format=int4", f"qat.fraction={name[-3:-1]}e-2"] if name.startswith("qat") else []
            train(load_config(LMConfig, None, [*LOSS_RUN, f"run_dir={path}", *extra]))
        float_loss = None
        for trained, path in runs.items():
            variants = LOSS_VARIANTS if trained == "float" else (("int4", "rtn"),)
            for fmt, method in variants:
                out = Path(root) / f"{trained}-{fmt}-{method}".replace(" ", "_")
                summary = quantize_model(path, out, QuantizeConfig(format=fmt, method=method), windows=windows)
                float_loss = float_loss if float_loss is not None else summary["float_val_loss"]
                rows.append(dict(trained=trained, format=fmt, method=method,
                                 own_float_val_loss=summary["float_val_loss"], val_loss=summary["quantized_val_loss"],
                                 delta_vs_float_training=summary["quantized_val_loss"] - float_loss,
                                 weight_mb=summary["quantized_weight_bytes"] / 1e6))  # fmt: skip
    print_table(rows, ["trained", "format", "method", "own_float_val_loss", "val_loss", "delta_vs_float_training"])
    return rows


SECTIONS = {"matmul": matmul_section, "decode": decode_section, "layouts": layouts_section, "loss": loss_section}


def main() -> None:
    run_sections("quantization", SECTIONS, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    main()

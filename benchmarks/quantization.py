"""Quantized weights against float ones: bytes, decode speed and validation loss.

    python -m benchmarks.quantization                    # every section
    python -m benchmarks.quantization --section decode   # one section (repeat for more)

``matmul`` section: one decode-shaped product ``x [batch, k] @ W [k, n]`` (batch 1, 8, 64)
with ``W`` float (bf16 on a GPU, f32 on CPU) and as int8 / int4 / NF4 through
``quantized_matmul`` (the Pallas kernel on a GPU, the XLA path on CPU); ms and the float
product's time over each format's.

``decode`` section: one serving decode step (the engine's jitted ragged step, one new token
per sequence over a short context) of the same decoder LM with float weights and with its
projections stored int8 / int4 / NF4, at batch 1, 8 and 64; weight bytes, ms, and the float
step's time over each format's. On a GPU the step is memory-bound, so the goal there is int8
>= 1.6x and int4 >= 2.5x the bf16 step at batch 1-16 (MARLIN reports near 4x for its 4-bit
GEMM up to batch 16-32).

``loss`` section: a tiny byte-level LM trained briefly on the stdlib corpus (float, and with
int4 QAT over the last half or the last fifth of its steps), then quantized every way (``ember quantize``'s
``quantize_model``); validation loss and its delta against float for each format and method.

Results: ``benchmarks/results/quantization-<device>.json`` (a run of some sections keeps the
other sections' figures already in that file).
"""

from __future__ import annotations

import functools
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
from ember.models.quantization import QuantizeConfig, quantize_params, weight_bytes
from ember.models.quantization.numerics import quantize_matrix
from ember.training.lm.config import LMConfig
from ember.training.lm.trainer import train
from ember.training.quantization.ptq import EvalConfig, quantize_model

BATCHES = (1, 8, 64)


def matmul_rows(size: int, dtype, batches=BATCHES, impl: str = "auto") -> list[dict]:
    """``x [batch, size] @ W [size, size]``: float ``W`` in ``dtype`` and each format through
    ``quantized_matmul(impl=...)``; ms and the float product's time over each format's."""
    w = jax.random.normal(jax.random.key(0), (size, size), jnp.float32) * 0.02
    weights = {fmt: quantize_matrix(w, fmt, None if fmt == "int8" else 128 if fmt == "int4" else 64) for fmt in FORMATS}
    dense_w = w.astype(dtype)
    dense = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    rows = []
    for batch in batches:
        x = jax.random.normal(jax.random.key(batch), (batch, size), dtype)
        float_s = time_fn(dense, x, dense_w, repeats=20)
        rows.append(dict(section="quantized_matmul", batch=batch, format=f"float ({jnp.dtype(dtype).name})",
                         ms=float_s * 1e3, speedup=1.0, weight_mb=dense_w.nbytes / 1e6))  # fmt: skip
        for fmt, weight in weights.items():
            seconds = time_fn(functools.partial(quantized_matmul, impl=impl), x, weight, repeats=20)
            stored = (weight.values.nbytes + weight.scales.nbytes) / 1e6
            rows.append(dict(section="quantized_matmul", batch=batch, format=fmt, ms=seconds * 1e3,
                             speedup=float_s / seconds, weight_mb=stored))  # fmt: skip
    return rows


def matmul_section() -> list[dict]:
    rows = matmul_rows(4096, jnp.bfloat16) if on_gpu() else matmul_rows(2048, jnp.float32)
    print_table(rows, ["batch", "format", "ms", "speedup", "weight_mb"])
    return rows


GPU_DECODE_MODEL = ModelConfig(vocab_size=32000, d_model=2048, num_layers=8, num_heads=16, mlp_dim=8192,
                               max_seq_len=512, precision="bf16", tie_embeddings=False)  # fmt: skip
CPU_DECODE_MODEL = ModelConfig(vocab_size=512, d_model=512, num_layers=4, num_heads=8, mlp_dim=2048, max_seq_len=128)


def decode_rows(config: ModelConfig, context: int, batches=BATCHES) -> list[dict]:
    """One serving decode step with float weights and with the projections stored in each
    format; ms and the float step's time over each format's."""
    # Jitted: op by op, initialising and quantizing took most of a toy-sized run.
    params = nn.meta.unbox(jax.jit(DecoderLM(config).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    quantize = jax.jit(quantize_params, static_argnums=1)
    variants = {"float": params, **{fmt: quantize(params, QuantizeConfig(format=fmt)) for fmt in FORMATS}}
    rows = []
    for batch in batches:
        float_s = None
        for name, weights in variants.items():
            seconds, _ = decode_step_seconds(config, weights, batch, context)
            float_s = float_s or seconds
            rows.append(dict(section="quantized_decode", batch=batch, weights=name, step_ms=seconds * 1e3,
                             speedup=float_s / seconds, weight_mb=weight_bytes(weights) / 1e6))  # fmt: skip
    return rows


def decode_section() -> list[dict]:
    rows = decode_rows(GPU_DECODE_MODEL, 256) if on_gpu() else decode_rows(CPU_DECODE_MODEL, 64)
    print_table(rows, ["batch", "weights", "step_ms", "speedup", "weight_mb"])
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


SECTIONS = {"matmul": matmul_section, "decode": decode_section, "loss": loss_section}


def main() -> None:
    run_sections("quantization", SECTIONS, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    main()

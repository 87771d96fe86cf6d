"""``ember quantize SRC OUT --format int8|int4|nf4 [--method rtn|gptq]``: post-training
quantization of an Ember run or a Hugging Face directory (``ember.training.quantization.ptq``)."""

from __future__ import annotations

import argparse

from ember.kernels_pallas.quantized_formats import FORMATS
from ember.models.quantization.quantize import METHODS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="an Ember run directory or a Hugging Face model directory")
    parser.add_argument("out", help="a new directory for the quantized model")
    parser.add_argument("--format", choices=FORMATS, default="int8", help="weight format (default int8)")
    parser.add_argument("--method", choices=METHODS, default="rtn", help="round-to-nearest or GPTQ (default rtn)")
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="rows per scale (default: a QAT run's qat.group_size for this format, else int4 128, nf4 64)",
    )
    parser.add_argument(
        "--targets",
        default=None,
        help="comma-separated weights to quantize (quantize.targets): names or path regexes "
        "(default: a QAT run's qat.targets for this format, else q,k,v,o,gate,up,down: every attention "
        "and MLP projection the model has, routed experts' included)",
    )
    parser.add_argument(
        "--text",
        default=None,
        help="calibration/validation text file (default: an LM run's own dataset, else the stdlib corpus)",
    )
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per calibration/validation window")
    parser.add_argument("--calibration-windows", type=int, default=32, help="windows for GPTQ's statistics")
    parser.add_argument("--eval-windows", type=int, default=32, help="windows for the validation losses")


def run(args: argparse.Namespace) -> int:
    from ember.models.quantization import QuantizeConfig
    from ember.training.quantization.ptq import EvalConfig, qat_settings, quantize_model

    settings = qat_settings(args.source, args.format)  # a QAT run's weights are stored as its QAT steps saw them
    if args.group_size is not None:
        settings["group_size"] = args.group_size
    if args.targets:
        settings["targets"] = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    config = QuantizeConfig(format=args.format, method=args.method, **settings)
    windows = EvalConfig(
        seq_len=args.seq_len, calibration_windows=args.calibration_windows, eval_windows=args.eval_windows
    )
    summary = quantize_model(args.source, args.out, config, text=args.text, windows=windows)
    print(
        f"quantized {summary['quantized_weights']} weights to {summary['format']} ({summary['method']}): "
        f"{summary['float_weight_bytes'] / 1e6:.2f} MB -> {summary['quantized_weight_bytes'] / 1e6:.2f} MB"
    )
    print(
        f"validation loss: float {summary['float_val_loss']:.4f}, quantized {summary['quantized_val_loss']:.4f} "
        f"(delta {summary['val_loss_delta']:+.4f}, KL to float {summary['kl_to_float']:.2e}) "
        f"over {summary['eval_tokens']} tokens"
    )
    if summary["uncalibrated_matrices"]:
        print(
            f"GPTQ rounded {summary['uncalibrated_matrices']} matrices to nearest: no calibration token reached "
            "them (routed experts the calibration text never selected)"
        )
    print(f"wrote {args.out}")
    return 0

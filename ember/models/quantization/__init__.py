"""Quantized weights: int8 per channel, int4 group-wise, NF4 with double-quantised scales.

    qparams = quantize_params(params, QuantizeConfig(format="nf4"))     # the model reads them as stored
    grams = calibration_grams(apply_fn, {"params": params}, batches)   # GPTQ's statistics, one pass
    qparams = quantize_params(params, QuantizeConfig(format="int4", method="gptq"), grams=grams)

How values and scales are chosen (through qwix): ``numerics``; GPTQ: ``gptq``; GPTQ of a whole
``DecoderLM`` a group of layers at a time, each calibrated on the outputs of the groups quantized
before it (what ``ember quantize`` runs): ``sequential`` (not imported here: it imports the
decoder, which imports this package); how a quantized weight sits in the tree and how a layer
multiplies by it: ``stored``; where its parts go on a mesh: ``placement``; the matmul itself:
``ember.kernels_pallas.quantized_matmul``; quantization-aware training:
``ember.models.quantization.fake``.
"""

from ember.models.quantization.quantize import (
    DEFAULT_TARGETS,
    METHODS,
    QuantizeConfig,
    calibration_grams,
    dequantize_params,
    quantize_params,
    quantize_weights,
    quantized_paths,
    uncalibrated_matrices,
    weight_bytes,
)
from ember.models.quantization.stored import CALIBRATION, stored_format

__all__ = [
    "CALIBRATION",
    "DEFAULT_TARGETS",
    "METHODS",
    "QuantizeConfig",
    "calibration_grams",
    "dequantize_params",
    "quantize_params",
    "quantize_weights",
    "quantized_paths",
    "stored_format",
    "uncalibrated_matrices",
    "weight_bytes",
]

"""Post-training quantization of a whole model: ``ember quantize SRC OUT --format int4 --method gptq``.

SRC is an Ember run directory or a Hugging Face directory (``ember.serving.loading.load_model``).
Calibration (GPTQ's input statistics) and validation use token windows cut from a text file
(its two halves); by default, for an Ember LM run, from the train and validation splits of
the prepared dataset it trained on (so the validation loss is the run's ``val_loss``), and
for other models from the Python standard library's sources. GPTQ quantizes a group of layers
at a time, as the paper's code does (``ember.models.quantization.sequential``): each group is
calibrated on the outputs of the groups already quantized before it, and only one group's Gram
matrices are held at once. OUT is a directory that serves and exports like a run
(``ember generate --checkpoint OUT``, ``ember export OUT DIR``):

- ``config.yaml``: ``kind: quantized``, the ``model:`` section, the ``quantize:`` settings,
  the source and, when the source reads text with a Hugging Face tokenizer (a HF directory, or
  a run fine-tuned from one), that tokenizer's ``tokenizer.json`` and ``tokenizer_config.json``
  written beside it;
- ``checkpoints/``: step 0 holds the quantized ``params`` (packed, as the device keeps them);
- ``summary.json``: the float and quantized validation losses, the quantized model's mean
  per-token KL divergence from the float one (``kl_to_float``), weight bytes, and
  ``uncalibrated_matrices``: how many matrices GPTQ rounded to nearest because no calibration
  token reached them (routed experts the calibration text never selected; 0 under RTN).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from omegaconf import OmegaConf

from ember.core.checkpoint import CheckpointManager
from ember.core.config import read_key, run_kind, to_dict
from ember.core.errors import ConfigError, DataError
from ember.core.hf_tokenizer import HFTokenizer
from ember.core.jsonl import readable, utf8_text
from ember.core.tokenizer import ByteTokenizer
from ember.models.decoder import DecoderLM
from ember.models.quantization import QuantizeConfig, quantize_params, quantized_paths, weight_bytes
from ember.models.quantization.sequential import sequential_gptq
from ember.models.variables import as_variables
from ember.serving.loading import LoadedModel, load_model
from ember.training.data import TokenDataset, stdlib_corpus_dir
from ember.training.data.corpus import stdlib_documents
from ember.training.lm.eval_windows import check_seq_len, cut_windows, device_batches, run_dataset, window_loss
from ember.training.task import next_token_kl


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Token windows for calibration and validation: ``seq_len`` tokens each,
    ``calibration_windows`` for GPTQ, ``eval_windows`` for the losses, in batches of ``batch_size``."""

    seq_len: int = 128
    calibration_windows: int = 32
    eval_windows: int = 32
    batch_size: int = 8

    def __post_init__(self):
        for name in ("seq_len", "calibration_windows", "eval_windows", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}", key=name)


def token_splits(
    loaded: LoadedModel, text: str | Path | None, windows: EvalConfig, dataset: str | Path | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(calibration [n_cal, seq_len + 1], validation [n_eval, seq_len + 1])`` int32 windows:
    from ``text`` (its first and second halves), else from the prepared byte-level ``dataset``
    directory (its train and validation splits; default the stdlib corpus) for a byte-level
    model, else from the stdlib sources' text."""
    need = (windows.seq_len + 1) * max(windows.calibration_windows, windows.eval_windows)
    tokenizer = loaded.tokenizer
    if text is None and isinstance(tokenizer, ByteTokenizer):
        prepared = TokenDataset.open(stdlib_corpus_dir() if dataset is None else dataset)
        train, val = np.asarray(prepared.train[:need]), np.asarray(prepared.val[:need])
        sources = (f"the train split of {prepared.directory}", f"the validation split of {prepared.directory}")
    else:
        if tokenizer is None:
            raise ConfigError("the source model has no tokenizer.json to read the calibration text with", key="text")
        if text is not None:
            path = Path(text)
            if not readable(path):  # a file or a pipe
                raise DataError(f"calibration text {path} does not exist")
            source = utf8_text(path, "--text: ")
        else:
            source = _stdlib_text(chars=8 * need)
        ids = np.asarray(tokenizer.encode(source), np.int64)
        half = len(ids) // 2
        train, val = ids[:half][:need], ids[half:][:need]
        sources = ("the text", "the text")
    return cut_windows(train, windows.calibration_windows, windows.seq_len, sources[0]), cut_windows(
        val, windows.eval_windows, windows.seq_len, sources[1]
    )


def qat_settings(source: str | Path, fmt: str) -> dict[str, Any]:
    """The ``QuantizeConfig`` fields an Ember LM run that trained QAT for ``fmt`` trained with
    (``group_size`` when its ``qat.group_size`` is set, ``targets``), so that quantizing it
    stores the weights its QAT steps saw; empty for any other source or format."""
    config = Path(source) / "config.yaml"
    if not config.is_file() or run_kind(source) not in (None, "lm"):
        return {}
    qat = read_key(config, "qat") or {}
    if qat.get("format") != fmt:
        return {}
    settings = {"targets": tuple(qat["targets"])} if qat.get("targets") else {}
    return {**settings, "group_size": qat["group_size"]} if qat.get("group_size") else settings


def _stdlib_text(chars: int) -> str:
    parts, total = [], 0
    for _, source in stdlib_documents():
        parts.append(source)
        total += len(source)
        if total >= chars:
            break
    return "\n".join(parts)


def validation_figures(
    model: DecoderLM,
    float_variables: dict[str, Any],
    quantized_variables: dict[str, Any],
    windows: np.ndarray,
    batch_size: int,
) -> dict[str, float]:
    """Over the windows ``[n, seq_len + 1]``: the mean next-token cross-entropy of ``model``
    with each set of variables, and the mean per-token ``KL(float || quantized)`` of their
    next-token distributions (how far quantizing moved the model: unlike the loss difference,
    errors that raise one token's loss and lower another's do not cancel)."""

    @jax.jit
    def sums(float_variables, quantized_variables, tokens):
        float_logits, float_loss, count = window_loss(model, float_variables, tokens)
        quantized_logits, quantized_loss, _ = window_loss(model, quantized_variables, tokens)
        mask = jnp.ones(tokens[:, 1:].shape)
        return float_loss, quantized_loss, next_token_kl(quantized_logits, float_logits, mask), count

    totals = np.zeros(4)
    for batch in device_batches(windows, batch_size):
        totals += np.array([float(x) for x in sums(float_variables, quantized_variables, batch)])
    float_loss, quantized_loss, kl, count = totals
    return dict(float_val_loss=float_loss / count, quantized_val_loss=quantized_loss / count, kl_to_float=kl / count)


def quantize_model(
    source: str | Path,
    out: str | Path,
    config: QuantizeConfig,
    *,
    text: str | Path | None = None,
    windows: EvalConfig = EvalConfig(),
) -> dict[str, Any]:
    """Quantizes the model at ``source`` into the directory ``out`` (see the module docstring);
    returns the summary it writes."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; choose a new output directory", key="out")
    loaded = load_model(source)
    check_seq_len(windows.seq_len, loaded.config)
    model = DecoderLM(loaded.config)
    variables = as_variables(loaded.params)
    params, state = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    calibration, validation = token_splits(loaded, text, windows, run_dataset(source))
    if config.method == "gptq":
        inputs = device_batches(calibration[:, :-1], windows.batch_size)  # sliced on the host: no program per shape
        quantized, uncalibrated = sequential_gptq(loaded.config, variables, inputs, config)
    else:
        quantized, uncalibrated = quantize_params(params, config), {}
    paths = quantized_paths(params, config)
    figures = validation_figures(
        model, {"params": params, **state}, {"params": quantized, **state}, validation, windows.batch_size
    )
    summary = {
        "source": str(source),
        "format": config.format,
        "method": config.method,
        "group_size": config.rows_per_scale,
        "quantized_weights": len(paths),
        "uncalibrated_matrices": sum(uncalibrated.values()),
        **figures,
        "val_loss_delta": figures["quantized_val_loss"] - figures["float_val_loss"],
        "float_weight_bytes": weight_bytes(params),
        "quantized_weight_bytes": weight_bytes(quantized),
        "eval_tokens": int(validation[:, 1:].size),
    }
    _write(out, loaded, quantized, state, config, summary)
    return summary


def _write(out: Path, loaded: LoadedModel, quantized: Any, state: dict, config: QuantizeConfig, summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # From the tokenizer itself: a fine-tuning run's directory holds no tokenizer files (its base does).
    hf_tokenizer = isinstance(loaded.tokenizer, HFTokenizer)
    if hf_tokenizer:
        description = loaded.tokenizer.describe()
        (out / "tokenizer.json").write_text(description["tokenizer_json"])
        (out / "tokenizer_config.json").write_text(json.dumps(description["config"], indent=2) + "\n")
    document = {
        "kind": "quantized",
        "source": summary["source"],
        "tokenizer": "hf" if hf_tokenizer else "bytes",
        "eos_ids": list(loaded.eos_ids),
        "quantize": to_dict(config),
        "model": to_dict(loaded.config),
    }
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(document)))
    with CheckpointManager(out / "checkpoints", async_save=False) as manager:
        manager.save(0, {"params": quantized, **({"model_state": state} if state else {})})
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


__all__ = ["EvalConfig", "qat_settings", "quantize_model", "token_splits", "validation_figures"]

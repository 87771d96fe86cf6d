"""Linearising (LoLCATs): what it costs, what it keeps, and what decoding gains.

    python -m benchmarks.linearize                  # every section
    python -m benchmarks.linearize --section decode

``quality`` section: the tiny preset trained on the stdlib corpus (``configs/lm/tiny.yaml``, 400
of its steps) is linearised with ``configs/linearize/tiny.yaml``: the validation loss of the
teacher, of the naive swap (untrained linearised layers), after stage 1 and after stage 2; the
share of the gap closed, the parameters trained, and the wall time of pretraining and of each
stage.

``decode`` section: one decode step (8 sequences, one new token each, the model's ragged
serving step: ``DecoderLM.apply`` with a cache, jitted, buffers donated) of the tiny
architecture at contexts 1k to 32k, the softmax teacher over its paged KV cache against the
linearised model (16-token window, Hedgehog state); milliseconds per step and cache bytes per
sequence (KV pages the context fills, against the window plus the recurrent state). Random
weights: the timing does not depend on them.

Results: ``benchmarks/results/linearize-<device>.json``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import print_table, run_sections, time_fn
from ember.core.config import load_config
from ember.models.cache import FLOAT32_ENTRIES, init_cache_layers, layer_state_shapes
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.linearize import LinearizeConfig, linearized_config
from ember.training.launcher import shipped_configs_dir
from ember.training.linearize import entry
from ember.training.linearize.config import LinearizeRunConfig
from ember.training.lm.config import LMConfig
from ember.training.lm.trainer import train

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
SEQUENCES = 8


def quality_row() -> dict:
    quiet = ["logging.progress=false", "logging.tensorboard=false"]
    with tempfile.TemporaryDirectory() as root:
        os.environ.setdefault("EMBER_CACHE", str(Path(root) / "cache"))
        teacher = [f"run_dir={root}/teacher", "train.steps=400", "train.eval_every=400", "sample.prompts=[]", *quiet]
        start = time.perf_counter()
        train(load_config(LMConfig, shipped_configs_dir() / "lm" / "tiny.yaml", teacher))
        pretrain_seconds = time.perf_counter() - start
        overrides = [f"base_model.path={root}/teacher", f"run_dir={root}/linearized", *quiet]
        summary = entry.run(
            load_config(LinearizeRunConfig, shipped_configs_dir() / "linearize" / "tiny.yaml", overrides)
        )
    keys = ("teacher_val_loss", "swap_val_loss", "transfer_val_loss", "linearized_val_loss", "gap_closed",
            "parameters_trained", "parameters_total", "trained_fraction", "tokens", "transfer_seconds",
            "low_rank_seconds")  # fmt: skip
    row = {"pretrain_seconds": pretrain_seconds, **{key: summary[key] for key in keys}}
    print_table([row], list(row))
    return row


def decode_rows() -> list[dict]:
    tiny = load_config(ModelConfig, shipped_configs_dir() / "models" / "tiny.yaml")
    teacher = dataclasses.replace(tiny, vocab_size=384, max_seq_len=max(CONTEXTS), attention_impl="xla")
    linear = linearized_config(teacher, LinearizeConfig(window=16, feature_dim=4))
    rows = []
    for context in CONTEXTS:
        row = {"context": context}
        for name, config in (("teacher", teacher), ("linearized", linear)):
            row[f"{name}_ms_per_step"] = 1e3 * decode_step_seconds(config, context)
            row[f"{name}_cache_bytes_per_seq"] = cache_bytes_per_sequence(config, context)
        row["speedup"] = row["teacher_ms_per_step"] / row["linearized_ms_per_step"]
        row["cache_ratio"] = row["teacher_cache_bytes_per_seq"] / row["linearized_cache_bytes_per_seq"]
        rows.append(row)
    print_table(rows, list(rows[0]))
    return rows


def decode_step_seconds(config: ModelConfig, context: int) -> float:
    """Median seconds of one ragged step: ``SEQUENCES`` sequences each decoding its token
    ``context`` (pages holding the whole context for softmax layers)."""
    pages_per_seq = -(-context // config.page_size)
    has_pages = any("k_pages" in layer_state_shapes(config, kind, 1, 1) for kind in config.block_pattern)
    num_pages = SEQUENCES * pages_per_seq if has_pages else 1
    model = DecoderLM(config)
    tokens = jnp.zeros((1, SEQUENCES), jnp.int32)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    cache = {
        "page_table": jnp.arange(SEQUENCES * pages_per_seq, dtype=jnp.int32).reshape(SEQUENCES, pages_per_seq)
        % num_pages,
        "query_starts": jnp.arange(SEQUENCES, dtype=jnp.int32),
        "query_lens": jnp.ones(SEQUENCES, jnp.int32),
        "kv_lens": jnp.full(SEQUENCES, context, jnp.int32),
        "layers": init_cache_layers(config, SEQUENCES, num_pages),
    }
    step = jax.jit(lambda params, cache: model.apply({"params": params}, tokens, cache=cache), donate_argnums=1)
    state = {"cache": cache}

    def one_step():
        logits, state["cache"] = step(params, state["cache"])
        return logits

    return time_fn(one_step, warmup=2, repeats=10)


def cache_bytes_per_sequence(config: ModelConfig, context: int) -> int:
    """Cache bytes one sequence of ``context`` tokens holds: the pages it fills (softmax layers)
    plus its state slot (all other entries), over every layer."""
    pages = -(-context // config.page_size)
    dtype_bytes = jnp.dtype(config.policy.compute_dtype).itemsize
    total = 0
    for kind in config.layer_kinds:
        for name, shape in layer_state_shapes(config, kind, num_slots=1, num_pages=pages).items():
            total += int(np.prod(shape)) * (4 if name in FLOAT32_ENTRIES else dtype_bytes)
    return total


def main(argv=None) -> Path:
    return run_sections(
        "linearize", {"quality": quality_row, "decode": decode_rows}, "Linearising: teacher vs linearised", argv
    )


if __name__ == "__main__":
    main()

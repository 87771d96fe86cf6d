"""Sampling text from a trained model through the serving engine: the same ragged decode
step (chunked prefill, paged KV cache, per-sequence state slots) and the same on-device
sampler as ``ember generate``, so a training run's samples are what serving would produce.
Used at the end of a run to show what it learned.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ember.core.errors import ConfigError
from ember.core.tokenizer import ByteTokenizer
from ember.models.decoder import DecoderLM
from ember.serving.engine import Engine
from ember.serving.model_program import build_program
from ember.serving.program import DeviceProgram
from ember.serving.requests import SamplingParams
from ember.training.lm.config import SampleConfig

SAMPLE_TOKEN_BUDGET = 64
"""Tokens per engine step (one compiled bucket: prefill chunks and decodes share it)."""


def sample_text(model: DecoderLM, params: Any, tokenizer: ByteTokenizer, config: SampleConfig) -> list[str]:
    """One continuation of each prompt in ``config.prompts`` (ending at end-of-document, at
    ``config.max_tokens`` or at the model's ``max_seq_len``); prompt ``i`` samples with
    seed ``config.seed + i``. Raises ``ConfigError`` (a ``ValueError``) for a too long prompt."""
    prompts = encode_prompts(config.prompts, tokenizer, model.config.max_seq_len)
    engine = sampling_engine(model.config, params, tokenizer, len(prompts), max(map(len, prompts)) + config.max_tokens)
    settings = [
        SamplingParams(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            seed=config.seed + row,
        )
        for row in range(len(prompts))
    ]
    results = engine.generate(prompts, settings)
    errors = [f"prompt {row}: {r.error}" for row, r in enumerate(results) if r.error is not None]
    if errors:
        raise ValueError(f"cannot sample: {'; '.join(errors)}")
    return [r.text for r in results]


def encode_prompts(prompts: tuple[str, ...], tokenizer: Any, max_seq_len: int) -> list[list[int]]:
    """The token ids of ``sample.prompts``.

    Raises:
      ConfigError: a prompt has more tokens than ``max_seq_len`` (key ``sample.prompts``).
    """
    encoded = [[int(t) for t in tokenizer.encode(p)] for p in prompts]
    for row, tokens in enumerate(encoded):
        if len(tokens) > max_seq_len:
            raise ConfigError(
                f"sample.prompts[{row}] has {len(tokens)} tokens, more than the model's max_seq_len={max_seq_len}",
                key="sample.prompts",
            )
    return encoded


def sampling_engine(config: Any, params: Any, tokenizer: ByteTokenizer, num_prompts: int, longest: int) -> Engine:
    """The engine :func:`sample_text` runs on: a slot per prompt, one token bucket, the context
    the longest prompt plus its continuation needs (at most ``max_seq_len``). Its compiled
    steps are kept for later calls with parameters of the same shapes (a run samples
    periodically). The steps are compiled for one device, so sharded training parameters
    are gathered onto this process's first device (they must be addressable here:
    single-process runs)."""
    params = jax.device_put(params, jax.local_devices()[0])
    max_context = min(longest, config.max_seq_len)
    shapes = tuple((leaf.shape, str(leaf.dtype)) for leaf in jax.tree.leaves(params))
    key = (config, num_prompts, max_context, jax.tree.structure(params), shapes)
    if key not in _PROGRAMS:
        budget = max(num_prompts, SAMPLE_TOKEN_BUDGET)
        program = build_program(config, params, num_slots=num_prompts, token_buckets=(budget,), max_context=max_context)
        # Kept without buffers: each engine gets the parameters of its call and a fresh cache.
        kv_shapes = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), program.kv)
        _PROGRAMS.clear()  # one model per run: keep only the latest
        _PROGRAMS[key] = dataclasses.replace(program, params=None, kv=kv_shapes)
    return Engine(_PROGRAMS[key].fresh_copy(params), tokenizer=tokenizer)


_PROGRAMS: dict[Any, DeviceProgram] = {}


__all__ = ["encode_prompts", "sample_text", "sampling_engine"]

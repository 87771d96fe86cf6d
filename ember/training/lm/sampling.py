"""Sampling text from a trained model through the serving engine: the same ragged decode
step (chunked prefill, paged KV cache, per-sequence state slots) and the same on-device
sampler as ``ember generate``, so a training run's samples are what serving would produce.
Used at the end of a run to show what it learned.
"""

from __future__ import annotations

from typing import Any

from ember.core.tokenizer import ByteTokenizer
from ember.models.decoder import DecoderLM
from ember.serving.engine import Engine
from ember.serving.requests import SamplingParams
from ember.training.lm.config import SampleConfig

SAMPLE_TOKEN_BUDGET = 64
"""Tokens per engine step (one compiled bucket: prefill chunks and decodes share it)."""


def sample_text(model: DecoderLM, params: Any, tokenizer: ByteTokenizer, config: SampleConfig) -> list[str]:
    """One continuation of each prompt in ``config.prompts`` (ending at end-of-document, at
    ``config.max_tokens`` or at the model's ``max_seq_len``); prompt ``i`` samples with
    seed ``config.seed + i``. Raises ``ValueError`` for an empty or too long prompt."""
    prompts = [[int(t) for t in tokenizer.encode(p)] for p in config.prompts]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("sample.prompts must not contain empty strings")
    too_long = [row for row, p in enumerate(prompts) if len(p) > model.config.max_seq_len]
    if too_long:
        raise ValueError(f"sample.prompts[{too_long[0]}] has {len(prompts[too_long[0]])} tokens, more than the model's "
                         f"max_seq_len={model.config.max_seq_len}")
    engine = sampling_engine(model.config, params, tokenizer, len(prompts), max(map(len, prompts)) + config.max_tokens)
    settings = [
        SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, top_k=config.top_k,
                       top_p=config.top_p, seed=config.seed + row)
        for row in range(len(prompts))
    ]
    results = engine.generate(prompts, settings)
    errors = [f"prompt {row}: {r.error}" for row, r in enumerate(results) if r.error is not None]
    if errors:
        raise ValueError(f"cannot sample: {'; '.join(errors)}")
    return [r.text for r in results]


def sampling_engine(config: Any, params: Any, tokenizer: ByteTokenizer, num_prompts: int, longest: int) -> Engine:
    """The engine :func:`sample_text` runs on: a slot per prompt, one token bucket, the context
    the longest prompt plus its continuation needs (at most ``max_seq_len``)."""
    budget = max(num_prompts, SAMPLE_TOKEN_BUDGET)
    return Engine.from_model(config, params, tokenizer=tokenizer, num_slots=num_prompts, token_buckets=(budget,),
                             max_context=min(longest, config.max_seq_len))


__all__ = ["sample_text", "sampling_engine"]

"""Sampling text from a trained model through its decoding cache (prefill, then one jitted
``lax.scan`` of single-token decode steps). Used at the end of a run to show what it learned.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ember.core.tokenizer import ByteTokenizer
from ember.models.cache import init_cache
from ember.models.decoder import DecoderLM
from ember.training.lm.config import SampleConfig


def sample_text(model: DecoderLM, params: Any, tokenizer: ByteTokenizer, config: SampleConfig) -> list[str]:
    """One continuation of each prompt in ``config.prompts`` (cut at end-of-document)."""
    prompts = [tokenizer.encode(p) for p in config.prompts]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("sample.prompts must not contain empty strings")
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), lengths.max()), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    valid = (np.arange(tokens.shape[1])[None] < lengths[:, None]).astype(np.int32)
    cache = init_cache(model.config, len(prompts), int(lengths.max()) + config.max_tokens)
    generate = jax.jit(functools.partial(_generate, model=model, max_tokens=config.max_tokens,
                                         temperature=config.temperature, vocab=tokenizer.vocab_size))
    generated = np.asarray(generate(params, tokens, valid, lengths, cache, jax.random.key(config.seed)))
    texts = []
    for row in generated:
        ends = np.flatnonzero(row == tokenizer.eos_id)
        texts.append(tokenizer.decode(row[: ends[0]] if ends.size else row))
    return texts


def _generate(params, tokens, valid, lengths, cache, key, *, model, max_tokens, temperature, vocab):
    """``[batch, max_tokens]`` sampled ids after prompts ``tokens [batch, prompt_len]`` (padded
    at the end; ``valid`` marks real tokens, ``lengths`` counts them)."""
    logits, cache = model.apply({"params": params}, tokens, cache=cache, segment_ids=valid)
    last = logits[jnp.arange(tokens.shape[0]), lengths - 1]

    def step(carry, step_key):
        cache, logits = carry
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab, logits.astype(jnp.float32), -jnp.inf)
        if temperature > 0:
            token = jax.random.categorical(step_key, logits / temperature)
        else:
            token = jnp.argmax(logits, axis=-1)
        logits, cache = model.apply({"params": params}, token[:, None].astype(jnp.int32), cache=cache)
        return (cache, logits[:, 0]), token

    _, sampled = jax.lax.scan(step, (cache, last), jax.random.split(key, max_tokens))
    return sampled.T

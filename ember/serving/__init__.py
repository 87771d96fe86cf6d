"""Serving: the jitted engine, host-side scheduler, paged KV cache, sampling, export and
the batch-inference command (DESIGN.md section 7). Never imports ``ember.training``.

    from ember.serving import Engine, SamplingParams
    engine = Engine.from_model(config, params, tokenizer=ByteTokenizer(), num_slots=8)
    results = engine.generate(["Once upon a time"], SamplingParams(max_tokens=32))

Files: ``requests`` (SamplingParams, Request, results), ``sampling`` (on-device sampling),
``pages`` (page free list), ``scheduler`` (stall-free continuous batching), ``program``
(the compiled device side), ``model_program`` (it, built from a ``DecoderLM``), ``mesh``
(one model split tensor- and expert-parallel over several devices), ``replicas`` (several
engines of one model serving a batch together, data-parallel), ``engine`` (Engine),
``loading`` (run or Hugging Face directories), ``export`` (jax.export artifacts,
``ember export``), ``batch_io`` + ``cli`` (``ember generate``).
This package's ``__init__`` imports no model code, so artifacts serve without it.
"""

from ember.serving.engine import Engine
from ember.serving.requests import GenerationResult, SamplingParams, TokenEvent

__all__ = ["Engine", "GenerationResult", "SamplingParams", "TokenEvent"]

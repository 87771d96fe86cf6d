"""Builds a :class:`~ember.serving.program.DeviceProgram` from a ``DecoderLM``.

The step runs the model over a padded ``[rows, width]`` chunk through its paged cache
(rows are the engine's slots; a row's padding is marked 0 in ``segment_ids`` so it is
neither written nor attended to), takes each row's logits at its last valid token and
samples on device. Cache pages are donated and every width is compiled here, once.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from ember.models.cache import layer_state_shapes
from ember.models.config import SOFTMAX_FAMILY, ModelConfig
from ember.models.decoder import DecoderLM
from ember.serving.program import DeviceProgram, check_widths, step_argument_specs
from ember.serving.sampling import sample_tokens


def model_step(model: DecoderLM, params: Any, kv: Any, batch: dict[str, jax.Array], settings: dict[str, jax.Array]):
    """One serving step of ``model`` (the ``StepFunction`` signature of ``ember.serving.program``)."""
    tokens = batch["tokens"]
    rows, width = tokens.shape
    valid = jnp.arange(width)[None, :] < batch["counts"][:, None]
    cache = {"page_table": batch["page_table"], "lengths": batch["starts"], "layers": kv}
    logits, cache = model.apply({"params": params}, tokens, cache=cache, segment_ids=valid.astype(jnp.int32))
    last = jnp.maximum(batch["counts"] - 1, 0)
    last_logits = logits[jnp.arange(rows), last]  # [rows, vocab]
    next_tokens, logprobs = sample_tokens(last_logits, settings)
    return cache["layers"], next_tokens, logprobs


def init_pages(config: ModelConfig, num_pages: int, dtype: Any = None) -> dict[str, Any]:
    """An empty page pool: ``{"block_<j>": {"k_pages", "v_pages"}}``, each
    ``[groups, num_pages, page_size, kv_heads, head_dim]``."""
    unsupported = sorted(set(config.layer_kinds) - set(SOFTMAX_FAMILY))
    if unsupported:
        raise ValueError(
            f"the serving engine runs softmax-attention layers ({', '.join(SOFTMAX_FAMILY)}) only; this model "
            f"has {', '.join(unsupported)} layers, whose per-sequence state slots it does not manage yet"
        )
    dtype = config.policy.compute_dtype if dtype is None else dtype
    groups = math.ceil(config.num_layers / len(config.block_pattern))
    return {
        f"block_{j}": {
            name: jnp.zeros((groups, *shape), dtype)
            for name, shape in layer_state_shapes(config, kind, 1, num_pages).items()
        }
        for j, kind in enumerate(config.block_pattern)
    }


def jitted_step(config: ModelConfig):
    """The jitted ``model_step`` of ``DecoderLM(config)`` with the cache pages donated."""
    return jax.jit(functools.partial(model_step, DecoderLM(config)), donate_argnums=1)


def build_program(
    config: ModelConfig,
    params: Any,
    *,
    num_slots: int = 8,
    widths: tuple[int, ...] = (1, 32),
    max_context: int | None = None,
    num_pages: int | None = None,
    kv_dtype: Any = None,
) -> DeviceProgram:
    """Compiles the steps of ``DecoderLM(config)`` for every chunk width in ``widths``.

    Args:
      config, params: the model.
      num_slots: rows of every step (requests served at once).
      widths: chunk widths to compile; each step uses the smallest that fits its longest
        chunk, the largest is the scheduler's chunk size.
      max_context: longest sequence (prompt + output); default ``config.max_seq_len``.
      num_pages: pages in the pool; default enough for every slot at ``max_context``.
      kv_dtype: page dtype; default the model's compute dtype.
    """
    widths = check_widths(widths)
    if num_slots < 1:
        raise ValueError(f"num_slots must be positive, got {num_slots}")
    max_context = config.max_seq_len if max_context is None else max_context
    if not 1 <= max_context <= config.max_seq_len:
        raise ValueError(f"max_context must be in [1, max_seq_len={config.max_seq_len}], got {max_context}")
    pages_per_seq = math.ceil(max_context / config.page_size)
    num_pages = num_slots * pages_per_seq if num_pages is None else num_pages
    kv = init_pages(config, num_pages, kv_dtype)
    step = jitted_step(config)
    steps = {
        width: step.lower(*step_argument_specs(params, kv, num_slots, width, pages_per_seq)).compile()
        for width in widths
    }
    return DeviceProgram(
        steps=steps,
        params=params,
        kv=kv,
        num_slots=num_slots,
        pages_per_seq=pages_per_seq,
        page_size=config.page_size,
        num_pages=num_pages,
        vocab_size=config.vocab_size,
        max_context=max_context,
    )


__all__ = ["build_program", "init_pages", "jitted_step", "model_step"]

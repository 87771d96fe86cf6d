"""The decoding cache: an explicit pytree passed into ``DecoderLM.apply`` and returned.

    cache = init_cache(config, batch=4, max_len=256)
    logits, cache = model.apply({"params": params}, prompt_chunk, cache=cache)   # prefill
    logits, cache = model.apply({"params": params}, next_tokens, cache=cache)    # decode

Layout (the paged layout of ``ember.kernels_pallas.paged_attention``)::

    {
      "page_table": int32 [batch, pages_per_seq],   # page ids of each sequence, in order
      "lengths":    int32 [batch],                  # tokens already written per sequence
      "layers": {"block_<j>": state},               # one entry per block_pattern position;
    }                                               # every leaf has a leading [groups] axis

where layer ``i`` is ``block_<i % period>`` at group ``i // period`` (as in the parameters)
and ``state`` is, by layer kind:

- softmax family (global/local/block_sparse): ``k_pages``, ``v_pages``
  ``[num_pages, page_size, kv_heads, head_dim]``; token at position ``p`` of sequence ``b``
  lives in page ``page_table[b, p // page_size]``, slot ``p % page_size``.
- ``cca``: the same pages over the compressed latent heads, plus ``q_tail``/``k_tail``
  ``[batch, 2 * (conv_width - 1), latent]`` (the last pre-convolution inputs, so both causal
  sequence convolutions continue across calls) and ``v_prev [batch, latent_v]`` (the last
  value, for the value shift).
- ``linear``: ``state [batch, heads, feature_dim, head_dim + 1]`` (recurrent state with the
  normaliser column).

Pages are shared by all layers of a sequence (one page table). ``init_cache`` gives each
sequence its own contiguous run of pages; a serving engine may hand out pages differently,
any table works.

A serving step may instead pass a *ragged* cache: one flat token budget (tokens ``[1,
num_tokens]``) in which each sequence owns a contiguous run (a prefill chunk or a decode
token), described as in ``ember.kernels_pallas.ragged_paged_attention``::

    {"page_table": [seqs, pages_per_seq], "query_starts": [seqs], "query_lens": [seqs],
     "kv_lens": [seqs], "layers": ...}                                    # all int32

Layers see either form through :class:`Paging`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from ember.models.config import SOFTMAX_FAMILY, ModelConfig


@struct.dataclass
class Paging:
    """Where a cached call's tokens live in the paged cache (what a layer needs to write and
    read its pages).

    ``page_table``: int32 ``[seqs, pages_per_seq]``. A rectangular call (tokens ``[seqs,
    chunk]``, row ``b`` is sequence ``b``) sets only this. A ragged call (one flat budget,
    tokens ``[1, num_tokens]``) also sets ``query_starts``, ``query_lens``, ``kv_lens``
    (int32 ``[seqs]``, the arguments of ``ragged_paged_attention``: ``kv_lens`` counts the
    new tokens) and ``owner`` (int32 ``[num_tokens]``, the sequence of each token).
    """

    page_table: jax.Array
    query_starts: jax.Array | None = None
    query_lens: jax.Array | None = None
    kv_lens: jax.Array | None = None
    owner: jax.Array | None = None

    @property
    def ragged(self) -> bool:
        return self.query_starts is not None

    def token_page_rows(self) -> jax.Array:
        """``[num_tokens, pages_per_seq]``: each token's sequence's page-table row (ragged)."""
        return self.page_table[self.owner]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> dict[str, Any]:
    """An empty cache for ``batch`` sequences of up to ``max_len`` tokens.

    Args:
      config: the model's config.
      batch: number of sequences.
      max_len: the longest sequence the cache must hold (rounded up to whole pages).
      dtype: K/V storage dtype; default the config's compute dtype. Recurrent states are
        always float32.
    """
    if batch < 1 or max_len < 1:
        raise ValueError(f"init_cache: batch and max_len must be positive, got batch={batch}, max_len={max_len}")
    dtype = config.policy.compute_dtype if dtype is None else dtype
    pages_per_seq = math.ceil(max_len / config.page_size)
    num_pages = batch * pages_per_seq
    groups = math.ceil(config.num_layers / len(config.block_pattern))
    layers = {}
    for j, kind in enumerate(config.block_pattern):
        state = layer_state_shapes(config, kind, batch, num_pages)
        layers[f"block_{j}"] = {
            name: jnp.zeros((groups, *shape), jnp.float32 if name == "state" else dtype) for name, shape in state.items()
        }
    return {
        "page_table": jnp.arange(num_pages, dtype=jnp.int32).reshape(batch, pages_per_seq),
        "lengths": jnp.zeros((batch,), jnp.int32),
        "layers": layers,
    }


def layer_state_shapes(config: ModelConfig, kind: str, batch: int, num_pages: int) -> dict[str, tuple[int, ...]]:
    """The shapes of one layer's cache entries (without the leading ``[groups]`` axis)."""
    page_size = config.page_size
    if kind in SOFTMAX_FAMILY:
        pages = (num_pages, page_size, config.kv_heads, config.head_size)
        return {"k_pages": pages, "v_pages": pages}
    if kind == "cca":
        pages = (num_pages, page_size, config.cca_key_value_heads, config.cca_head_size)
        q_latent = config.cca_query_heads * config.cca_head_size
        kv_latent = config.cca_key_value_heads * config.cca_head_size
        tail = 2 * (config.cca_conv_width - 1)
        return {
            "k_pages": pages,
            "v_pages": pages,
            "q_tail": (batch, tail, q_latent),
            "k_tail": (batch, tail, kv_latent),
            "v_prev": (batch, kv_latent),
        }
    if kind == "linear":
        return {"state": (batch, config.num_heads, linear_feature_dim(config), config.head_size + 1)}
    raise ValueError(f"no cache layout for layer kind {kind!r}")


def linear_feature_dim(config: ModelConfig) -> int:
    """Width of the linear-attention feature map's output (Hedgehog doubles its projection)."""
    width = config.linear_feature_dim or config.head_size
    return 2 * width if config.linear_feature_map == "hedgehog" else config.head_size


def write_pages(pages: jax.Array, new: jax.Array, page_table: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """Writes ``new [batch, seq, heads, dim]`` at ``positions [batch, seq]`` into ``pages
    [num_pages, page_size, heads, dim]``; tokens with ``valid [batch, seq]`` False are dropped."""
    page_size = pages.shape[1]
    page_slot = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, page_slot, axis=1)
    # Invalid tokens get an out-of-range page id, which the scatter drops.
    page = jnp.where(valid, page, pages.shape[0])
    return pages.at[page, positions % page_size].set(new.astype(pages.dtype), mode="drop")


def read_pages(pages: jax.Array, page_table: jax.Array, positions: jax.Array) -> jax.Array:
    """The entries at ``positions [batch, length]`` (clipped into the sequence's pages):
    ``[batch, length, heads, dim]``. The caller masks positions that hold no token."""
    page_size = pages.shape[1]
    positions = jnp.clip(positions, 0, page_table.shape[1] * page_size - 1)
    page = jnp.take_along_axis(page_table, positions // page_size, axis=1)
    return pages[page, positions % page_size]


__all__ = ["Paging", "init_cache", "layer_state_shapes", "linear_feature_dim", "read_pages", "write_pages"]

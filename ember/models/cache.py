"""The decoding cache: an explicit pytree passed into ``DecoderLM.apply`` and returned.

There is one cached form, the *ragged* one of a serving step: one flat token budget
(tokens ``[1, num_tokens]``) in which each sequence owns a contiguous run (a prefill chunk
or a decode token), described as in ``ember.kernels_pallas.ragged_paged_attention``::

    layers = init_cache_layers(config, num_slots=4, num_pages=64)
    cache = {"page_table": [slots, pages_per_seq], "query_starts": [slots], "query_lens": [slots],
             "kv_lens": [slots], "layers": layers}                       # the four int32
    logits, cache = model.apply({"params": params}, flat_tokens[None], cache=cache)

Sequence ``s`` (a *slot*) owns row ``s`` of the page table and of every state slot.
``kv_lens[s]`` counts its tokens after the run, so the run starts at position ``kv_lens[s] -
query_lens[s]``; a run starting at position 0 begins a new sequence, and its layers start
from an empty state (the slot's old state is ignored), so a slot is reused without a reset.

``layers`` holds ``{"block_<j>": state}``, one entry per position in the layer period
(``config.layer_period``), every leaf with a leading ``[groups]`` axis (layer ``i`` is ``block_<i % period>`` at group
``i // period``, as in the parameters); ``state`` is, by layer kind:

- softmax family (global/local/block_sparse): ``k_pages``, ``v_pages``
  ``[num_pages, page_size, kv_heads, head_dim]``; token at position ``p`` of sequence ``s``
  lives in page ``page_table[s, p // page_size]``, slot ``p % page_size``.
- ``cca``: the same pages over the compressed latent heads, plus per-slot ``q_tail``/``k_tail``
  ``[num_slots, 2 * (conv_width - 1), latent]`` (the last pre-convolution inputs, so both
  causal sequence convolutions continue across steps) and ``v_prev [num_slots, latent_v]``
  (the last value, for the value shift).
- ``linear``: per-slot ``state [num_slots, heads, feature_dim, head_dim + 1]`` (float32
  recurrent state with the normaliser column).
- ``window_linear``: per-slot ``state [num_slots, heads, feature_dim, head_dim + 1]`` (float32,
  the keys that have left the window) and ``window_k``/``window_v [num_slots, sliding_window,
  kv_heads, head_dim]`` (the last ``sliding_window`` keys and values, newest last).
- ``mamba2``: per-slot ``conv_state [num_slots, conv_kernel - 1, conv_dim]`` (the last
  pre-convolution ``x, B, C`` inputs) and ``ssm_state [num_slots, ssm_heads, ssm_head_dim,
  state_size]`` (float32).

Pages are shared by all layers of a sequence (one page table); state slots are O(1) per
sequence. On a mesh each entry is split by its logical axes (:func:`layer_state_axes`).
Layers see the step's metadata through :class:`Paging`.

Inside ``DecoderLM`` the groups' pages of each block are one pool (:func:`fold_pages`:
``[groups * num_pages, ...]``, a reshape), and group ``g`` addresses its own part through a
page table offset by ``g * num_pages`` (:meth:`Paging.offset_pages`). The pool passes from
group to group whole, so a step writes only its new tokens' rows into the pool, in place, and
the attention kernel reads the pool where it lies: with a group's slice of the pages taken
and put back instead, XLA copied every layer's pages, all of them, twice a step (once into
the slice the kernel reads, once back into the stacked cache).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

from ember.models.config import SOFTMAX_FAMILY, ModelConfig

FLOAT32_ENTRIES: frozenset[str] = frozenset({"state", "ssm_state"})
"""Cache entries kept in float32 whatever the storage dtype: recurrent states accumulate."""

PAGE_ENTRIES: frozenset[str] = frozenset({"k_pages", "v_pages"})
"""Cache entries indexed by the page table (the rest are indexed by slot)."""


@struct.dataclass
class Paging:
    """Where a cached call's tokens live (tokens ``[1, num_tokens]``, one flat budget).

    ``page_table`` int32 ``[seqs, pages_per_seq]``; ``query_starts``, ``query_lens``,
    ``kv_lens`` int32 ``[seqs]`` (the arguments of ``ragged_paged_attention``: ``kv_lens``
    counts the new tokens); ``owner`` int32 ``[num_tokens]``, the sequence of each token
    (0 for padding tokens, which ``valid`` marks); ``adapters`` int32 ``[seqs]``, each
    sequence's adapter among the stacked ones a multi-adapter model carries (-1: none), or
    None (see ``ember.models.adapters.stacking``).
    """

    page_table: jax.Array
    query_starts: jax.Array
    query_lens: jax.Array
    kv_lens: jax.Array
    owner: jax.Array
    adapters: jax.Array | None = None

    def token_page_rows(self) -> jax.Array:
        """``[num_tokens, pages_per_seq]``: each token's sequence's page-table row."""
        return self.page_table[self.owner]

    def run_offsets(self) -> jax.Array:
        """``[num_tokens]``: each token's index within its sequence's run."""
        return jnp.arange(self.owner.shape[0]) - self.query_starts[self.owner]

    def token_adapters(self, valid: jax.Array) -> jax.Array | None:
        """``[1, num_tokens]``: each token's adapter (-1 for padding and for sequences
        without one), or None when the step names no adapters. ``valid [1, num_tokens]``."""
        if self.adapters is None:
            return None
        return jnp.where(valid, self.adapters[self.owner][None], -1)

    def offset_pages(self, offset: jax.Array | int) -> Paging:
        """This paging with every page id moved by ``offset``: group ``g`` of a pool of
        :func:`fold_pages` reads and writes its pages at ``offset = g * num_pages``."""
        return self.replace(page_table=self.page_table + offset)

    def fresh(self) -> jax.Array:
        """bool ``[seqs]``: the sequence's run starts at position 0 (a new sequence: its
        state slots are ignored and start empty)."""
        return (self.kv_lens == self.query_lens) & (self.query_lens > 0)


def init_cache_layers(config: ModelConfig, num_slots: int, num_pages: int, dtype: Any = None) -> dict[str, Any]:
    """The empty ``layers`` entry of a cache: pages for ``num_pages`` pages and state slots
    for ``num_slots`` sequences (see the module docstring).

    Args:
      config: the model's config.
      num_slots: sequences served at once (rows of the page table).
      num_pages: pages in the pool.
      dtype: K/V and convolution-tail storage dtype; default the config's compute dtype.
        Recurrent states (:data:`FLOAT32_ENTRIES`) are always float32.
    """
    if num_slots < 1 or num_pages < 1:
        raise ValueError(f"num_slots and num_pages must be positive, got num_slots={num_slots}, num_pages={num_pages}")
    dtype = config.policy.compute_dtype if dtype is None else _float_dtype(dtype)
    groups = math.ceil(config.num_layers / config.layer_period)
    return {
        f"block_{j}": {
            name: jnp.zeros((groups, *shape), jnp.float32 if name in FLOAT32_ENTRIES else dtype)
            for name, shape in layer_state_shapes(config, kind, num_slots, num_pages).items()
        }
        for j, kind in enumerate(config.layer_kinds[: config.layer_period])
    }


def _float_dtype(dtype: Any) -> jnp.dtype:
    """``dtype`` as a floating dtype, or a ``ValueError``: the attention kernels read the pages
    as values (an int8 cache would be attended as unscaled integers)."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"kv_dtype must be a floating dtype such as bfloat16 or float32, got {dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"kv_dtype must be a floating dtype such as bfloat16 or float32, got {dtype.name}")
    return dtype


def layer_state_shapes(config: ModelConfig, kind: str, num_slots: int, num_pages: int) -> dict[str, tuple[int, ...]]:
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
            "q_tail": (num_slots, tail, q_latent),
            "k_tail": (num_slots, tail, kv_latent),
            "v_prev": (num_slots, kv_latent),
        }
    linear_state = (num_slots, config.num_heads, linear_feature_dim(config), config.head_size + 1)
    if kind == "linear":
        return {"state": linear_state}
    if kind == "window_linear":
        window = (num_slots, config.sliding_window, config.kv_heads, config.head_size)
        return {"state": linear_state, "window_k": window, "window_v": window}
    if kind == "mamba2":
        ssm = config.ssm
        return {
            "conv_state": (num_slots, ssm.conv_kernel - 1, ssm.conv_dim(config.d_model)),
            "ssm_state": (num_slots, ssm.heads(config.d_model), ssm.head_dim, ssm.state_size),
        }
    raise ValueError(f"no cache layout for layer kind {kind!r}")


def layer_state_axes(kind: str) -> dict[str, tuple[str | None, ...]]:
    """The logical axes (``ember.core.sharding``) of one layer's cache entries, without the
    leading ``[groups]`` axis: each entry splits where the weights that write it do (pages and
    windows over their key heads, recurrent states over their heads, CCA's tails and previous
    value over the latent columns of the projections they hold); Mamba-2's convolution inputs,
    ``x``, ``B`` and ``C`` side by side, split along no axis."""
    pages = (None, None, "kv_heads", None)
    if kind in SOFTMAX_FAMILY:
        return {"k_pages": pages, "v_pages": pages}
    if kind == "cca":
        tails = {"q_tail": (None, None, "heads"), "k_tail": (None, None, "kv_heads"), "v_prev": (None, "kv_heads")}
        return {"k_pages": pages, "v_pages": pages, **tails}
    linear_state = (None, "heads", None, None)
    if kind == "linear":
        return {"state": linear_state}
    if kind == "window_linear":
        window = (None, None, "kv_heads", None)
        return {"state": linear_state, "window_k": window, "window_v": window}
    if kind == "mamba2":
        return {"conv_state": (None, None, None), "ssm_state": (None, "heads", None, None)}
    raise ValueError(f"no cache layout for layer kind {kind!r}")


def cache_layer_axes(config: ModelConfig) -> dict[str, Any]:
    """The logical axes of :func:`init_cache_layers`' leaves (a ``PartitionSpec`` of logical
    names per leaf, ``[groups]`` unsplit), for ``ember.core.sharding.tree_shardings``."""
    return {
        f"block_{j}": {name: PartitionSpec(None, *axes) for name, axes in layer_state_axes(kind).items()}
        for j, kind in enumerate(config.layer_kinds[: config.layer_period])
    }


def linear_feature_dim(config: ModelConfig) -> int:
    """Width of the linear-attention feature map's output (Hedgehog doubles its projection)."""
    width = config.linear_feature_dim or config.head_size
    return 2 * width if config.linear_feature_map == "hedgehog" else config.head_size


def fold_pages(layers: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(pools, slots)`` of a cache's ``layers``: per block, its :data:`PAGE_ENTRIES` with the
    groups folded into the pages (``[groups, num_pages, ...]`` -> ``[groups * num_pages, ...]``),
    and its other entries as they are. :func:`unfold_pages` undoes it."""
    pools, slots = {}, {}
    for block, state in layers.items():
        pools[block] = {name: leaf.reshape(-1, *leaf.shape[2:]) for name, leaf in state.items() if name in PAGE_ENTRIES}
        slots[block] = {name: leaf for name, leaf in state.items() if name not in PAGE_ENTRIES}
    return pools, slots


def unfold_pages(pools: dict[str, Any], slots: dict[str, Any], groups: int) -> dict[str, Any]:
    """The ``layers`` of a cache from :func:`fold_pages`' pools and slots (``groups`` groups)."""
    return {
        block: {**slots[block], **{name: leaf.reshape(groups, -1, *leaf.shape[1:]) for name, leaf in pool.items()}}
        for block, pool in pools.items()
    }


def write_pages(pages: jax.Array, new: jax.Array, paging: Paging, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """Writes ``new [num_tokens, heads, dim]`` at ``positions [num_tokens]`` of each token's
    own sequence into ``pages [num_pages, page_size, heads, dim]``; tokens with ``valid
    [num_tokens]`` False are dropped."""
    page_size = pages.shape[1]
    page_table = paging.page_table
    page_slot = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
    page = page_table[paging.owner, page_slot]
    # Invalid tokens get an out-of-range page id, which the scatter drops.
    page = jnp.where(valid, page, pages.shape[0])
    return pages.at[page, positions % page_size].set(new.astype(pages.dtype), mode="drop")


def run_history(
    flat: jax.Array, slots: jax.Array, paging: Paging, seqs: jax.Array, ends: jax.Array, length: int
) -> jax.Array:
    """Per item ``i``, the ``length`` inputs of sequence ``seqs[i]`` just before run offset
    ``ends[i]`` (offsets ``ends[i] - length .. ends[i] - 1``): from the step's budget ``flat
    [num_tokens, ...]`` inside the run, from the sequence's slot ``slots [seqs, >= length,
    ...]`` (its newest entries, last = offset -1) before it, zeros before a fresh sequence.

    Returns ``[items, length, ...]``. What causal convolutions and shifts need across steps.
    """
    held = slots.shape[1]
    slots = jnp.where(paging.fresh()[(slice(None),) + (None,) * (slots.ndim - 1)], 0, slots).astype(flat.dtype)
    offsets = ends[:, None] - length + jnp.arange(length)[None, :]  # [items, length]
    in_run = offsets >= 0
    token = jnp.clip(paging.query_starts[seqs][:, None] + offsets, 0, flat.shape[0] - 1)
    if held:
        from_slot = slots[seqs[:, None], jnp.clip(held + offsets, 0, held - 1)]
    else:  # an empty slot (a width-1 convolution keeps no inputs): a gather from it cannot be traced
        from_slot = jnp.zeros((*offsets.shape, *flat.shape[1:]), flat.dtype)
    mask = in_run.reshape(*in_run.shape, *(1,) * (flat.ndim - 1))
    return jnp.where(mask, flat[token], from_slot)


__all__ = [
    "FLOAT32_ENTRIES",
    "PAGE_ENTRIES",
    "Paging",
    "cache_layer_axes",
    "fold_pages",
    "init_cache_layers",
    "layer_state_axes",
    "layer_state_shapes",
    "linear_feature_dim",
    "run_history",
    "unfold_pages",
    "write_pages",
]

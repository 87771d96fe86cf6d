"""Paged decode attention: one new query token per sequence over a paged KV cache.

The cache stores keys and values in fixed-size pages shared by all sequences,
``k_pages``/``v_pages`` ``[num_pages, page_size, kv_heads, head_dim]``; sequence ``b`` owns
the pages ``page_table[b, :cdiv(lengths[b], page_size)]`` in order, so its token ``t`` lives
at ``k_pages[page_table[b, t // page_size], t % page_size]``.

The Pallas kernel is in :mod:`ember.kernels_pallas.paged_attention_kernel`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from ember.kernels_pallas.attention_math import check_soft_cap, check_window, masked_softmax, soft_cap
from ember.kernels_pallas.dispatch import resolve_impl
from ember.kernels_pallas.paged_attention_kernel import paged_attention_kernel


@dataclasses.dataclass(frozen=True)
class PagedCacheShape:
    """Validated sizes of a paged KV cache and its page table."""

    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    max_pages_per_seq: int

    @property
    def max_len(self) -> int:
        return self.max_pages_per_seq * self.page_size


def check_paged_cache(k_pages, v_pages, page_table, *, num_seqs: int, heads: int, head_dim: int) -> PagedCacheShape:
    """Checks the cache arrays against the query; raises ``ValueError`` naming the argument."""
    if getattr(k_pages, "ndim", None) != 4:
        raise ValueError(
            f"k_pages must have rank 4 [num_pages, page_size, kv_heads, head_dim], got shape {getattr(k_pages, 'shape', None)}"
        )
    if getattr(v_pages, "shape", None) != k_pages.shape:
        raise ValueError(f"v_pages must have the shape of k_pages {k_pages.shape}, got {getattr(v_pages, 'shape', None)}")
    num_pages, page_size, kv_heads, page_head_dim = k_pages.shape
    if page_head_dim != head_dim:
        raise ValueError(f"k_pages head_dim {page_head_dim} != q head_dim {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be divisible by k_pages kv_heads ({kv_heads})")
    if getattr(page_table, "ndim", None) != 2 or page_table.shape[0] != num_seqs:
        raise ValueError(
            f"page_table must have shape [{num_seqs}, max_pages_per_seq], got {getattr(page_table, 'shape', None)}"
        )
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page_table must be an integer array, got dtype {page_table.dtype}")
    return PagedCacheShape(num_pages, page_size, kv_heads, head_dim, page_table.shape[1])


def check_lengths(name: str, lengths, num_seqs: int) -> None:
    if getattr(lengths, "shape", None) != (num_seqs,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array of shape [{num_seqs}], got {getattr(lengths, 'shape', None)}")


def gather_sequence_kv(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """Each sequence's cache as one contiguous array:
    ``[num_seqs, max_pages_per_seq * page_size, kv_heads, head_dim]``."""
    per_page = pages[page_table]  # [num_seqs, max_pages_per_seq, page_size, kv_heads, head_dim]
    num_seqs, max_pages, page_size = per_page.shape[:3]
    return per_page.reshape(num_seqs, max_pages * page_size, *pages.shape[2:])


def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window: tuple[int, int] | None = None,
) -> jax.Array:
    """Plain-jnp :func:`paged_attention` (same arguments, minus the kernel options): gathers
    each sequence's pages into a contiguous ``[batch, max_len, kv_heads, head_dim]`` cache and
    attends densely in float32. Returns ``[batch, heads, head_dim]`` in ``q.dtype``."""
    batch, heads, head_dim = _check_query(q)
    cache = check_paged_cache(k_pages, v_pages, page_table, num_seqs=batch, heads=heads, head_dim=head_dim)
    check_lengths("lengths", lengths, batch)
    logits_soft_cap = check_soft_cap(logits_soft_cap)
    window = check_window(window)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    group = heads // cache.kv_heads
    keys = gather_sequence_kv(k_pages, page_table).astype(jnp.float32)
    values = gather_sequence_kv(v_pages, page_table).astype(jnp.float32)
    q32 = q.astype(jnp.float32).reshape(batch, cache.kv_heads, group, head_dim)
    logits = soft_cap(jnp.einsum("bhgd,bkhd->bhgk", q32, keys) * scale, logits_soft_cap)
    kv_pos = jnp.arange(cache.max_len)[None, :]
    query_pos = lengths[:, None] - 1
    visible = kv_pos <= query_pos
    if window is not None:
        visible = visible & (kv_pos >= query_pos - window[0])
    weights = masked_softmax(logits, visible[:, None, None, :])
    out = jnp.einsum("bhgk,bkhd->bhgd", weights, values)
    return out.reshape(batch, heads, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "logits_soft_cap", "window", "pages_per_block", "impl"))
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window: tuple[int, int] | None = None,
    pages_per_block: int | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Decode attention: each sequence's single new query attends to its whole cached prefix.

    The new token's own key and value must already be written into the cache (the model
    layer writes them before calling), so ``lengths`` counts it: sequence ``b``'s query sits
    at position ``lengths[b] - 1`` and sees cache positions ``0 .. lengths[b] - 1``.

    Args:
      q: ``[batch, heads, head_dim]``, one query token per sequence.
      k_pages, v_pages: ``[num_pages, page_size, kv_heads, head_dim]``, the paged cache;
        ``heads % kv_heads == 0`` (GQA: query head ``h`` reads key head
        ``h // (heads // kv_heads)``).
      page_table: int32 ``[batch, max_pages_per_seq]``; entry ``[b, i]`` is the page holding
        sequence ``b``'s tokens ``i*page_size .. (i+1)*page_size - 1``. Entries past
        ``cdiv(lengths[b], page_size)`` are never read (any in-range value, e.g. 0).
      lengths: int32 ``[batch]``, tokens in each sequence's cache including the new one;
        ``0 <= lengths[b] <= max_pages_per_seq * page_size``. A sequence of length 0 (an
        empty batch slot) returns zeros.
      sm_scale: multiplies ``q.k``; default ``1 / sqrt(head_dim)``.
      logits_soft_cap: if set, scaled logits become ``cap * tanh(logits / cap)``.
      window: ``(left, right)`` as in :func:`flash_attention`: the query at position ``p``
        sees keys ``p - left .. p``; ``right`` has no effect (the cache holds no later token).
      pages_per_block: pages the kernel reads per step (default: enough for 128 tokens,
        at least 1).
      impl: ``"auto"``, ``"pallas"``, ``"interpret"`` or ``"xla"``
        (:func:`paged_attention_reference`).

    Jitted; the keyword options are static, ``page_table`` and ``lengths`` are data.

    Returns:
      ``[batch, heads, head_dim]`` in ``q.dtype``.

    Raises:
      ValueError: naming the argument, for bad ranks, shapes or dtypes.
    """
    batch, heads, head_dim = _check_query(q)
    cache = check_paged_cache(k_pages, v_pages, page_table, num_seqs=batch, heads=heads, head_dim=head_dim)
    check_lengths("lengths", lengths, batch)
    check_soft_cap(logits_soft_cap)
    check_window(window)
    resolved = resolve_impl(impl, op="paged_attention", kernel_backends=("gpu",))  # written for the GPU (Triton) lowering
    if resolved == "xla":
        return paged_attention_reference(
            q, k_pages, v_pages, page_table, lengths,
            sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, window=window,
        )
    return paged_attention_kernel(
        q, k_pages, v_pages, page_table, lengths, cache=cache,
        sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale),
        logits_soft_cap=check_soft_cap(logits_soft_cap), window=check_window(window),
        pages_per_block=pages_per_block, interpret=resolved == "interpret",
    )


def _check_query(q) -> tuple[int, int, int]:
    if getattr(q, "ndim", None) != 3:
        raise ValueError(f"q must have rank 3 [batch, heads, head_dim], got shape {getattr(q, 'shape', None)}")
    return q.shape

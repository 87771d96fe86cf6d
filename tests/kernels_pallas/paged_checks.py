"""Random paged KV caches for the paged / ragged-paged attention tests."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(
    jax.jit,
    static_argnames=("num_pages", "page_size", "kv_heads", "head_dim", "num_seqs", "max_pages_per_seq", "dtype"),
)
def random_paged_cache(rng, *, num_pages, page_size, kv_heads, head_dim, num_seqs, max_pages_per_seq, dtype=jnp.float32):
    """``(k_pages, v_pages [num_pages, page_size, kv_heads, head_dim], page_table [num_seqs,
    max_pages_per_seq] int32)``; the table holds distinct pages in random order."""
    kk, kv, kt = jax.random.split(rng, 3)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_pages = jax.random.normal(kk, shape, dtype)
    v_pages = jax.random.normal(kv, shape, dtype)
    pages = jax.random.permutation(kt, num_pages)[: num_seqs * max_pages_per_seq]
    return k_pages, v_pages, pages.reshape(num_seqs, max_pages_per_seq).astype(jnp.int32)


def contiguous_cache(pages, page_table, seq: int, length: int) -> np.ndarray:
    """Sequence ``seq``'s first ``length`` cached tokens ``[length, kv_heads, head_dim]``,
    read page by page with NumPy (independent of the ops' own gather)."""
    pages, page_table = np.asarray(pages), np.asarray(page_table)
    page_size = pages.shape[1]
    rows = [pages[page_table[seq, t // page_size], t % page_size] for t in range(length)]
    return np.stack(rows) if rows else np.zeros((0, *pages.shape[2:]), pages.dtype)

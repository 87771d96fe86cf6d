"""Random paged KV caches for the ragged paged attention tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.host_random import numpy_rng


def random_paged_cache(
    rng, *, num_pages, page_size, kv_heads, head_dim, num_seqs, max_pages_per_seq, dtype=jnp.float32
):
    """``(k_pages, v_pages [num_pages, page_size, kv_heads, head_dim], page_table [num_seqs,
    max_pages_per_seq] int32)``; the table holds distinct pages in random order."""
    gen = numpy_rng(rng)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_pages, v_pages = (jnp.asarray(gen.standard_normal(shape, dtype=np.float32), dtype) for _ in range(2))
    pages = gen.permutation(num_pages)[: num_seqs * max_pages_per_seq]
    return k_pages, v_pages, jnp.asarray(pages.reshape(num_seqs, max_pages_per_seq), jnp.int32)


def random_normal(rng, shape, dtype=jnp.float32) -> jax.Array:
    """Standard normal ``shape`` in ``dtype``, drawn on the host from ``rng``."""
    return jnp.asarray(numpy_rng(rng).standard_normal(shape, dtype=np.float32), dtype)


def contiguous_cache(pages, page_table, seq: int, length: int) -> np.ndarray:
    """Sequence ``seq``'s first ``length`` cached tokens ``[length, kv_heads, head_dim]``,
    read page by page with NumPy (independent of the ops' own gather)."""
    pages, page_table = np.asarray(pages), np.asarray(page_table)
    page_size = pages.shape[1]
    rows = [pages[page_table[seq, t // page_size], t % page_size] for t in range(length)]
    return np.stack(rows) if rows else np.zeros((0, *pages.shape[2:]), pages.dtype)

"""Multi-head attention (MHA / GQA / MQA) with causal, sliding-window and local+global masks,
softmax or sigmoid scores, optional QK-norm and logit soft-cap, over an optional paged cache.

The score math is in ``ember.kernels_pallas``; this file decides what the kernels see.
Without a cache: ``flash_attention`` over the sequence with a causal mask. With a cache the
chunk's keys and values are written into the pages first; then a single-token softmax
decode (global or local) calls ``paged_attention`` on the pages in place, and any other
chunk attends with ``flash_attention`` over a window of keys read back from the pages,
laid out so that a *static* mask expresses causality at any (per-row, traced) offset:

    key index t of row b  <->  position  start_b - d + t      (start_b = positions[b, 0])
    query index i         <->  position  start_b + i

so key ``t`` is causally visible from query ``i`` iff ``t <= i + d`` (the kernel's
``window=(left, d)``; a sliding window of ``W`` tokens sets ``left = W - 1 - d``). Keys at
negative positions are masked with kv segment ids.

A ragged cache (a serving step's flat budget of prefill chunks and decode tokens, see
``ember.models.cache.Paging``) writes each token's key and value into its own sequence's
pages and calls ``ragged_paged_attention`` on the pages in place.

Sigmoid scores use the kernel's bias ``-log(kv_len)``; to make it one constant per model
(``-log(max_seq_len)``, the sigmoid-attention paper's ``-log n`` for the training context)
rather than a function of the chunk, keys are padded (masked) to ``max_seq_len``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.sharding import constrain
from ember.kernels_pallas.attention_math import default_sigmoid_bias
from ember.kernels_pallas.block_mask import LocalGlobalMask
from ember.kernels_pallas.flash_attention import flash_attention
from ember.kernels_pallas.paged_attention import paged_attention
from ember.kernels_pallas.ragged_paged_attention import ragged_paged_attention
from ember.models.cache import Paging, read_pages, write_pages
from ember.models.config import SOFTMAX_FAMILY, ModelConfig
from ember.models.layers.norm import RMSNorm
from ember.models.layers.projection import Projection
from ember.models.layers.rope import apply_rope, rope_inverse_frequencies

_NO_KEY = -1
"""kv segment id of a masked key: never equal to a query's segment id (queries use >= 0)."""


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    config: ModelConfig,
    kind: str,
    segment_ids: jax.Array | None = None,
    pages: dict[str, jax.Array] | None = None,
    paging: Paging | None = None,
    positions: jax.Array | None = None,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """Causal attention of ``kind`` for one layer, with or without a paged KV cache.

    Args:
      q: ``[batch, seq, heads, head_dim]`` (rotary embedding already applied).
      k, v: ``[batch, seq, kv_heads, head_dim]``.
      config: supplies window, global tokens, score, soft-cap, ``max_seq_len`` and impl.
      kind: ``global``, ``local`` or ``block_sparse``.
      segment_ids: without a cache, packed-document ids ``[batch, seq]`` (>= 0); a
        ``block_sparse`` layer then takes each document's first ``global_tokens`` tokens
        (by ``positions``, which restart at each document) as its global ones.
      pages: ``{"k_pages", "v_pages"}`` of this layer (see ``ember.models.cache``), or None.
      paging, positions, valid: with ``pages``: where the tokens live (rectangular or
        ragged, see ``ember.models.cache.Paging``), their positions ``[batch, seq]``
        (contiguous within a row or a ragged run) and ``[batch, seq]`` bool (False for
        padding tokens, which are neither written nor attended to).

    Returns:
      ``(out [batch, seq, heads, head_dim], updated pages or None)``.
    """
    if kind not in SOFTMAX_FAMILY:
        raise ValueError(f"attend: kind must be one of {', '.join(SOFTMAX_FAMILY)}, got {kind!r}")
    options = dict(
        logits_soft_cap=config.attn_soft_cap or None,
        score=config.score,
        impl=config.attention_impl,
    )
    if pages is None:
        out = _attend_sequence(
            q, k, v, config=config, kind=kind, segment_ids=segment_ids, positions=positions, options=options
        )
        return out, None
    if paging.ragged:
        return _attend_ragged(q, k, v, pages, config=config, kind=kind, paging=paging, positions=positions, valid=valid, options=options)
    page_table = paging.page_table
    pages = {
        "k_pages": write_pages(pages["k_pages"], k, page_table, positions, valid),
        "v_pages": write_pages(pages["v_pages"], v, page_table, positions, valid),
    }
    if q.shape[1] == 1 and kind in ("global", "local") and config.score == "softmax":
        # Decode: the paged kernel reads the pages in place (no gather of the prefix).
        lengths = jnp.where(valid[:, 0], positions[:, 0] + 1, 0).astype(jnp.int32)
        window = (config.sliding_window - 1, 0) if kind == "local" else None
        out = paged_attention(
            q[:, 0], pages["k_pages"], pages["v_pages"], page_table, lengths, window=window,
            logits_soft_cap=options["logits_soft_cap"], impl=options["impl"],
        )
        return out[:, None], pages
    return _attend_pages(q, pages, config=config, kind=kind, page_table=page_table, positions=positions, valid=valid, options=options), pages


def _attend_ragged(q, k, v, pages, *, config, kind, paging, positions, valid, options):
    """A flat token budget ``[1, num_tokens, ...]``: every token's key and value go to its
    own sequence's pages, then ``ragged_paged_attention`` reads the pages in place."""
    token_rows = paging.token_page_rows()
    token_positions, token_valid = positions[0][:, None], valid[0][:, None]

    def write(name, new):
        return write_pages(pages[name], new[0][:, None], token_rows, token_positions, token_valid)

    pages = {"k_pages": write("k_pages", k), "v_pages": write("v_pages", v)}
    score_options: dict[str, Any] = dict(logits_soft_cap=options["logits_soft_cap"], impl=options["impl"])
    if config.score == "sigmoid":
        # The bias of the uncached pass, whose keys are padded to max_seq_len.
        score_options.update(score="sigmoid", sigmoid_bias=default_sigmoid_bias(config.max_seq_len))
    if kind == "block_sparse":
        score_options["global_tokens"] = config.global_tokens
    out = ragged_paged_attention(
        q[0], pages["k_pages"], pages["v_pages"], paging.page_table, paging.query_starts, paging.query_lens,
        paging.kv_lens, window=None if kind == "global" else (config.sliding_window - 1, 0), **score_options,
    )
    return out[None], pages


def _attend_sequence(q, k, v, *, config, kind, segment_ids, positions, options) -> jax.Array:
    batch, seq = q.shape[:2]
    window = (config.sliding_window - 1, 0) if kind == "local" else None
    block_mask = LocalGlobalMask(config.sliding_window - 1, 0, config.global_tokens) if kind == "block_sparse" else None
    # Packed documents: global tokens are each document's first ones (the kernel keeps the
    # blocks holding them live per row); an unpacked row keeps the static index-based mask.
    segment_positions = positions if kind == "block_sparse" and segment_ids is not None else None
    if config.score == "sigmoid" and seq < config.max_seq_len:
        pad = config.max_seq_len - seq
        k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
        q_segments = jnp.zeros((batch, seq), jnp.int32) if segment_ids is None else segment_ids
        segment_ids = (q_segments, jnp.pad(q_segments, ((0, 0), (0, pad)), constant_values=_NO_KEY))
        if segment_positions is not None:
            segment_positions = (segment_positions, jnp.pad(segment_positions, ((0, 0), (0, pad))))
    return flash_attention(
        q, k, v, causal=True, window=window, block_mask=block_mask, segment_ids=segment_ids,
        segment_positions=segment_positions, **options,
    )


def _attend_pages(q, pages, *, config, kind, page_table, positions, valid, options) -> jax.Array:
    batch, seq = q.shape[:2]
    capacity = page_table.shape[1] * pages["k_pages"].shape[1]
    start = positions[:, :1]
    keys = capacity if kind == "global" else config.sliding_window - 1 + seq
    offset = keys - seq  # d: key t of a row sits at position start - d + t
    key_positions = start - offset + jnp.arange(keys)[None, :]
    if config.score == "sigmoid":
        if keys > config.max_seq_len:
            raise ValueError(
                f"score='sigmoid' needs the cache to hold at most max_seq_len={config.max_seq_len} tokens "
                f"(the sigmoid bias is -log(max_seq_len)), got room for {keys}"
            )
        # Masked keys appended at the end fix kv_len (hence the bias) at max_seq_len.
        padding = jnp.full((batch, config.max_seq_len - keys), -1, key_positions.dtype)
        key_positions = jnp.concatenate([key_positions, padding], axis=1)
    key_valid = key_positions >= 0
    # Key t is visible from query i iff  i + d - left' <= t <= i + d  with left' the window.
    left = keys if kind == "global" else config.sliding_window - 1 - offset
    attention_kwargs: dict[str, Any] = dict(window=(left, offset))
    if kind == "block_sparse":
        q, key_positions, key_valid, attention_kwargs = _with_global_prefix(q, key_positions, key_valid, start, config, seq)
    q_segments = valid.astype(jnp.int32)
    if kind == "block_sparse":
        q_segments = jnp.concatenate([jnp.zeros((batch, config.global_tokens), jnp.int32), q_segments], axis=1)
    kv_segments = jnp.where(key_valid, 1, _NO_KEY).astype(jnp.int32)
    k = read_pages(pages["k_pages"], page_table, key_positions)
    v = read_pages(pages["v_pages"], page_table, key_positions)
    out = flash_attention(q, k.astype(q.dtype), v.astype(q.dtype), segment_ids=(q_segments, kv_segments), **attention_kwargs, **options)
    return out[:, -seq:]


def _with_global_prefix(q, key_positions, key_valid, start, config, seq):
    """Local + global with a cache: keys ``[global 0..G-1 | local window]`` and queries
    front-padded by ``G`` dummy rows, so the kernel's ``LocalGlobalMask`` (global by
    *index*) expresses "every query sees the first G positions" (global by *position*).

    A global position before the chunk is read in the prefix and masked in the window;
    one inside the chunk is read in the window only. Exact while the chunk is at most
    ``sliding_window`` tokens long (checked by the caller).
    """
    batch = q.shape[0]
    num_global = config.global_tokens
    if config.score == "sigmoid":
        raise ValueError(
            "block_sparse layers with score='sigmoid' cannot use a cache: the kernel's sigmoid bias "
            "-log(kv_len) would differ from the uncached pass"
        )
    if seq > config.sliding_window:
        raise ValueError(
            f"block_sparse layers take cached chunks of at most sliding_window={config.sliding_window} "
            f"tokens, got {seq}; split the prefill into smaller chunks"
        )
    global_positions = jnp.broadcast_to(jnp.arange(num_global)[None, :], (batch, num_global))
    global_valid = global_positions < start
    window_valid = key_valid & ~((key_positions < num_global) & (key_positions < start))
    q = jnp.concatenate([jnp.zeros((batch, num_global, *q.shape[2:]), q.dtype), q], axis=1)
    mask = LocalGlobalMask(0, config.sliding_window - 1, num_global)
    return (
        q,
        jnp.concatenate([global_positions, key_positions], axis=1),
        jnp.concatenate([global_valid, window_valid], axis=1),
        dict(block_mask=mask),
    )


class Attention(nn.Module):
    """Self-attention of one layer: ``x [batch, seq, embed] -> [batch, seq, embed]``.

    Parameters: ``q/kernel [embed, heads, head_dim]``, ``k/kernel`` and ``v/kernel``
    ``[embed, kv_heads, head_dim]`` (``bias`` with ``qkv_bias``), ``o/kernel
    [heads, head_dim, embed]``, and ``q_norm``/``k_norm`` (``[head_dim]``) with ``qk_norm``.
    """

    config: ModelConfig
    kind: str = "global"

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array | None = None,
        pages: dict[str, jax.Array] | None = None,
        paging: Paging | None = None,
        valid: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        config = self.config
        policy = config.policy
        heads, kv_heads, head_dim = config.num_heads, config.kv_heads, config.head_size

        def projection(name, features, axes):
            return Projection(
                features, ("embed", *axes), use_bias=config.qkv_bias, init_std=config.init_std,
                dtype=policy.compute_dtype, param_dtype=policy.param_dtype, name=name,
            )

        q = projection("q", (heads, head_dim), ("heads", "head_dim"))(x)
        k = projection("k", (kv_heads, head_dim), ("kv_heads", "head_dim"))(x)
        v = projection("v", (kv_heads, head_dim), ("kv_heads", "head_dim"))(x)
        if config.qk_norm:
            q = RMSNorm(config.norm_eps, "head_dim", policy.param_dtype, name="q_norm")(q)
            k = RMSNorm(config.norm_eps, "head_dim", policy.param_dtype, name="k_norm")(k)
        inv_freq = rope_inverse_frequencies(head_dim, config.rope)
        q = constrain(apply_rope(q, positions, inv_freq), ("batch", "seq", "heads", "head_dim"))
        k = constrain(apply_rope(k, positions, inv_freq), ("batch", "seq", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        out, pages = attend(
            q, k, v, config=config, kind=self.kind, segment_ids=segment_ids,
            pages=pages, paging=paging, positions=positions, valid=valid,
        )
        out = Projection(
            (x.shape[-1],), ("heads", "head_dim", "embed"), in_dims=2, init_std=config.init_std,
            dtype=policy.compute_dtype, param_dtype=policy.param_dtype, name="o",
        )(out)
        return out, pages

"""Multi-head attention (MHA / GQA / MQA) with causal, sliding-window and local+global masks,
softmax or sigmoid scores, optional QK-norm and logit soft-cap, over an optional paged cache.

The score math is in ``ember.kernels_pallas``; this file decides what the kernels see.
Without a cache: ``flash_attention`` over the sequence with a causal mask. With a cache (a
serving step's flat budget of prefill chunks and decode tokens, see
``ember.models.cache.Paging``) each token's key and value are written into its own
sequence's pages, then ``ragged_paged_attention`` reads the pages in place.

Sigmoid scores use the kernel's bias ``-log(kv_len)``; to make it one constant per model
(``-log(max_seq_len)``, the sigmoid-attention paper's ``-log n`` for the training context)
rather than a function of the chunk, keys are padded (masked) to ``max_seq_len`` without a
cache, and the cached path passes that bias explicitly.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.sharding import constrain
from ember.kernels_pallas.attention_math import default_sigmoid_bias
from ember.kernels_pallas.block_mask import LocalGlobalMask
from ember.kernels_pallas.flash_attention import KERNEL_BACKENDS as FLASH_KERNEL_BACKENDS
from ember.kernels_pallas.flash_attention import flash_attention
from ember.kernels_pallas.ragged_paged_attention import ragged_paged_attention
from ember.models.cache import Paging, write_pages
from ember.models.config import SOFTMAX_FAMILY, ModelConfig
from ember.models.layers.kernel_shards import per_head_group_shard, runs_per_shard
from ember.models.layers.norm import RMSNorm
from ember.models.layers.projection import Projection, model_projection
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
      paging, positions, valid: with ``pages`` (then ``batch`` is 1, one flat token budget):
        where the tokens live (see ``ember.models.cache.Paging``), their positions ``[1,
        num_tokens]`` and ``[1, num_tokens]`` bool (False for padding tokens, which are
        neither written nor attended to).

    Returns:
      ``(out [batch, seq, heads, head_dim], updated pages or None)``.
    """
    if kind not in SOFTMAX_FAMILY:
        raise ValueError(f"attend: kind must be one of {', '.join(SOFTMAX_FAMILY)}, got {kind!r}")
    options = dict(
        sm_scale=config.attn_scale or None,
        logits_soft_cap=config.attn_soft_cap or None,
        score=config.score,
        impl=config.attention_impl,
    )
    if pages is None:
        out = _attend_sequence(
            q, k, v, config=config, kind=kind, segment_ids=segment_ids, positions=positions, options=options
        )
        return out, None
    return _attend_ragged(
        q, k, v, pages, config=config, kind=kind, paging=paging, positions=positions, valid=valid, options=options
    )


def _attend_ragged(q, k, v, pages, *, config, kind, paging, positions, valid, options):
    """A flat token budget ``[1, num_tokens, ...]``: every token's key and value go to its
    own sequence's pages, then ``ragged_paged_attention`` reads the pages in place."""

    def write(name, new):
        return write_pages(pages[name], new[0], paging, positions[0], valid[0])

    pages = {"k_pages": write("k_pages", k), "v_pages": write("v_pages", v)}
    score_options: dict[str, Any] = dict(
        sm_scale=options["sm_scale"], logits_soft_cap=options["logits_soft_cap"], impl=options["impl"]
    )
    if config.score == "sigmoid":
        # The bias of the uncached pass, whose keys are padded to max_seq_len.
        score_options.update(score="sigmoid", sigmoid_bias=default_sigmoid_bias(config.max_seq_len))
    if kind == "block_sparse":
        score_options["global_tokens"] = config.global_tokens
    window = None if kind == "global" else (config.sliding_window - 1, 0)

    def attention(q, k_pages, v_pages, page_table, query_starts, query_lens, kv_lens):
        return ragged_paged_attention(
            q, k_pages, v_pages, page_table, query_starts, query_lens, kv_lens, window=window, **score_options
        )

    # Under a tensor-parallel mesh each device attends with the key heads of the pages it holds
    # (the page writes above are XLA's, which partitions them), whatever the impl: XLA's own
    # partitioning of its path, on a mesh wider than the key heads (tensor=4, 2 key heads), split the
    # query heads and gathered every layer's whole page pool onto each device at every step.
    out = per_head_group_shard(
        attention,
        (
            q[0],
            pages["k_pages"],
            pages["v_pages"],
            paging.page_table,
            paging.query_starts,
            paging.query_lens,
            paging.kv_lens,
        ),
        ("sh.", "..h.", "..h.", "..", ".", ".", "."),
        out_layout="sh.",
        groups=k.shape[2],
        kernel=True,
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

    def attention(q, k, v, segment_ids, segment_positions):
        return flash_attention(
            q,
            k,
            v,
            causal=True,
            window=window,
            block_mask=block_mask,
            segment_ids=segment_ids,
            segment_positions=segment_positions,
            **options,
        )

    kernel = runs_per_shard(options["impl"], op="flash_attention", kernel_backends=FLASH_KERNEL_BACKENDS)
    return per_head_group_shard(
        attention,
        (q, k, v, segment_ids, segment_positions),
        ("bsh.", "bsh.", "bsh.", "bs", "bs"),
        out_layout="bsh.",
        groups=k.shape[2],
        kernel=kernel,
    )


def rotary_qkv(
    config: ModelConfig, x: jax.Array, positions: jax.Array, adapter_ids: jax.Array | None, kind: str = "global"
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The ``q``, ``k``, ``v`` projections of ``x [batch, seq, embed]`` (submodules ``q``, ``k``,
    ``v`` and, with ``qk_norm``, ``q_norm``/``k_norm`` of the calling module), a ``kind`` layer's
    rotary embedding applied (``ModelConfig.rope_of``): ``q [batch, seq, heads, head_dim]``,
    ``k``/``v [batch, seq, kv_heads, head_dim]``."""
    policy = config.policy
    heads, kv_heads, head_dim = config.num_heads, config.kv_heads, config.head_size

    def projection(name, features, axes):
        return model_projection(config, features, ("embed", *axes), use_bias=config.qkv_bias, name=name)(x, adapter_ids)

    q = projection("q", (heads, head_dim), ("heads", "head_dim"))
    k = projection("k", (kv_heads, head_dim), ("kv_heads", "head_dim"))
    v = projection("v", (kv_heads, head_dim), ("kv_heads", "head_dim"))
    if config.qk_norm:
        q = RMSNorm(config.norm_eps, "head_dim", policy.param_dtype, name="q_norm")(q)
        k = RMSNorm(config.norm_eps, "head_dim", policy.param_dtype, name="k_norm")(k)
    inv_freq = rope_inverse_frequencies(head_dim, config.rope_of(kind))
    q = constrain(apply_rope(q, positions, inv_freq), ("batch", "seq", "heads", "head_dim"))
    k = constrain(apply_rope(k, positions, inv_freq), ("batch", "seq", "kv_heads", "head_dim"))
    return q, k, constrain(v, ("batch", "seq", "kv_heads", "head_dim"))


def output_projection(config: ModelConfig, embed: int, name: str = "o") -> Projection:
    """The ``[batch, seq, heads, head_dim] -> [batch, seq, embed]`` projection (a submodule
    ``name`` of the calling module); apply it as ``(out, adapter_ids)``."""
    return model_projection(config, (embed,), ("heads", "head_dim", "embed"), in_dims=2, name=name)


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
        adapter_ids = None if paging is None else paging.token_adapters(valid)
        q, k, v = rotary_qkv(self.config, x, positions, adapter_ids, self.kind)
        out, pages = attend(
            q,
            k,
            v,
            config=self.config,
            kind=self.kind,
            segment_ids=segment_ids,
            pages=pages,
            paging=paging,
            positions=positions,
            valid=valid,
        )
        return output_projection(self.config, x.shape[-1])(out, adapter_ids), pages

"""Compressed Convolutional Attention (CCA) and its grouped-query form (CCGQA).

Figliolia et al., 2025 ("Compressed Convolutional Attention: Efficient Attention in a
Compressed Latent Space"). Queries, keys and values are down-projected from ``embed`` into
a latent space ``compression`` times narrower, and attention runs *entirely* there, so the
projections, the KV cache and the attention FLOPs all shrink by that factor:

1. ``q~ = x W_q``, ``k~ = x W_k``, ``v~ = x W_v`` (latent widths: ``heads * head_dim`` =
   ``embed / compression`` for queries; ``kv_heads * head_dim`` for keys/values — CCGQA when
   ``kv_heads < heads``).
2. Convolutional mixing of ``q~`` and ``k~``: a causal depthwise convolution over the
   sequence, then a causal convolution over the sequence that also mixes channels within
   each head (``conv2_seq+ch(conv1_seq(.))``).
3. q-k mean: the mean of the pre-convolution query and key (per key head) is added to both
   convolved tensors, a skip path shared by queries and keys.
4. Value shift: the second half of the value channels come from the previous token.
5. QK RMS-norm, rotary embedding, causal attention in the latent heads
   (``ember.kernels_pallas.flash_attention`` via :func:`attend`), then ``W_o`` back up.

With packed documents (``segment_ids``), neither convolution nor the value shift reaches
across a document boundary: each document is computed as if alone.

Cache (see ``ember.models.cache``): latent K/V pages, the last ``2 * (conv_width - 1)``
pre-convolution query/key latents (both convolutions continue across calls) and the last
value (for the shift).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.sharding import constrain
from ember.kernels_pallas.document_boundaries import document_index, document_starts
from ember.kernels_pallas.short_conv import short_conv
from ember.models.config import ModelConfig
from ember.models.layers.attention import attend
from ember.models.layers.norm import RMSNorm
from ember.models.layers.projection import Projection
from ember.models.layers.rope import apply_rope, rope_inverse_frequencies


def causal_head_conv(x: jax.Array, weight: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """``x [batch, seq, heads, dim]``, ``weight [width, heads, dim, dim]``: a causal sequence
    convolution that mixes channels within each head, ``y_t = sum_i x_{t-width+1+i} @
    weight[i]`` (zeros before the sequence; taps do not cross a change of ``segment_ids``)."""
    width = weight.shape[0]
    batch, seq = x.shape[:2]
    doc = document_index(segment_ids, batch, seq)
    padded = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0), (0, 0)))
    padded_doc = jnp.pad(doc, ((0, 0), (width - 1, 0)))  # padded inputs are zeros: their doc is moot
    out = jnp.zeros(x.shape, jnp.result_type(x, weight))
    for i in range(width):
        same_doc = (padded_doc[:, i : i + seq] == doc)[..., None, None]
        out = out + jnp.einsum("bshd,hde->bshe", jnp.where(same_doc, padded[:, i : i + seq], 0), weight[i])
    return out


def convolve_latent(
    x: jax.Array, depthwise: jax.Array, head_mix: jax.Array, heads: int, segment_ids: jax.Array | None = None
) -> jax.Array:
    """Step 2 on a latent ``x [batch, seq, heads * dim]`` -> ``[batch, seq, heads, dim]``:
    :func:`ember.kernels_pallas.short_conv` (depthwise), then :func:`causal_head_conv`,
    neither reaching across a change of ``segment_ids [batch, seq]``."""
    mixed = short_conv(x, depthwise, segment_ids=segment_ids)
    return causal_head_conv(mixed.reshape(*x.shape[:2], heads, -1), head_mix, segment_ids)


def shift_values(v: jax.Array, v_before: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Step 4 on ``v [batch, seq, latent_kv]``: the second half of the channels come from the
    previous token (``v_before [batch, 1, latent_kv]`` before the first; zeros at a
    document start, where ``segment_ids`` changes)."""
    previous = jnp.concatenate([v_before, v[:, :-1]], axis=1)
    starts = document_starts(segment_ids, *v.shape[:2])[..., None]
    previous = jnp.where(starts, 0, previous)
    half = v.shape[-1] // 2
    return jnp.concatenate([v[..., :half], previous[..., half:]], axis=-1)


def _last_valid(history: jax.Array, count: jax.Array, length: int) -> jax.Array:
    """The ``length`` entries of ``history [batch, time, ...]`` ending before index
    ``length + count[b]`` of each row (the newest ``length`` valid entries)."""
    return jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, length, axis=0))(history, count)


class CompressedConvAttention(nn.Module):
    """CCA / CCGQA for one layer: ``x [batch, seq, embed] -> [batch, seq, embed]``.

    Parameters: ``q/kernel [embed, latent_q]``, ``k/kernel`` and ``v/kernel [embed,
    latent_kv]``, ``o/kernel [heads, head_dim, embed]``, convolution weights
    ``q_conv1 [width, latent_q]``, ``q_conv2 [width, heads, head_dim, head_dim]`` (and
    ``k_*``), ``q_norm``/``k_norm``.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, cache=None, paging=None, valid=None):
        config = self.config
        policy = config.policy
        heads, kv_heads, head_dim = config.cca_query_heads, config.cca_key_value_heads, config.cca_head_size
        width = config.cca_conv_width
        latent_q, latent_kv = heads * head_dim, kv_heads * head_dim

        def dense(name, features, axes):
            return Projection(
                (features,), ("embed", axes), init_std=config.init_std, dtype=policy.compute_dtype,
                param_dtype=policy.param_dtype, name=name,
            )(x)

        q_raw = dense("q", latent_q, "heads")
        k_raw = dense("k", latent_kv, "kv_heads")
        v = dense("v", latent_kv, "kv_heads")

        tail = 2 * (width - 1)
        if cache is not None:
            # Prepend the stored history so both convolutions see the previous tokens.
            q_in = jnp.concatenate([cache["q_tail"].astype(q_raw.dtype), q_raw], axis=1)
            k_in = jnp.concatenate([cache["k_tail"].astype(k_raw.dtype), k_raw], axis=1)
            v_before = cache["v_prev"][:, None].astype(v.dtype)
        else:
            q_in, k_in = q_raw, k_raw
            v_before = jnp.zeros_like(v[:, :1])
        # Packed documents (segment ids) only come without a cache: the history is empty then.
        q = self._convolve("q", q_in, heads, head_dim, "heads", segment_ids)[:, q_in.shape[1] - x.shape[1]:]
        k = self._convolve("k", k_in, kv_heads, head_dim, "kv_heads", segment_ids)[:, k_in.shape[1] - x.shape[1]:]

        group = heads // kv_heads
        q_pre = q_raw.reshape(*x.shape[:2], heads, head_dim)
        k_pre = k_raw.reshape(*x.shape[:2], kv_heads, head_dim)
        q_pre_by_kv = q_pre.reshape(*x.shape[:2], kv_heads, group, head_dim).mean(axis=3)
        q = q + jnp.repeat((q_pre_by_kv + k_pre) / 2, group, axis=2)
        k = k + (q_pre_by_kv + k_pre) / 2

        v_shifted = shift_values(v, v_before, segment_ids).reshape(*x.shape[:2], kv_heads, head_dim)

        q = RMSNorm(config.norm_eps, "head_dim", policy.param_dtype, name="q_norm")(q)
        k = RMSNorm(config.norm_eps, "head_dim", policy.param_dtype, name="k_norm")(k)
        inv_freq = rope_inverse_frequencies(head_dim, config.rope)
        q = constrain(apply_rope(q, positions, inv_freq), ("batch", "seq", "heads", "head_dim"))
        k = constrain(apply_rope(k, positions, inv_freq), ("batch", "seq", "kv_heads", "head_dim"))

        pages = None if cache is None else {"k_pages": cache["k_pages"], "v_pages": cache["v_pages"]}
        out, pages = attend(
            q, k, v_shifted, config=config, kind="global", segment_ids=segment_ids,
            pages=pages, paging=paging, positions=positions, valid=valid,
        )
        out = Projection(
            (x.shape[-1],), ("heads", "head_dim", "embed"), in_dims=2, init_std=config.init_std,
            dtype=policy.compute_dtype, param_dtype=policy.param_dtype, name="o",
        )(out)
        if cache is None:
            return out, None
        count = jnp.sum(valid, axis=1).astype(jnp.int32)
        last_v = _last_valid(jnp.concatenate([v_before, v], axis=1), count, 1)[:, 0]
        new_cache = dict(
            pages,
            q_tail=_last_valid(q_in, count, tail).astype(cache["q_tail"].dtype),
            k_tail=_last_valid(k_in, count, tail).astype(cache["k_tail"].dtype),
            v_prev=last_v.astype(cache["v_prev"].dtype),
        )
        return out, new_cache

    def _convolve(
        self, prefix: str, x: jax.Array, heads: int, head_dim: int, heads_axis: str, segment_ids: jax.Array | None
    ) -> jax.Array:
        width = self.config.cca_conv_width
        param_dtype = self.config.policy.param_dtype
        # Initialised to pass the current token through (identity), so an untrained CCA
        # layer starts as plain latent attention.
        depthwise = self.param(
            f"{prefix}_conv1",
            nn.with_logical_partitioning(lambda key, shape, dtype: jnp.zeros(shape, dtype).at[-1].set(1.0), (None, heads_axis)),
            (width, heads * head_dim),
            param_dtype,
        )
        head_mix = self.param(
            f"{prefix}_conv2",
            nn.with_logical_partitioning(
                lambda key, shape, dtype: jnp.zeros(shape, dtype).at[-1].set(jnp.eye(head_dim, dtype=dtype)),
                (None, heads_axis, "head_dim", None),
            ),
            (width, heads, head_dim, head_dim),
            param_dtype,
        )
        return convolve_latent(x, depthwise.astype(x.dtype), head_mix.astype(x.dtype), heads, segment_ids)

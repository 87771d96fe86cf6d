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

Cache (see ``ember.models.cache``): latent K/V pages and, per sequence slot, the last
``2 * (conv_width - 1)`` pre-convolution query/key latents (both convolutions continue
across steps) and the last value (for the shift). In a step's flat token budget each
token's convolution window comes from its own run, else from its sequence's slot.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.sharding import constrain
from ember.kernels_pallas.document_boundaries import document_index, document_starts
from ember.kernels_pallas.short_conv import short_conv
from ember.models.cache import Paging, run_history
from ember.models.config import ModelConfig
from ember.models.layers.attention import attend, output_projection
from ember.models.layers.norm import RMSNorm
from ember.models.layers.projection import model_projection
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


def previous_values(v: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Step 4's source on ``v [batch, seq, latent_kv]``: each token's previous value (zeros
    before the sequence and at a document start, where ``segment_ids`` changes)."""
    previous = jnp.concatenate([jnp.zeros_like(v[:, :1]), v[:, :-1]], axis=1)
    starts = document_starts(segment_ids, *v.shape[:2])[..., None]
    return jnp.where(starts, 0, previous)


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
        latent_q, latent_kv = heads * head_dim, kv_heads * head_dim
        adapter_ids = None if paging is None else paging.token_adapters(valid)

        def dense(name, features, axes):
            return model_projection(config, (features,), ("embed", axes), name=name)(x, adapter_ids)

        q_raw = dense("q", latent_q, "heads")
        k_raw = dense("k", latent_kv, "kv_heads")
        v = dense("v", latent_kv, "kv_heads")

        if cache is None:
            q = self._convolve("q", q_raw, heads, head_dim, "heads", segment_ids)
            k = self._convolve("k", k_raw, kv_heads, head_dim, "kv_heads", segment_ids)
            previous = previous_values(v, segment_ids)
        else:
            q, k, previous = self._ragged_mixing(q_raw[0], k_raw[0], v[0], cache, paging)

        group = heads // kv_heads
        q_pre = q_raw.reshape(*x.shape[:2], heads, head_dim)
        k_pre = k_raw.reshape(*x.shape[:2], kv_heads, head_dim)
        q_pre_by_kv = q_pre.reshape(*x.shape[:2], kv_heads, group, head_dim).mean(axis=3)
        q = q + jnp.repeat((q_pre_by_kv + k_pre) / 2, group, axis=2)
        k = k + (q_pre_by_kv + k_pre) / 2

        half = latent_kv // 2
        v_shifted = jnp.concatenate([v[..., :half], previous[..., half:]], axis=-1)
        v_shifted = v_shifted.reshape(*x.shape[:2], kv_heads, head_dim)

        q = RMSNorm(config.norm_eps, "head_dim", policy.param_dtype, name="q_norm")(q)
        k = RMSNorm(config.norm_eps, "head_dim", policy.param_dtype, name="k_norm")(k)
        inv_freq = rope_inverse_frequencies(head_dim, config.rope)
        q = constrain(apply_rope(q, positions, inv_freq), ("batch", "seq", "heads", "head_dim"))
        k = constrain(apply_rope(k, positions, inv_freq), ("batch", "seq", "kv_heads", "head_dim"))

        pages = None if cache is None else {"k_pages": cache["k_pages"], "v_pages": cache["v_pages"]}
        out, pages = attend(
            q,
            k,
            v_shifted,
            config=config,
            kind="global",
            segment_ids=segment_ids,
            pages=pages,
            paging=paging,
            positions=positions,
            valid=valid,
        )
        out = output_projection(config, x.shape[-1])(out, adapter_ids)
        if cache is None:
            return out, None
        return out, dict(pages, **self._ragged_slots(q_raw[0], k_raw[0], v[0], cache, paging))

    def _ragged_mixing(self, q_raw, k_raw, v, cache, paging: Paging):
        """Steps 2 and 4 over a flat budget (``q_raw [num_tokens, latent_q]``, ...): each
        token convolves the ``2 * (width - 1) + 1`` inputs of its sequence ending at it
        (exact: two stacked width-``w`` convolutions see that far back) and takes its
        sequence's previous value. Returns ``(q [1, T, heads, d], k [1, T, kv_heads, d],
        previous values [1, T, latent_kv])``."""
        config = self.config
        heads, kv_heads, head_dim = config.cca_query_heads, config.cca_key_value_heads, config.cca_head_size
        reach = 2 * (config.cca_conv_width - 1) + 1
        owner, ends = paging.owner, paging.run_offsets() + 1

        def convolved(prefix, raw, slot, count, axis):
            window = run_history(raw, slot.astype(raw.dtype), paging, owner, ends, reach)  # [T, reach, latent]
            return self._convolve(prefix, window, count, head_dim, axis, None)[None, :, -1]

        previous = run_history(v, cache["v_prev"][:, None].astype(v.dtype), paging, owner, ends - 1, 1)[:, 0]
        return (
            convolved("q", q_raw, cache["q_tail"], heads, "heads"),
            convolved("k", k_raw, cache["k_tail"], kv_heads, "kv_heads"),
            previous[None],
        )

    @staticmethod
    def _ragged_slots(q_raw, k_raw, v, cache, paging: Paging) -> dict[str, jax.Array]:
        """Each sequence's ``q_tail``, ``k_tail`` and ``v_prev`` after its run (unchanged
        for a sequence that sits the step out)."""
        seqs = jnp.arange(paging.page_table.shape[0])
        tail = cache["q_tail"].shape[1]

        def last(raw, slot, length):
            return run_history(raw, slot, paging, seqs, paging.query_lens, length).astype(slot.dtype)

        return dict(
            q_tail=last(q_raw, cache["q_tail"], tail),
            k_tail=last(k_raw, cache["k_tail"], tail),
            v_prev=last(v, cache["v_prev"][:, None], 1)[:, 0],
        )

    def _convolve(
        self, prefix: str, x: jax.Array, heads: int, head_dim: int, heads_axis: str, segment_ids: jax.Array | None
    ) -> jax.Array:
        width = self.config.cca_conv_width
        param_dtype = self.config.policy.param_dtype
        # Initialised to pass the current token through (identity), so an untrained CCA
        # layer starts as plain latent attention.
        depthwise = self.param(
            f"{prefix}_conv1",
            nn.with_logical_partitioning(
                lambda key, shape, dtype: jnp.zeros(shape, dtype).at[-1].set(1.0), (None, heads_axis)
            ),
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

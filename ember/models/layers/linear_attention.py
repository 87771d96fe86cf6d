"""Linear attention layer: feature-mapped queries and keys, normalised causal linear
attention from ``ember.kernels_pallas.linear_attention``, a recurrent state slot per
sequence as its cache (see ``ember.models.cache``).

No rotary embedding: positions enter only through causality (the feature maps need the
raw projections to stay comparable to softmax attention when linearising).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.sharding import constrain
from ember.kernels_pallas.linear_attention import KERNEL_BACKENDS as LINEAR_KERNEL_BACKENDS
from ember.kernels_pallas.linear_attention import NORMALIZER_EPS, linear_attention
from ember.models.cache import Paging
from ember.models.config import ModelConfig
from ember.models.layers.attention import output_projection
from ember.models.layers.feature_maps import FeatureMap
from ember.models.layers.kernel_shards import per_head_group_shard, runs_per_shard
from ember.models.layers.projection import model_projection


def ragged_linear_sums(
    q: jax.Array, k: jax.Array, values: jax.Array, states: jax.Array, paging: Paging, valid: jax.Array, impl: str
) -> tuple[jax.Array, jax.Array]:
    """Unnormalised causal linear attention over one flat token budget of sequence runs.

    Args:
      q, k: ``[num_tokens, heads, feature_dim]`` (feature-mapped); values ``[num_tokens,
        heads, dv]`` (with a column of ones last, the sums' last column is the normaliser).
      states: float32 ``[seqs, heads, feature_dim, dv]``, each sequence's ``sum phi(k) values``
        before its run (ignored for a fresh sequence).
      paging: the runs; valid: bool ``[num_tokens]`` (False: a key that adds nothing).
      impl: ``linear_attention``'s implementation.

    Returns:
      float32 ``(sums [num_tokens, heads, dv], states after the runs)``: a token's sums are its
      run's chunked linear attention (documents reset at run boundaries) plus ``phi(q_t) .
      states[owner]``; a run adds its valid keys to its sequence's state.
    """
    f32 = jnp.float32
    keep = valid[:, None, None]
    q = q.astype(f32)
    k = jnp.where(keep, k, 0).astype(f32)
    values = jnp.where(keep, values, 0).astype(f32)
    num_seqs = paging.page_table.shape[0]
    runs = jnp.where(valid, paging.owner, num_seqs)
    within = linear_attention(q[None], k[None], values[None], segment_ids=runs[None], impl=impl)[0]
    states = jnp.where(paging.fresh()[:, None, None, None], 0.0, states.astype(f32))
    sums = within + jnp.einsum("thf,thfe->the", q, states[paging.owner])
    member = ((paging.owner[:, None] == jnp.arange(num_seqs)[None, :]) & valid[:, None]).astype(f32)
    return sums, states + jnp.einsum("ts,thf,the->shfe", member, k, values)


def ragged_linear_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, states: jax.Array, paging: Paging, valid: jax.Array, impl: str
) -> tuple[jax.Array, jax.Array]:
    """Normalised causal linear attention over one flat token budget of sequence runs.

    Args:
      q, k: ``[num_tokens, heads, feature_dim]`` (feature-mapped); v ``[num_tokens, heads, dv]``.
      states: float32 ``[seqs, heads, feature_dim, dv + 1]``, each sequence's state before
        its run (``sum phi(k) [v, 1]`` so far; ignored for a fresh sequence).
      paging: the runs; valid: bool ``[num_tokens]`` (False: padding, which adds nothing).
      impl: ``linear_attention``'s implementation.

    Returns:
      ``(out [num_tokens, heads, dv] in v's dtype, states after the runs)``: the sums of
      :func:`ragged_linear_sums` divided by their normaliser column.
    """
    values = jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)
    total, states = ragged_linear_sums(q, k, values, states, paging, valid, impl)
    out = total[..., :-1] / (total[..., -1:] + NORMALIZER_EPS)
    return out.astype(v.dtype), states


class LinearAttention(nn.Module):
    """``x [batch, seq, embed] -> [batch, seq, embed]``; the cache entry is ``{"state":
    [slots, heads, feature_dim, head_dim + 1]}`` (float32), with a cache ``batch`` is 1
    (one flat token budget, see :func:`ragged_linear_attention`).

    Parameters: ``q/k/v/kernel [embed, heads, head_dim]``, ``o/kernel [heads, head_dim,
    embed]``, and ``q_features``/``k_features`` (Hedgehog weights) when learnable.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, cache=None, paging=None, valid=None):
        del positions  # causal order is the sequence order
        config = self.config
        policy = config.policy
        heads, head_dim = config.num_heads, config.head_size
        adapter_ids = None if paging is None else paging.token_adapters(valid)

        def projection(name):
            return model_projection(config, (heads, head_dim), ("embed", "heads", "head_dim"), name=name)(
                x, adapter_ids
            )

        def features(name):
            return FeatureMap(config.linear_feature_map, config.linear_feature_dim, policy.param_dtype, name=name)

        q = features("q_features")(projection("q"))
        k = features("k_features")(projection("k"))
        v = projection("v")
        q = constrain(q, ("batch", "seq", "heads", None))
        k = constrain(k, ("batch", "seq", "heads", None))
        if cache is None:
            impl = config.attention_impl
            kernel = runs_per_shard(impl, op="linear_attention", kernel_backends=LINEAR_KERNEL_BACKENDS)
            out = per_head_group_shard(
                lambda q, k, v, segment_ids: linear_attention(
                    q, k, v, normalize=True, segment_ids=segment_ids, impl=impl
                ),
                (q, k, v, segment_ids),
                ("bsh.", "bsh.", "bsh.", "bs"),
                out_layout="bsh.",
                groups=heads,
                kernel=kernel,
            )
        else:
            out, state = ragged_linear_attention(
                q[0], k[0], v[0], cache["state"], paging, valid[0], config.attention_impl
            )
            out = out[None]
            cache = {"state": state.astype(cache["state"].dtype)}
        out = output_projection(config, x.shape[-1])(out, adapter_ids)
        return out, cache

"""Linear attention layer: feature-mapped queries and keys, normalised causal linear
attention from ``ember.kernels_pallas.linear_attention``, a recurrent state as its cache.

No rotary embedding: positions enter only through causality (the feature maps need the
raw projections to stay comparable to softmax attention when linearising).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.sharding import constrain
from ember.kernels_pallas.linear_attention import linear_attention, linear_attention_step
from ember.models.config import ModelConfig
from ember.models.layers.feature_maps import FeatureMap
from ember.models.layers.projection import Projection


class LinearAttention(nn.Module):
    """``x [batch, seq, embed] -> [batch, seq, embed]``; the cache entry is ``{"state":
    [batch, heads, feature_dim, head_dim + 1]}`` (float32).

    Parameters: ``q/k/v/kernel [embed, heads, head_dim]``, ``o/kernel [heads, head_dim,
    embed]``, and ``q_features``/``k_features`` (Hedgehog weights) when learnable.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, cache=None, paging=None, valid=None):
        del positions, paging  # causal order is the sequence order; no pages
        config = self.config
        policy = config.policy
        heads, head_dim = config.num_heads, config.head_size

        def projection(name):
            return Projection(
                (heads, head_dim), ("embed", "heads", "head_dim"), init_std=config.init_std,
                dtype=policy.compute_dtype, param_dtype=policy.param_dtype, name=name,
            )(x)

        def features(name):
            return FeatureMap(config.linear_feature_map, config.linear_feature_dim, policy.param_dtype, name=name)

        q = features("q_features")(projection("q"))
        k = features("k_features")(projection("k"))
        v = projection("v")
        q = constrain(q, ("batch", "seq", "heads", None))
        k = constrain(k, ("batch", "seq", "heads", None))
        if cache is None:
            out = linear_attention(q, k, v, normalize=True, segment_ids=segment_ids, impl=config.attention_impl)
        else:
            # Padding tokens contribute nothing to the state: zero keys and values.
            k = jnp.where(valid[..., None, None], k, 0)
            v = jnp.where(valid[..., None, None], v, 0)
            if x.shape[1] == 1:
                out, state = linear_attention_step(q[:, 0], k[:, 0], v[:, 0], cache["state"], normalize=True)
                out = out[:, None]
            else:
                out, state = linear_attention(
                    q, k, v, normalize=True, initial_state=cache["state"], return_final_state=True,
                    impl=config.attention_impl,
                )
            cache = {"state": state.astype(cache["state"].dtype)}
        out = Projection(
            (x.shape[-1],), ("heads", "head_dim", "embed"), in_dims=2, init_std=config.init_std,
            dtype=policy.compute_dtype, param_dtype=policy.param_dtype, name="o",
        )(out)
        return out, cache

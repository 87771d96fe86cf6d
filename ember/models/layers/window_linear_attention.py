"""The linearised attention layer (``window_linear``): a softmax attention layer's own
projections and rotary embedding, with exact attention over a sliding window and learned
feature maps for everything before it (LoLCATs; the math is ``window_linear_math``).

It holds the parameters of the ``Attention`` layer it replaces (``q``, ``k``, ``v``, ``o`` and
the QK norms, under the same names, so a softmax model's weights load into it as they are) plus
``q_features``/``k_features`` (Hedgehog maps, ``[heads or kv_heads, head_dim, feature_dim]``)
and ``window_factor [heads]`` (the mix, ``sigmoid`` of it weights the window).

With ``config.attention_transfer`` (stage 1 of linearising) the layer also computes the softmax
attention it stands in for, sows the mean squared error between the two outputs into
``losses`` as ``attention_transfer``, and returns the softmax output, so every layer of one
forward pass sees the teacher's inputs. That attention is the layer's ``transfer_kind`` (the
teacher layer's kind: ``local`` and ``block_sparse`` within ``config.transfer_window`` tokens,
the teacher's window). The mean is over the tokens of segment id >= 1: id 0
is padding in Ember's batches (``ember.training.data``), which has no error to learn.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.models.cache import Paging
from ember.models.config import ModelConfig
from ember.models.layers.attention import attend, output_projection, rotary_qkv
from ember.models.layers.feature_maps import FeatureMap
from ember.models.layers.window_linear_math import (
    ragged_window_linear_attention,
    step_windows,
    window_linear_attention,
)

TRANSFER_LOSS = "attention_transfer"
"""The name the layers sow their attention-transfer error under (``losses`` collection)."""


class WindowLinearAttention(nn.Module):
    """``x [batch, seq, embed] -> [batch, seq, embed]``; the cache entry is ``{"state",
    "window_k", "window_v"}`` (``ember.models.cache``), with a cache ``batch`` is 1."""

    config: ModelConfig
    transfer_kind: str = "global"
    """The softmax attention kind this layer replaced: its target with ``config.attention_transfer``."""

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array | None = None,
        cache: dict[str, jax.Array] | None = None,
        paging: Paging | None = None,
        valid: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        config = self.config
        param_dtype = config.policy.param_dtype
        adapter_ids = None if paging is None else paging.token_adapters(valid)
        q, k, v = rotary_qkv(config, x, positions, adapter_ids, self.transfer_kind)
        q_map = FeatureMap(config.linear_feature_map, config.linear_feature_dim, param_dtype, name="q_features")
        k_map = FeatureMap(config.linear_feature_map, config.linear_feature_dim, param_dtype, name="k_features")
        mix = self.param(
            "window_factor", nn.with_logical_partitioning(nn.initializers.zeros, ("heads",)), (q.shape[2],), param_dtype
        )
        factor = jax.nn.sigmoid(mix.astype(jnp.float32))
        options = dict(
            window=config.sliding_window,
            soft_cap=config.attn_soft_cap,
            sm_scale=config.attn_scale or None,
            impl=config.attention_impl,
        )
        project = output_projection(config, x.shape[-1])
        if cache is not None:
            keys, values, slot_k, slot_v = step_windows(
                k[0], v[0], cache["window_k"], cache["window_v"], paging, config.sliding_window
            )
            out, state = ragged_window_linear_attention(
                q[0], keys, values, q_map(q)[0], k_map(keys[None, :, 0])[0], factor, cache["state"],
                paging=paging, positions=positions[0], valid=valid[0], **options,
            )  # fmt: skip
            cache = {"state": state.astype(cache["state"].dtype), "window_k": slot_k, "window_v": slot_v}
            return project(out[None], adapter_ids), cache
        out = project(window_linear_attention(q, k, v, q_map(q), k_map(k), factor, segment_ids=segment_ids, **options))
        if not config.attention_transfer:
            return out, None
        teacher = dataclasses.replace(config, sliding_window=config.transfer_window or config.sliding_window)
        softmax, _ = attend(
            q, k, v, config=teacher, kind=self.transfer_kind, segment_ids=segment_ids, positions=positions
        )
        softmax = project(softmax)
        self.sow("losses", TRANSFER_LOSS, transfer_error(out, softmax, segment_ids))
        return softmax, None


def transfer_error(out: jax.Array, target: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """The mean squared error of ``out`` against ``target`` (``[batch, seq, embed]``) over the
    tokens that are not padding (segment id 0); every token without ``segment_ids``."""
    error = jnp.square(out.astype(jnp.float32) - target.astype(jnp.float32))
    if segment_ids is None:
        return jnp.mean(error)
    real = (segment_ids > 0)[..., None]
    return jnp.sum(jnp.where(real, error, 0.0)) / jnp.maximum(jnp.sum(real) * error.shape[-1], 1)


__all__ = ["TRANSFER_LOSS", "WindowLinearAttention", "transfer_error"]

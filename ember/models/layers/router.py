"""MoE routing math: scores, top-k choice, balance statistics and the losses built from them.

Plain functions of router logits ``[tokens, experts]`` (f32); the MoE layer
(``ember.models.layers.moe``) calls them, the decoder combines the per-layer statistics.

Load balancing is the global form ``transformers`` computes (``load_balancing_loss_func``,
Switch Transformer eq. 4-6 over every MoE layer's tokens at once)::

    loss = E * sum_e (counts_e / rows) * (prob_sum_e / rows)

where ``counts_e`` counts the top-k choices of expert ``e`` and ``prob_sum_e`` sums its routing
probability, both over all layers' tokens, and ``rows`` is tokens x layers. It is not the sum of
per-layer losses, so each layer returns :func:`balance_statistics` and :func:`combine_statistics`
adds them before the product is taken.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ember.core.sharding import per_shard


class Routing(NamedTuple):
    """The experts each token goes to and the weights of their outputs."""

    expert_ids: jax.Array  # int32 [tokens, top_k]
    weights: jax.Array  # f32 [tokens, top_k]


def routing_probabilities(logits: jax.Array, score: str) -> jax.Array:
    """``[tokens, experts]`` probabilities (rows sum to 1) for balance statistics: the softmax
    of the logits, or the sigmoid scores normalised per token."""
    logits = logits.astype(jnp.float32)
    if score == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    scores = jax.nn.sigmoid(logits)
    return scores / jnp.sum(scores, axis=-1, keepdims=True)


def route(
    logits: jax.Array,
    *,
    top_k: int,
    score: str,
    renormalize: bool,
    routed_scaling: float = 1.0,
    selection_bias: jax.Array | None = None,
) -> Routing:
    """Top-k routing of ``logits [tokens, experts]``.

    The choice takes the ``top_k`` largest ``scores + selection_bias`` (the bias, DeepSeek-V3's
    balancing bias ``[experts]``, moves the choice only); the weights are the chosen experts'
    scores (``softmax`` or ``sigmoid`` of the logits), divided by their sum when
    ``renormalize``, times ``routed_scaling``.
    """
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if selection_bias is None else scores + jax.lax.stop_gradient(selection_bias)
    # Each device its own tokens: XLA does not split TopK over them, and gathered every device's logits.
    expert_ids = per_shard(lambda choice: jax.lax.top_k(choice, top_k)[1], [("batch", None)], ("batch", None))(choice)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(expert_ids.astype(jnp.int32), weights * routed_scaling)


def balance_statistics(
    logits: jax.Array, expert_ids: jax.Array, *, score: str, dropped: jax.Array, token_mask: jax.Array | None = None
) -> dict[str, jax.Array]:
    """One layer's sums over its tokens (``token_mask [tokens]`` excludes padding).

    Returns f32 ``counts [E]`` (top-k choices per expert), ``prob_sum [E]`` (routing
    probabilities), ``rows`` (tokens), ``z_sum`` (squared logsumexp of the logits),
    ``entropy_sum`` (routing entropy) and ``dropped`` (token-slots over capacity; ``dropped``
    is a bool ``[tokens, top_k]``).
    """
    logits = logits.astype(jnp.float32)
    num_experts = logits.shape[-1]
    mask = jnp.ones(logits.shape[:1], jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
    probs = routing_probabilities(logits, score)
    # [tokens, E], one choice at a time: no [tokens, top_k, E] tensor.
    chosen = sum(jax.nn.one_hot(expert_ids[:, k], num_experts, dtype=jnp.float32) for k in range(expert_ids.shape[1]))
    entropy = -jnp.sum(jnp.where(probs > 0, probs * jnp.log(jnp.maximum(probs, 1e-30)), 0.0), axis=-1)
    return {
        "counts": jnp.sum(chosen * mask[:, None], axis=0),
        "prob_sum": jnp.sum(probs * mask[:, None], axis=0),
        "rows": jnp.sum(mask),
        "z_sum": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * mask),
        "entropy_sum": jnp.sum(entropy * mask),
        "dropped": jnp.sum(dropped.astype(jnp.float32) * mask[:, None]),
    }


def combine_statistics(per_layer: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
    """The sums of several layers' :func:`balance_statistics`."""
    return jax.tree.map(lambda *values: sum(values[1:], values[0]), *per_layer)


def load_balancing_loss(stats: dict[str, jax.Array]) -> jax.Array:
    """``E * sum_e (counts_e / rows) * (prob_sum_e / rows)`` of (combined) statistics."""
    rows = jnp.maximum(stats["rows"], 1.0)
    return stats["counts"].shape[-1] * jnp.sum((stats["counts"] / rows) * (stats["prob_sum"] / rows))


def router_z_loss(stats: dict[str, jax.Array]) -> jax.Array:
    """ST-MoE's router z-loss: the mean over tokens (and layers) of ``logsumexp(logits)^2``."""
    return stats["z_sum"] / jnp.maximum(stats["rows"], 1.0)


def layer_metrics(stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """``expert_load [E]`` (fraction of token-slots per expert), ``load_imbalance`` (the busiest
    expert's load over the mean load: 1 when balanced), ``dropped_fraction`` and
    ``router_entropy`` (mean, nats) of one layer's statistics.

    The trainer averages a metric over layers, and the layers of an MoE model often favour
    different experts: the mean ``expert_load`` can look balanced while each layer sends most
    tokens to a few experts. ``load_imbalance`` is taken per layer first, so its mean shows that.
    The token-slots are the choices counted (``rows * top_k``), so the layer's ``top_k`` is not needed."""
    slots = jnp.maximum(jnp.sum(stats["counts"]), 1.0)
    counts = stats["counts"]
    return {
        "expert_load": counts / slots,
        "load_imbalance": jnp.max(counts) / jnp.maximum(jnp.mean(counts), 1e-9),
        "dropped_fraction": stats["dropped"] / slots,
        "router_entropy": stats["entropy_sum"] / jnp.maximum(stats["rows"], 1.0),
    }


def updated_balance_bias(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's bias step: ``bias + rate * sign(mean load - load)`` (underloaded experts
    become likelier choices)."""
    return bias + rate * jnp.sign(jnp.mean(counts) - counts)


__all__ = [
    "Routing",
    "balance_statistics",
    "combine_statistics",
    "layer_metrics",
    "load_balancing_loss",
    "route",
    "router_z_loss",
    "routing_probabilities",
    "updated_balance_bias",
]

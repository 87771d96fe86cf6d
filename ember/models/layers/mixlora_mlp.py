"""MixLoRA's feed-forward block: LoRA experts on a frozen dense MLP behind a top-k router.

Parameters (the dense ``Mlp``'s, plus what ``ember.models.adapters.mixlora`` adds):
``gate [embed, mlp]`` (gated kinds), ``up [embed, mlp]``, ``down [mlp, embed]``;
``mixlora_router_top<k> [embed, E]`` (the router; ``k`` its top-k); per adapted matrix
``<w>_lora_a [E, in, rank]``, ``<w>_lora_b [E, rank, out]``, ``<w>_lora_scale []``.

Expert ``e`` is the MLP with every adapted matrix ``W + scale A_e B_e``; a token's output is
the renormalised softmax-weighted sum of its top-k experts' outputs (Li et al. 2024). The
base projections are computed once per token, each routed (token, expert) row adds its
expert's low-rank deltas by grouped matmul (rows sorted by expert), and ``down`` runs once
per row. With every ``B`` zero each expert is the base MLP, so the block is the base MLP
(to the rounding of the top-k weights' sum). The router's balance statistics go back to
the decoder, which sows the load-balancing loss and the ``expert_load`` metrics from them
as for MoE layers.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.models.adapters.lowrank import MIXLORA_ROUTER, LowRank, grouped_low_rank_delta, read_low_rank
from ember.models.layers.mlp import ACTIVATIONS, GATED
from ember.models.layers.router import balance_statistics, route


def mixlora_router_name(mlp_params: dict | None) -> str | None:
    """The MixLoRA router's name among an MLP's parameters, or None (a plain MLP)."""
    return next((name for name in (mlp_params or {}) if MIXLORA_ROUTER.match(name)), None)


def mixlora_mlp(
    x: jax.Array,
    weights: dict[str, jax.Array],
    adapters: dict[str, LowRank | None],
    router: jax.Array,
    *,
    kind: str,
    top_k: int,
    token_mask: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(y [tokens, embed], balance statistics)`` of ``x [tokens, embed]`` (see the module
    docstring); ``weights`` by name (``gate`` for gated kinds, ``up``, ``down``), ``adapters``
    the stacked expert adapters of the adapted ones; ``token_mask [tokens]``: the real tokens,
    the only ones the statistics count (None: all)."""
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    routing = route(logits, top_k=top_k, score="softmax", renormalize=True)
    experts = routing.expert_ids.reshape(-1)  # [tokens * k]: token t's slots are rows t*k .. t*k + k - 1

    def project(name, inputs, per_token):
        """``inputs [rows, in] @ (W + scale A_e B_e)`` per row; ``per_token``: inputs repeat per slot."""
        base = inputs @ weights[name]
        base = jnp.repeat(base, top_k, axis=0) if per_token else base
        adapter = adapters.get(name)
        if adapter is None:
            return base
        rows = jnp.repeat(inputs, top_k, axis=0) if per_token else inputs
        scale = adapter.scale.astype(adapter.b.dtype)
        delta = grouped_low_rank_delta(rows, LowRank(adapter.a, adapter.b * scale, scale), experts, in_dims=1)
        return base + delta.astype(base.dtype)

    hidden = project("up", x, True)
    if kind in GATED:
        hidden = ACTIVATIONS[kind](project("gate", x, True)) * hidden
    else:
        hidden = ACTIVATIONS[kind](hidden)
    out = project("down", hidden, False).reshape(x.shape[0], top_k, -1)
    y = jnp.einsum("tk,tke->te", routing.weights.astype(out.dtype), out)
    stats = balance_statistics(
        logits,
        routing.expert_ids,
        score="softmax",
        dropped=jnp.zeros(routing.expert_ids.shape, bool),
        token_mask=token_mask,
    )
    return y, stats


class MixLoraMlp(nn.Module):
    """``x [batch, seq, embed] -> (y [batch, seq, embed], balance statistics)`` over the
    parameters a dense ``Mlp`` had before ``add_mixlora`` (see the module docstring);
    ``token_mask [batch, seq]``: the real tokens, the only ones the statistics count (None: all)."""

    kind: str = "swiglu"
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, token_mask: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        router_name = mixlora_router_name(self.variables.get("params"))
        if router_name is None:
            raise ValueError("MixLoraMlp needs the parameters add_mixlora gives a dense MLP")
        names = ("gate", "up", "down") if self.kind in GATED else ("up", "down")
        weights = {name: self.get_variable("params", name).astype(self.dtype) for name in names}
        adapters = {name: read_low_rank(self, name) for name in names}
        router = self.get_variable("params", router_name)
        top_k = int(MIXLORA_ROUTER.match(router_name).group(1))
        batch, seq, embed = x.shape
        y, stats = mixlora_mlp(
            x.astype(self.dtype).reshape(-1, embed),
            weights,
            adapters,
            router,
            kind=self.kind,
            top_k=top_k,
            token_mask=None if token_mask is None else token_mask.reshape(-1),
        )
        return y.reshape(batch, seq, embed), stats


__all__ = ["MixLoraMlp", "mixlora_mlp", "mixlora_router_name"]

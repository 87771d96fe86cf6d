"""``DecoderLM``: a decoder-only language model built from a ``ModelConfig``.

    model = DecoderLM(config)
    params = model.init(rng, tokens)["params"]
    logits, _ = model.apply({"params": params}, tokens)                       # training
    logits, cache = model.apply({"params": params}, flat[None], cache=cache, logits_at=last[None])  # prefill + decode

Layers follow ``config.block_pattern`` and ``config.mlp_pattern`` (together period
``P = config.layer_period``): layer ``i`` is block ``i % P`` of group ``i // P``. With
``scan_layers`` the groups are one ``nn.scan`` (parameters ``params["layers"]["block_<j>"]``
with a leading ``[groups]`` axis, logical name
``layers``), so compile time does not grow with depth; otherwise ``params["group_<g>"]
["block_<j>"]``; ``ember.models.layer_layout`` finds layers in either layout and moves
trees between them.

MoE layers (``mlp_pattern`` entry ``moe``), and dense MLPs given MixLoRA experts
(``ember.models.adapters.mixlora``), sow, when the collections are mutable: the global
load-balancing loss and the router z-loss (collection ``losses``: ``load_balance``,
``router_z``, computed from all MoE layers' statistics together) and per MoE layer, in layer
order, ``expert_load [experts]``, ``load_imbalance``, ``dropped_fraction`` and ``router_entropy``
(``metrics``).
With ``moe.bias_balancing_rate`` the ``balance`` collection must be passed to ``apply``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.sharding import constrain
from ember.kernels_pallas.attention_math import soft_cap
from ember.kernels_pallas.ragged_paged_attention import token_owners
from ember.models.cache import PAGE_ENTRIES, Paging, fold_pages, unfold_pages
from ember.models.config import SOFTMAX_FAMILY, ModelConfig
from ember.models.layer_layout import group_span, num_groups
from ember.models.layers.attention import Attention
from ember.models.layers.cca import CompressedConvAttention
from ember.models.layers.embedding import Embed, OutputHead
from ember.models.layers.linear_attention import LinearAttention
from ember.models.layers.mamba2 import Mamba2Mixer
from ember.models.layers.mixlora_mlp import MixLoraMlp, mixlora_router_name
from ember.models.layers.mlp import Mlp
from ember.models.layers.moe import MoeMlp
from ember.models.layers.norm import make_norm
from ember.models.layers.router import combine_statistics, layer_metrics, load_balancing_loss, router_z_loss
from ember.models.layers.window_linear_attention import WindowLinearAttention
from ember.models.quantization.stored import CALIBRATION

_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))`` (with
    ``post_norms``, ``x + norm(mixer(norm(x)))`` and ``x + norm(mlp(norm(x)))``).

    The mixer (named ``attn`` whatever its kind) is chosen by ``kind``, the MLP by
    ``mlp_placement`` (``moe``: a ``MoeMlp``; ``none``: no MLP and no ``mlp_norm``; a dense
    MLP whose params carry MixLoRA's router runs as a ``MixLoraMlp``); ``state``
    is this layer's cache entry (or None). ``router_logits``: the last MoE layer's router
    logits, carried for MoE++'s gating residual (None without it). Returns ``(x, state,
    router_logits, balance statistics or None)``.
    """

    config: ModelConfig
    kind: str
    mlp_placement: str = "dense"
    transfer_kind: str = "global"
    """A ``window_linear`` mixer's attention-transfer target (``ModelConfig.layer_transfer_kinds``)."""

    @nn.compact
    def __call__(self, x, positions, segment_ids, state, paging, valid, router_logits=None):
        config = self.config
        param_dtype = config.policy.param_dtype
        h = make_norm(config.norm, config.norm_eps, param_dtype=param_dtype, name="attn_norm")(x)
        if self.kind in SOFTMAX_FAMILY:
            mixer = Attention(config, self.kind, name="attn")
        elif self.kind == "cca":
            mixer = CompressedConvAttention(config, name="attn")
        elif self.kind == "mamba2":
            mixer = Mamba2Mixer(config, name="attn")
        elif self.kind == "window_linear":
            mixer = WindowLinearAttention(config, self.transfer_kind, name="attn")
        else:
            mixer = LinearAttention(config, name="attn")
        h, state = mixer(h, positions, segment_ids, state, paging, valid)
        if config.post_norms:
            h = make_norm(config.norm, config.norm_eps, param_dtype=param_dtype, name="attn_post_norm")(h)
        x = constrain(x + h, ("batch", "seq", "embed"))
        if self.mlp_placement == "none":
            return x, state, router_logits, None
        h = make_norm(config.norm, config.norm_eps, param_dtype=param_dtype, name="mlp_norm")(x)
        stats = None
        adapter_ids = None if paging is None else paging.token_adapters(valid)
        # The tokens routed to experts and counted in the balance statistics: not a ragged step's
        # unused budget, nor a training batch's padding (segment id 0).
        real = valid if paging is not None else None if segment_ids is None else segment_ids > 0
        if self.mlp_placement == "moe":
            h, new_logits, stats = MoeMlp(config, name="moe")(h, router_logits, real, adapter_ids)
            if router_logits is not None:
                router_logits = new_logits.astype(router_logits.dtype)
        elif mixlora_router_name(self.variables.get("params", {}).get("mlp")):  # params from add_mixlora
            if adapter_ids is not None:
                raise ValueError("a MixLoRA model serves its own experts; it cannot also serve stacked adapters")
            h, stats = MixLoraMlp(config.mlp, config.policy.compute_dtype, name="mlp")(h, real)
        else:
            h = Mlp(
                config.mlp_dim,
                config.mlp,
                config.init_std,
                config.policy.compute_dtype,
                param_dtype,
                quantized_impl=config.quantized_impl,
                name="mlp",
            )(h, adapter_ids)
        if config.post_norms:
            h = make_norm(config.norm, config.norm_eps, param_dtype=param_dtype, name="mlp_post_norm")(h)
        return constrain(x + h, ("batch", "seq", "embed")), state, router_logits, stats


class BlockGroup(nn.Module):
    """One period of the block pattern: blocks ``block_0 .. block_<n-1>`` in order, the first
    of them layer ``first_layer``.

    ``((x, router_logits, pools), (states, page_offset), broadcast...) -> ((x, router_logits,
    pools), (states, stats))``: the signature ``nn.scan`` iterates. ``pools`` are the blocks'
    pages for all groups (``ember.models.cache.fold_pages``), carried whole so a step updates
    them in place; this group's pages start at ``page_offset``. ``states`` are this group's
    other cache entries. ``stats`` holds the balance statistics of the MoE blocks by block name.
    """

    config: ModelConfig
    num_blocks: int
    first_layer: int = 0

    @nn.compact
    def __call__(self, carry, group_cache, positions, segment_ids, paging, valid):
        x, router_logits, pools = carry
        states, page_offset = group_cache
        new_states = None if states is None else dict(states)
        new_pools = None if pools is None else dict(pools)
        group_paging = None if paging is None else paging.offset_pages(page_offset)
        stats = {}
        for j in range(self.num_blocks):
            name = f"block_{j}"
            layer = self.first_layer + j
            state = None if states is None else {**states[name], **pools[name]}
            kinds = (
                self.config.layer_kinds[layer],
                self.config.layer_mlps[layer],
                self.config.layer_transfer_kinds[layer],
            )
            block = Block(self.config, *kinds, name=name)
            x, state, router_logits, block_stats = block(
                x, positions, segment_ids, state, group_paging, valid, router_logits
            )
            if new_states is not None:
                new_pools[name] = {entry: leaf for entry, leaf in state.items() if entry in PAGE_ENTRIES}
                new_states[name] = {entry: leaf for entry, leaf in state.items() if entry not in PAGE_ENTRIES}
            if block_stats is not None:
                stats[name] = block_stats
        return (x, router_logits, new_pools), (new_states, stats)


class DecoderLM(nn.Module):
    """Token ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]`` (and the updated cache)."""

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        cache: dict[str, Any] | None = None,
        segment_ids: jax.Array | None = None,
        logits_at: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, Any] | None]:
        """Runs the model.

        Args:
          tokens: int ``[batch, seq]``.
          positions: int ``[batch, seq]`` rotary positions; default ``arange(seq)``. Not with
            a cache (its runs give the positions).
          cache: a ragged cache (a serving step's flat token budget, ``tokens [1,
            num_tokens]``; see ``ember.models.cache``: tokens outside every run are
            padding), or None (no cache returned).
          segment_ids: int ``[batch, seq]`` packed-document ids without a cache (a token
            attends only within its document; pass positions restarting per document), from
            1; 0 marks padding, which MoE and MixLoRA layers route to no expert and leave out
            of their balance statistics and capacity (Ember's batches pad with 0). Not with a
            cache.
          logits_at: int ``[batch, n]``: compute logits only at these sequence indices
            (the head is the largest matmul of a decode step); default every index.

        Returns:
          ``(logits [batch, seq or n, vocab] in the output dtype, updated cache or None)``.
        """
        config = self.config
        policy = config.policy
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, seq] ints, got shape {tokens.shape}")
        batch, seq = tokens.shape
        valid = paging = None
        if cache is not None:
            paging, positions, valid = self._ragged_paging(cache, tokens, positions, segment_ids)
            segment_ids = None
        elif positions is None:
            positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None, :], (batch, seq))
        if positions.shape != tokens.shape:
            raise ValueError(f"positions must have the tokens' shape {tokens.shape}, got {positions.shape}")

        embed = token_embedding(config, name="embed")
        x = constrain(scaled_embeddings(config, embed(tokens)), ("batch", "seq", "embed"))
        states = None if cache is None else cache["layers"]
        x, states, moe_stats = self._layers(x, states, positions, segment_ids, paging, valid)
        if moe_stats:
            self._sow_moe_outputs(moe_stats)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[..., None].astype(jnp.int32), axis=1)
        x = make_norm(config.norm, config.norm_eps, param_dtype=policy.param_dtype, name="final_norm")(x)
        if config.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = OutputHead(
                config.vocab_size, config.init_std, policy.compute_dtype, policy.param_dtype, name="head"
            )(x)
        logits = soft_cap(logits.astype(jnp.float32), config.final_soft_cap or None).astype(policy.output_dtype)
        logits = constrain(logits, ("batch", "seq", "vocab"))
        if cache is None:
            return logits, None
        return logits, {**cache, "layers": states}

    def _ragged_paging(self, cache, tokens, positions, segment_ids):
        """``(paging, positions [1, num_tokens], valid [1, num_tokens])`` of a ragged cache."""
        if tokens.shape[0] != 1 or positions is not None or segment_ids is not None:
            raise ValueError(
                "a ragged cache takes tokens [1, num_tokens] and derives positions and padding from its runs; "
                f"got tokens {tokens.shape}, positions {'set' if positions is not None else 'None'}, "
                f"segment_ids {'set' if segment_ids is not None else 'None'}"
            )
        starts, lens, kv_lens = (cache[name].astype(jnp.int32) for name in ("query_starts", "query_lens", "kv_lens"))
        owner, token_positions, covered = token_owners(starts, lens, kv_lens, tokens.shape[1])
        paging = Paging(cache["page_table"], starts, lens, kv_lens, owner, cache.get("adapters"))
        return paging, jnp.where(covered, token_positions, 0)[None], covered[None]

    def _layers(self, x, states, positions, segment_ids, paging, valid):
        """``(x, states, per-MoE-layer balance statistics in layer order)``."""
        config = self.config
        period = config.layer_period
        groups = num_groups(config)
        router_logits = initial_router_logits(config, x)
        pools, pages_per_group = None, 0
        if states is not None:
            pools, states = fold_pages(states)
            pages_per_group = next((leaf.shape[0] // groups for leaf in jax.tree.leaves(pools)), 0)
        group_cls = BlockGroup
        if config.remat != "none":
            group_cls = nn.remat(BlockGroup, policy=_REMAT_POLICIES[config.remat], prevent_cse=not config.scan_layers)
        if config.scan_layers:
            scanned = nn.scan(
                group_cls,
                variable_axes={"params": 0, "balance": 0, CALIBRATION: 0, "losses": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                length=config.num_layers // period,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            page_offsets = None if states is None else jnp.arange(groups, dtype=jnp.int32) * pages_per_group
            (x, _, pools), (states, stats) = scanned(config, period, name="layers")(
                (x, router_logits, pools), (states, page_offsets), positions, segment_ids, paging, valid
            )
            per_layer = [
                jax.tree.map(lambda leaf, g=g: leaf[g], stats[f"block_{j}"])
                for g in range(groups)
                for j in range(period)
                if f"block_{j}" in stats
            ]
            return x, None if states is None else unfold_pages(pools, states, groups), per_layer
        new_groups, per_layer = [], []
        for g in range(groups):
            group_states = None if states is None else jax.tree.map(lambda leaf, g=g: leaf[g], states)
            first_layer, num_blocks = group_span(config, g)
            (x, router_logits, pools), (group_states, stats) = group_cls(
                config, num_blocks, first_layer, name=f"group_{g}"
            )((x, router_logits, pools), (group_states, g * pages_per_group), positions, segment_ids, paging, valid)
            new_groups.append(group_states)
            per_layer.extend(stats[f"block_{j}"] for j in range(num_blocks) if f"block_{j}" in stats)
        if states is None:
            return x, None, per_layer
        # Every group returns all its entries (a last partial group passes unused ones through).
        states = jax.tree.map(lambda *leaves: jnp.stack(leaves), *new_groups)
        return x, unfold_pages(pools, states, groups), per_layer

    def _sow_moe_outputs(self, per_layer: list[dict[str, jax.Array]]) -> None:
        """Sows the global load-balancing and z losses (collection ``losses``: ``load_balance``,
        ``router_z``) and each MoE layer's ``metrics`` (``expert_load [R]``,
        ``load_imbalance``, ``dropped_fraction``, ``router_entropy``, once per layer in layer order)."""
        total = combine_statistics(per_layer)
        self.sow("losses", "load_balance", load_balancing_loss(total))
        self.sow("losses", "router_z", router_z_loss(total))
        for stats in per_layer:
            for name, value in layer_metrics(stats).items():
                self.sow("metrics", name, value)


def token_embedding(config: ModelConfig, **kwargs) -> Embed:
    """The token embedding of ``config``'s model (``DecoderLM``'s ``embed``; with ``name=...``
    inside it, or standalone: ``token_embedding(config).apply({"params": params["embed"]}, tokens)``)."""
    policy = config.policy
    return Embed(config.vocab_size, config.d_model, config.init_std, policy.compute_dtype, policy.param_dtype, **kwargs)


def scaled_embeddings(config: ModelConfig, x: jax.Array) -> jax.Array:
    """The token embeddings ``x [batch, seq, embed]`` times ``config.embed_scale``, in their own
    dtype (as Gemma scales them): what the first block reads."""
    return x if config.embed_scale == 1.0 else x * jnp.asarray(config.embed_scale, x.dtype)


def initial_router_logits(config: ModelConfig, x: jax.Array) -> jax.Array | None:
    """The router logits the first group receives for ``x [batch, seq, embed]``: zeros
    ``[batch, seq, experts]`` f32 for MoE++'s gating residual, else None (none carried)."""
    if config.moe.gating_residual and "moe" in config.layer_mlps:
        return jnp.zeros((*x.shape[:2], config.moe.total_experts), jnp.float32)
    return None

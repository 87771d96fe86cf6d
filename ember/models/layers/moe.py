"""``MoeMlp``: the mixture-of-experts feed-forward block (``mlp_pattern`` entry ``moe``).

Parameters (``E`` FFN experts, ``R`` routed experts with MoE++'s zero-computation ones):

- ``router/kernel [embed, R]``; with ``gating_residual`` also ``router/residual [R, R]``.
- ``experts/gate`` (gated kinds), ``experts/up [E, embed, expert_mlp]``, ``experts/down
  [E, expert_mlp, embed]``, logical axes ``("expert", "embed", "mlp")`` / ``("expert", "mlp", "embed")``;
  or each stored quantized (``ember.models.quantization.stored``, one matrix per expert), read
  back as floats one layer at a time: the weights sit quantized in memory, the dispatch paths
  multiply floats.
- ``shared/{gate,up,down}`` (an ordinary ``Mlp``) and ``shared_gate [embed, 1]``.
- ``constant_vectors [C, embed]`` and ``constant_kernel [embed, C, 2]`` (MoE++ constant experts).
- collection ``balance``: ``router_bias [R]`` f32 (not a parameter) with ``bias_balancing_rate``.
- collection ``calibration`` (GPTQ's pass only): ``experts/{gate,up,down}_gram``, each expert's
  input Gram matrices from the token-slots dispatched to it (``ExpertWeights.record_inputs``).

The routing math is in ``router.py``, the dispatch in ``moe_dispatch.py``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.sharding import constrain
from ember.models.adapters.lowrank import adapted_weight, read_low_rank
from ember.models.config import ModelConfig
from ember.models.layers.expert_parallel import expert_parallel_ranks, expert_parallel_routed_mlp
from ember.models.layers.kernel_shards import unshared_with
from ember.models.layers.mlp import GATED, Mlp
from ember.models.layers.moe_dispatch import (
    apply_capacity,
    expert_input_grams,
    routed_expert_mlp_per_shard,
    slot_capacity,
)
from ember.models.layers.router import balance_statistics, route, updated_balance_bias
from ember.models.quantization.stored import calibrating, dequantized, read_quantized, record_gram


class ExpertWeights(nn.Module):
    """The stacked FFN experts' matrices ``(gate | None, up, down)`` in the compute dtype.

    A matrix with a low-rank adapter per expert (``up_lora_a [E, embed, rank]`` ..., see
    ``ember.models.adapters``) is returned merged, ``W_e + scale A_e B_e``: the expert
    dispatch paths (grouped, capacity, expert-parallel) take weight matrices. The cost over an
    unmerged delta is the experts' weight-gradient matmul while fine-tuning.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self):
        config = self.config
        experts, embed, hidden = config.moe.num_experts, config.d_model, config.expert_dim
        init = nn.initializers.normal(config.init_std)

        def weight(name, shape, axes):
            stored = read_quantized(self, name)
            if stored is None:
                param = self.param(name, nn.with_logical_partitioning(init, axes), shape, config.policy.param_dtype)
            else:  # [E, in, out]: each expert's matrix dequantized
                floats = jax.vmap(lambda parts: dequantized(parts, shape[1:2], config.policy.compute_dtype))
                param = floats(_laid_out_for_dispatch(stored.parts, axes))
            param = adapted_weight(param, read_low_rank(self, name), in_dims=1, lead_dims=1)
            return param.astype(config.policy.compute_dtype)

        gate = None
        if config.mlp in GATED:
            gate = weight("gate", (experts, embed, hidden), ("expert", "embed", "mlp"))
        up = weight("up", (experts, embed, hidden), ("expert", "embed", "mlp"))
        down = weight("down", (experts, hidden, embed), ("expert", "mlp", "embed"))
        return gate, up, down

    def record_inputs(self, x, expert_ids, gate, up) -> None:
        """GPTQ's calibration: sows each expert's input Gram matrices (``gate_gram``, ``up_gram``
        ``[E, embed, embed]``: the token-slots dispatched to it; ``down_gram [E, expert_mlp,
        expert_mlp]``: their hidden activations; ``moe_dispatch.expert_input_grams``) when
        ``calibration`` is mutable. ``expert_ids`` as the layer dispatches them: capacity drops
        and padding are no expert's input, and an expert no token reached sows zeros.

        Their cost: ``4 E (2 embed^2 + expert_mlp^2)`` bytes per MoE layer (gate's and up's
        Grams are equal, sown under each name, as a dense MLP's), ``E`` times a dense MLP's, kept
        for every layer until GPTQ has run: 7.7 GB per layer of Mixtral-8x7B (E 8, embed 4096,
        expert_mlp 14336), 245 GB for its 32 layers, where a dense MLP of that width in each
        layer would take 31 GB."""
        if not calibrating(self):
            return
        config = self.config
        inputs, hidden = expert_input_grams(x, expert_ids, gate, up, activation=config.mlp, impl=config.moe_impl)
        for name in ("gate", "up") if gate is not None else ("up",):
            record_gram(self, name, inputs)
        record_gram(self, "down", hidden)


def _laid_out_for_dispatch(parts, axes):
    """A quantized expert matrix's stored parts (``[E, rows, out]`` codes and scales, NF4's
    ``absmax_scale [E, blocks]`` and ``absmax_mean [E]``) laid out as the dispatch takes the float
    weight: the experts split (expert parallelism), an axis whose mesh axes the batch takes too
    (FSDP's ``embed``) whole. XLA then gathers the codes and dequantises on each device; left to
    itself it dequantised each FSDP shard and gathered the floats (f32 on CPU: 8x NF4's bytes)."""
    layout = (axes[0], *unshared_with(("batch",), axes[1:]))
    return {
        name: constrain(part, layout if part.ndim == 3 else layout[:1] + (None,) * (part.ndim - 1))
        for name, part in parts.items()
    }


class Router(nn.Module):
    """Router logits ``[tokens, R]`` in f32 (plus the projected previous logits: MoE++)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, previous_logits):
        moe, param_dtype = self.config.moe, self.config.policy.param_dtype
        init = nn.initializers.normal(self.config.init_std)
        axes = nn.with_logical_partitioning(init, ("embed", None))
        kernel = self.param("kernel", axes, (x.shape[-1], moe.total_experts), param_dtype)
        logits = x.astype(jnp.float32) @ kernel.astype(jnp.float32)
        if moe.gating_residual:
            residual_init = nn.with_logical_partitioning(init, (None, None))
            residual = self.param("residual", residual_init, (moe.total_experts,) * 2, param_dtype)
            logits = logits + previous_logits.astype(jnp.float32) @ residual.astype(jnp.float32)
        return logits


class MoeMlp(nn.Module):
    """``x [batch, seq, embed] -> (y [batch, seq, embed], router logits [batch, seq, R],
    balance statistics)`` (see ``router.balance_statistics``).

    ``previous_logits``: the last MoE layer's router logits (``gating_residual``; None
    otherwise); ``token_mask [batch, seq]``: the real tokens (None: all); the others (a
    serving step's unused budget, a training batch's padding) take no expert rows, do not
    count in the statistics, and neither take capacity slots nor add any (the capacity is
    computed from the real tokens).
    ``adapter_ids [batch, seq]``: each token's adapter for the shared experts' stacked adapters
    (serving several at once; routed experts' adapters are merged per expert, never stacked).
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x, previous_logits=None, token_mask=None, adapter_ids=None):
        config, moe = self.config, self.config.moe
        batch, seq, embed = x.shape
        x = x.astype(config.policy.compute_dtype)
        flat = x.reshape(batch * seq, embed)
        if previous_logits is not None:
            previous_logits = previous_logits.reshape(batch * seq, -1)
        logits = Router(config, name="router")(flat, previous_logits)
        bias = None
        if moe.bias_balancing_rate:
            bias = self.variable("balance", "router_bias", jnp.zeros, (moe.total_experts,), jnp.float32)
        routing = route(
            logits,
            top_k=moe.top_k,
            score=moe.score,
            renormalize=moe.renormalize,
            routed_scaling=moe.routed_scaling,
            selection_bias=None if bias is None else bias.value,
        )
        expert_ids, dropped = routing.expert_ids, jnp.zeros(routing.expert_ids.shape, bool)
        mask = None if token_mask is None else token_mask.reshape(-1)
        if mask is not None:  # padding takes no expert rows or capacity
            expert_ids = jnp.where(mask[:, None], expert_ids, moe.total_experts)
        if moe.capacity_factor:
            tokens = batch * seq if mask is None else jnp.sum(mask, dtype=jnp.int32)
            capacity = slot_capacity(moe.capacity_factor, tokens, moe.top_k, moe.num_experts)
            _, dropped = apply_capacity(expert_ids, moe.num_experts, capacity)
            # Out of every routed range: id num_experts would be the first zero/copy/constant expert.
            expert_ids = jnp.where(dropped, moe.total_experts, expert_ids)
        experts = ExpertWeights(config, name="experts")
        gate, up, down = experts()
        experts.record_inputs(flat, expert_ids, gate, up)
        # Tokens split over a current mesh's expert axis are exchanged with all_to_all; otherwise
        # each device dispatches its tokens to its experts (the capacity drops above are the
        # whole batch's).
        dispatch = expert_parallel_routed_mlp if expert_parallel_ranks() > 1 else routed_expert_mlp_per_shard
        y = dispatch(flat, expert_ids, routing.weights, gate, up, down, activation=config.mlp, impl=config.moe_impl)
        y = y + self._zero_computation_experts(flat, expert_ids, routing.weights)
        if moe.shared_experts:
            y = y + self._shared_experts(flat, None if adapter_ids is None else adapter_ids.reshape(-1))
        stats = balance_statistics(logits, routing.expert_ids, score=moe.score, dropped=dropped, token_mask=mask)
        if bias is not None and self.is_mutable_collection("balance") and not self.is_initializing():
            bias.value = updated_balance_bias(bias.value, stats["counts"], moe.bias_balancing_rate)
        return y.reshape(batch, seq, embed), logits.reshape(batch, seq, -1), stats

    def _zero_computation_experts(self, x, expert_ids, weights):
        """MoE++: ``sum_k w_k * out_k`` over the slots routed to zero, copy and constant experts."""
        moe = self.config.moe
        first_copy = moe.num_experts + moe.num_zero_experts
        first_constant = first_copy + moe.num_copy_experts
        x32 = x.astype(jnp.float32)
        out = jnp.zeros_like(x32)
        if moe.num_copy_experts:
            is_copy = (expert_ids >= first_copy) & (expert_ids < first_constant)
            out = out + jnp.sum(jnp.where(is_copy, weights, 0.0), axis=1, keepdims=True) * x32
        if moe.num_constant_experts:
            count, dtype = moe.num_constant_experts, self.config.policy.param_dtype
            init = nn.initializers.normal(self.config.init_std)
            vectors = self.param("constant_vectors", nn.with_logical_partitioning(init, (None, "embed")),
                                 (count, x.shape[-1]), dtype)  # fmt: skip
            kernel = self.param("constant_kernel", nn.with_logical_partitioning(init, ("embed", None, None)),
                                (x.shape[-1], count, 2), dtype)  # fmt: skip
            mix = jax.nn.softmax(jnp.einsum("td,dcj->tcj", x32, kernel.astype(jnp.float32)), axis=-1)
            # [tokens, C, embed]: constant expert c's output a_c x + b_c v_c for every token.
            outputs = mix[..., :1] * x32[:, None, :] + mix[..., 1:] * vectors.astype(jnp.float32)[None]
            slot_of = jax.nn.one_hot(expert_ids - first_constant, count, dtype=jnp.float32)  # [tokens, K, C]
            out = out + jnp.einsum("tk,tkc,tcd->td", weights, slot_of, outputs)
        return out.astype(x.dtype)

    def _shared_experts(self, x, adapter_ids=None):
        """The always-on experts (one MLP), gated by ``sigmoid(x @ shared_gate)`` when configured."""
        config, moe = self.config, self.config.moe
        width = moe.shared_experts * (moe.shared_expert_dim or config.expert_dim)
        policy = config.policy
        out = Mlp(
            width,
            config.mlp,
            config.init_std,
            policy.compute_dtype,
            policy.param_dtype,
            quantized_impl=config.quantized_impl,
            name="shared",
        )(x, adapter_ids)
        if moe.shared_expert_gate:
            init = nn.with_logical_partitioning(nn.initializers.normal(config.init_std), ("embed", None))
            kernel = self.param("shared_gate", init, (x.shape[-1], 1), policy.param_dtype)
            out = jax.nn.sigmoid(x.astype(jnp.float32) @ kernel.astype(jnp.float32)).astype(out.dtype) * out
        return out


__all__ = ["ExpertWeights", "MoeMlp", "Router"]

"""MixLoRA: fresh experts leave the model as it was; trained experts equal a per-expert loop
of merged MLPs (values, and gradients of A, B and the router), scanned and unrolled; the
load-balancing loss and expert loads are sown as computed by hand; a few masked optimizer
steps lower the loss and never touch the base; what cannot take MixLoRA says so."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ember.core.errors import ConfigError
from ember.core.sharding import unbox
from ember.core.tree import param_paths
from ember.models.adapters import (
    LoraConfig,
    MixLoraConfig,
    adapter_mask,
    add_lora,
    add_mixlora,
    merge,
    without_adapters,
)
from ember.models.config import ModelConfig, MoEConfig
from ember.models.decoder import DecoderLM
from ember.models.layer_layout import layers_to_list
from ember.models.layers.mlp import mlp
from ember.models.layers.router import load_balancing_loss
from ember.training.task import apply_model
from ember.training.trainable import merge as merge_subset
from ember.training.trainable import select
from tests.models.padded_batches import padded_and_compact
from tests.moved_adapters import moved
from tests.tolerances import assert_allclose

CONFIG = ModelConfig(vocab_size=41, d_model=16, num_layers=2, num_heads=2, mlp_dim=24, max_seq_len=16, init_std=0.1)
MIX = MixLoraConfig(num_experts=4, top_k=2, rank=3, alpha=6, router_init_std=0.5)
TOKENS = jax.random.randint(jax.random.key(5), (2, 7), 0, 41)


def base_params(config):
    # Jitted: op by op, the init (and the eager TOKENS[:1]) compiled dozens of programs.
    return jax.jit(lambda: unbox(DecoderLM(config).init(jax.random.key(0), TOKENS[:1])["params"]))()


# Jitted (MIX is hashable): op by op, adding the experts compiled a program per shape.
add_mixlora_jit = jax.jit(add_mixlora, static_argnums=1)


def expert_factor_or_router(path):
    return path.endswith(("_lora_a", "_lora_b")) or "mixlora_router" in path


@jax.jit
def trained(params, seed=1, scale=0.3):
    return moved(params, seed, scale, moves=expert_factor_or_router)


def reference_mlp(x, layer):
    """Each token through its top-k experts' merged MLPs, one expert at a time."""
    params = layer["mlp"]
    router = next(v for k, v in params.items() if k.startswith("mixlora_router"))
    probs = jax.nn.softmax(x @ router, axis=-1)
    top_p, top_e = jax.lax.top_k(probs, MIX.top_k)
    top_p = top_p / top_p.sum(-1, keepdims=True)

    def expert(e):
        weights = {}
        for name in ("gate", "up", "down"):
            a, b, s = params[f"{name}_lora_a"][e], params[f"{name}_lora_b"][e], params[f"{name}_lora_scale"]
            weights[name] = params[name] + s * a @ b
        return mlp(x, weights["up"], weights["down"], "swiglu", weights["gate"])

    outputs = jnp.stack([expert(e) for e in range(MIX.num_experts)], axis=-2)  # [..., E, embed]
    chosen = jnp.take_along_axis(outputs, top_e[..., None], axis=-2)
    return jnp.sum(top_p[..., None] * chosen, axis=-2)


def reference_logits(config, params, tokens):
    """The model with each MLP replaced by :func:`reference_mlp`, layer by layer."""
    from ember.models.decoder import Block

    x = params["embed"]["embedding"][tokens]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    for layer in layers_to_list(config, params):
        attn_only = {k: v for k, v in layer.items() if k != "mlp" and k != "mlp_norm"}
        block = Block(config, "global", "none")
        x, *_ = block.apply({"params": attn_only}, x, positions, None, None, None, None)
        norm = layer["mlp_norm"]["scale"]
        h = x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + config.norm_eps) * norm
        x = x + reference_mlp(h, layer)
    x = x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + config.norm_eps) * params["final_norm"]["scale"]
    return x @ params["head"]["kernel"] if "head" in params else x @ params["embed"]["embedding"].T


@pytest.mark.parametrize("scan_layers", [True, False])
def test_mixlora_starts_as_the_base_and_equals_a_per_expert_loop(scan_layers):
    config = dataclasses.replace(CONFIG, scan_layers=scan_layers)
    base = base_params(config)
    fresh = add_mixlora_jit(base, MIX, jax.random.key(1))
    model = DecoderLM(config)
    # Jitted: op by op, the scanned model and its gradient took ~20 s on CPU.
    logits = jax.jit(lambda p: model.apply({"params": p}, TOKENS)[0])
    reference = jax.jit(lambda p: reference_logits(config, p, TOKENS))
    base_logits = logits(base)
    assert_allclose(logits(fresh), base_logits)
    params = trained(fresh)
    out = logits(params)
    assert_allclose(out, reference(params), scale=10)
    assert not np.allclose(out, base_logits, atol=1e-3)

    def loss(logits_fn):
        return lambda p: jnp.sum(jnp.tanh(logits_fn(p)))

    grads = jax.jit(jax.grad(loss(logits)))(params)
    expected = jax.jit(jax.grad(loss(reference)))(params)
    trained_paths = [p for p, on in param_paths(adapter_mask(params)).items() if on]
    assert any("mixlora_router" in p for p in trained_paths)
    for path in trained_paths:
        got = param_paths(grads)[path]
        assert np.abs(got).max() > 0, path
        assert_allclose(got, param_paths(expected)[path], scale=100, err_msg=path)


def test_load_balance_is_sown_and_training_moves_only_the_experts():
    config = dataclasses.replace(CONFIG, scan_layers=False)
    params = trained(add_mixlora_jit(base_params(config), MIX, jax.random.key(1)), scale=0.1)
    # Jitted, as is the hand computation and the optimizer step: op by op, ~170 programs.
    outputs = jax.jit(lambda p: apply_model(DecoderLM(config), p, TOKENS))(params)

    @jax.jit
    def by_hand(params):
        """The global Switch loss over both layers' tokens, from each layer's MLP input, and the mean load."""
        _, captured = DecoderLM(config).apply({"params": params}, TOKENS, capture_intermediates=True, mutable=True)
        counts, probs, loads = 0.0, 0.0, []
        for g in range(2):
            (h,) = captured["intermediates"][f"group_{g}"]["block_0"]["mlp_norm"]["__call__"]
            router = params[f"group_{g}"]["block_0"]["mlp"][f"mixlora_router_top{MIX.top_k}"]
            p = jax.nn.softmax(h.reshape(-1, h.shape[-1]) @ router, -1)
            layer_counts = jax.nn.one_hot(jax.lax.top_k(p, MIX.top_k)[1], MIX.num_experts).sum((0, 1))
            counts, probs = counts + layer_counts, probs + p.sum(0)
            loads.append(layer_counts / layer_counts.sum())
        loss = load_balancing_loss({"counts": counts, "prob_sum": probs, "rows": jnp.float32(2 * TOKENS.size)})
        return loss, (loads[0] + loads[1]) / 2

    expected, expected_load = by_hand(params)
    assert_allclose(outputs.aux["load_balance"], expected)
    assert_allclose(outputs.metrics["expert_load"], expected_load)

    mask = adapter_mask(params)
    tx = optax.adam(3e-2)
    trainable = select(params, mask)
    state = jax.jit(tx.init)(trainable)

    def objective(subset):
        out = apply_model(DecoderLM(config), merge_subset(params, subset), TOKENS)
        logits = out.output[0]
        nll = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), TOKENS[:, 1:, None], -1))
        return nll + 0.01 * out.aux["load_balance"]

    @jax.jit
    def step(trainable, state):
        loss, grads = jax.value_and_grad(objective)(trainable)
        updates, state = tx.update(grads, state, trainable)
        return optax.apply_updates(trainable, updates), state, loss

    losses = []
    for _ in range(8):
        trainable, state, loss = step(trainable, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses
    after = merge_subset(params, trainable)
    jax.tree.map(np.testing.assert_array_equal, without_adapters(after), without_adapters(params))


def test_what_cannot_take_mixlora_says_so():
    moe = dataclasses.replace(CONFIG, mlp_pattern=("moe",), moe=MoEConfig(num_experts=2, top_k=1, expert_dim=8))
    with pytest.raises(ConfigError, match="MoE layers"):
        add_mixlora(base_params(moe), MIX, jax.random.key(0))
    params = add_mixlora_jit(base_params(CONFIG), MIX, jax.random.key(0))
    with pytest.raises(ConfigError, match="already has MixLoRA"):
        add_mixlora(params, MIX, jax.random.key(0))
    with pytest.raises(ConfigError, match="cannot be merged"):
        merge(params)
    # A plain LoRA already on an MLP matrix would be overwritten by the experts' A, B and scale.
    lora = add_lora(base_params(CONFIG), LoraConfig(rank=2, targets=("q", "up")), jax.random.key(1))
    with pytest.raises(ConfigError, match="already has an adapter") as error:
        add_mixlora(lora, MIX, jax.random.key(0))
    assert error.value.key == "mixlora.targets"
    add_mixlora(lora, dataclasses.replace(MIX, targets=("gate", "down")), jax.random.key(0))  # the others take it
    with pytest.raises(ConfigError) as error:
        MixLoraConfig(num_experts=4, top_k=5)
    assert error.value.key == "mixlora.top_k"
    for field, value in (("alpha", 0.0), ("router_init_std", -0.1)):  # were keyed mixlora.rank
        with pytest.raises(ConfigError, match=f"mixlora.{field} must be positive") as error:
            MixLoraConfig(**{field: value})
        assert error.value.key == f"mixlora.{field}"


def test_training_padding_is_left_out_of_the_load_balance():
    """A training batch's padding (segment id 0) counts in neither the load-balancing loss nor
    the expert loads: they are those of the same documents packed without padding."""
    config = dataclasses.replace(CONFIG, scan_layers=False)
    params = trained(add_mixlora_jit(base_params(config), MIX, jax.random.key(1)), scale=0.1)
    batches = padded_and_compact(config.vocab_size)
    outputs = jax.jit(lambda t, p, s: apply_model(DecoderLM(config), params, t, positions=p, segment_ids=s))
    padded, compact = outputs(*batches.padded), outputs(*batches.compact)
    assert_allclose(padded.output[0][batches.real], compact.output[0][0], scale=10)
    assert_allclose(padded.aux["load_balance"], compact.aux["load_balance"], scale=10)
    assert_allclose(padded.metrics["expert_load"], compact.metrics["expert_load"], scale=10)

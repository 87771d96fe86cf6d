"""The MoE layer against a per-expert loop reference (values and gradients) for each routing
option, the capacity path's drops against a slot-by-slot count, the dispatch's gather-only VJP,
bias balancing's update, and MoE layers interleaved in the decoder."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.core.errors import ConfigError
from ember.models.config import ModelConfig, MoEConfig
from ember.models.decoder import DecoderLM
from ember.models.layer_layout import layers_from_list, layers_to_list
from ember.models.layers.mlp import mlp
from ember.models.layers.moe import MoeMlp
from ember.models.layers.moe_dispatch import apply_capacity, routed_expert_mlp
from ember.models.layers.router import balance_statistics, load_balancing_loss, router_z_loss
from tests.host_random import numpy_rng
from tests.models.padded_batches import padded_and_compact
from tests.tolerances import assert_allclose

BASE = ModelConfig(vocab_size=61, d_model=16, num_layers=2, num_heads=2, mlp_dim=24, moe_impl="xla")
CASES = {
    "mixtral": MoEConfig(num_experts=4, top_k=2, expert_dim=12),
    "qwen2_moe": MoEConfig(
        num_experts=5, top_k=2, expert_dim=8, renormalize=False, shared_experts=1, shared_expert_dim=10,
        shared_expert_gate=True,
    ),
    "sigmoid_scaled_bias": MoEConfig(
        num_experts=6, top_k=3, expert_dim=8, score="sigmoid", routed_scaling=2.5, bias_balancing_rate=0.01,
        shared_experts=2,
    ),
    "moe_plus_plus": MoEConfig(
        num_experts=4, top_k=2, expert_dim=8, renormalize=False, num_zero_experts=1, num_copy_experts=1,
        num_constant_experts=2, gating_residual=True,
    ),
    "capacity": MoEConfig(num_experts=4, top_k=2, expert_dim=8, capacity_factor=0.6),
    # A dropped slot must output nothing, not become the copy expert that follows the FFN ones.
    "capacity_copy": MoEConfig(num_experts=4, top_k=2, expert_dim=8, capacity_factor=0.6, num_copy_experts=1),
}  # fmt: skip
TOKENS = 14


def reference_drops(expert_ids, num_experts, capacity):
    """Slot by slot, first choices before second ones, each in token order."""
    taken = [0] * num_experts
    dropped = np.zeros(expert_ids.shape, bool)
    for k in range(expert_ids.shape[1]):
        for t in range(expert_ids.shape[0]):
            e = int(expert_ids[t, k])
            if e < num_experts:
                dropped[t, k] = taken[e] >= capacity
                taken[e] += 1
    return dropped


def gate_of(experts, e):
    return experts["gate"][e] if "gate" in experts else None


def reference_moe(config, params, bias, x, previous, dropped):
    """The MoE block written as a loop over experts, every expert applied to every token.

    ``dropped`` (bool [tokens, top_k], from :func:`reference_drops`) marks the slots over
    capacity. Returns ``(out [tokens, embed], logits, expert_ids)``."""
    moe = config.moe
    logits = x @ params["router"]["kernel"]
    if moe.gating_residual:
        logits = logits + previous @ params["router"]["residual"]
    scores = jax.nn.softmax(logits, axis=-1) if moe.score == "softmax" else jax.nn.sigmoid(logits)
    choice = jax.lax.stop_gradient(scores + (0.0 if bias is None else bias))
    expert_ids = jnp.argsort(-choice, axis=-1)[:, : moe.top_k]
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if moe.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = jnp.where(dropped, 0.0, weights * moe.routed_scaling)
    experts = params["experts"]
    out = jnp.zeros_like(x)
    for e in range(moe.total_experts):
        weight = jnp.sum(jnp.where(expert_ids == e, weights, 0.0), axis=-1, keepdims=True)
        if e < moe.num_experts:
            expert_out = mlp(x, experts["up"][e], experts["down"][e], config.mlp, gate_of(experts, e))
        elif e < moe.num_experts + moe.num_zero_experts:
            expert_out = jnp.zeros_like(x)
        elif e < moe.num_experts + moe.num_zero_experts + moe.num_copy_experts:
            expert_out = x
        else:
            c = e - moe.num_experts - moe.num_zero_experts - moe.num_copy_experts
            a, b = jnp.moveaxis(jax.nn.softmax(x @ params["constant_kernel"][:, c], axis=-1), -1, 0)
            expert_out = a[:, None] * x + b[:, None] * params["constant_vectors"][c]
        out = out + weight * expert_out
    if moe.shared_experts:
        shared = params["shared"]
        shared_out = mlp(x, shared["up"], shared["down"], config.mlp, shared["gate"])
        if moe.shared_expert_gate:
            shared_out = jax.nn.sigmoid(x @ params["shared_gate"]) * shared_out
        out = out + shared_out
    return out, logits, expert_ids


def random_params(module, key, *args):
    """Random parameters of ``module``'s shapes (no init compiled): norm scales ``1 + N(0,
    0.1)``, the rest ``N(0, 0.3)``, far from any initialisation's structure."""
    abstract = nn.meta.unbox(jax.eval_shape(module.init, jax.random.PRNGKey(0), *args)["params"])
    generator = numpy_rng(key)

    def draw(path, leaf):
        noise = generator.standard_normal(leaf.shape).astype(np.float32)
        return jnp.asarray(1.0 + 0.1 * noise if path[-1].key == "scale" else 0.3 * noise)

    return jax.tree_util.tree_map_with_path(draw, abstract)


@pytest.fixture(scope="module", params=sorted(CASES))
def layer_case(request):
    """(name, config, module, random params, bias or None)."""
    config = dataclasses.replace(BASE, moe=CASES[request.param])
    module = MoeMlp(config)
    key = jax.random.PRNGKey(len(request.param))
    x = jnp.zeros((1, TOKENS, config.d_model))
    previous = jnp.zeros((1, TOKENS, config.moe.total_experts)) if config.moe.gating_residual else None
    params = random_params(module, key, x, previous)
    bias = None
    if config.moe.bias_balancing_rate:
        bias = jnp.asarray(numpy_rng(key).normal(0, 0.05, config.moe.total_experts), jnp.float32)
    return request.param, config, module, params, bias


def test_layer_equals_per_expert_loop_values_and_gradients(layer_case, rng):
    name, config, module, params, bias = layer_case
    generator = numpy_rng(rng)
    x = jnp.asarray(generator.standard_normal((TOKENS, config.d_model)), jnp.float32)
    previous = None
    if config.moe.gating_residual:
        previous = jnp.asarray(generator.standard_normal((TOKENS, config.moe.total_experts)), jnp.float32)
    cotangent = jnp.asarray(generator.standard_normal((TOKENS, config.d_model)), jnp.float32)
    variables = {"params": params} | ({} if bias is None else {"balance": {"router_bias": bias}})

    def ours(params, x):
        previous_3d = None if previous is None else previous[None]
        y, logits, stats = module.apply({**variables, "params": params}, x[None], previous_3d)
        return jnp.sum(y[0] * cotangent), (y[0], logits[0], stats)

    (_, (y, logits, stats)), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1), has_aux=True))(params, x)
    chosen = jnp.argsort(-(jax.nn.softmax(logits) if config.moe.score == "softmax" else jax.nn.sigmoid(logits))
                         - (0.0 if bias is None else bias), axis=-1)[:, : config.moe.top_k]  # fmt: skip
    dropped = np.zeros(chosen.shape, bool)
    if config.moe.capacity_factor:
        capacity = int(np.ceil(config.moe.capacity_factor * TOKENS * config.moe.top_k / config.moe.num_experts))
        dropped = reference_drops(np.asarray(chosen), config.moe.num_experts, capacity)
        assert dropped.any() and not dropped.all(), "the capacity case must drop some slots, not all"
        assert_allclose(stats["dropped"], dropped.sum())

    def reference(params, x):
        out, _, _ = reference_moe(config, params, bias, x, previous, dropped)
        return jnp.sum(out * cotangent), out

    (_, expected), expected_grads = jax.jit(jax.value_and_grad(reference, argnums=(0, 1), has_aux=True))(params, x)
    assert_allclose(y, expected, scale=10, err_msg=name)  # f32 sums in another order
    jax.tree.map(lambda a, b: assert_allclose(a, b, scale=10, err_msg=name), grads, expected_grads)
    np.testing.assert_array_equal(stats["counts"], np.bincount(np.asarray(chosen).ravel(), minlength=logits.shape[-1]))


def test_capacity_drops_exactly_the_reference_slots(rng):
    generator = numpy_rng(rng)
    for num_experts, capacity in ((4, 3), (6, 1), (3, 9)):
        ids = generator.integers(0, num_experts + 2, size=(23, 3))  # ids >= num_experts: zero-computation
        ours_ids, dropped = jax.jit(apply_capacity, static_argnums=(1, 2))(ids.astype(np.int32), num_experts, capacity)
        expected = reference_drops(ids, num_experts, capacity)
        np.testing.assert_array_equal(dropped, expected)
        np.testing.assert_array_equal(ours_ids, np.where(expected, num_experts, ids))


def test_masked_tokens_take_no_capacity(rng):
    """Padding interleaved with real tokens changes nothing for the real ones, even when
    capacity drops slots (ranks count real tokens only)."""
    config = dataclasses.replace(BASE, moe=CASES["capacity"])
    module = MoeMlp(config)
    generator = numpy_rng(rng)
    mask = np.array([True, False, True, True, False, True, True, False, True, True, True, False] * 2)
    x = jnp.asarray(generator.standard_normal((1, mask.size, config.d_model)), jnp.float32)
    params = random_params(module, rng, x)
    apply = jax.jit(lambda x, mask: module.apply({"params": params}, x, None, mask))
    padded, _, padded_stats = apply(x, jnp.asarray(mask)[None])
    # Compact with the same capacity: the real tokens plus padding at the end, masked out.
    compact = jnp.concatenate([x[:, mask], x[:, ~mask]], axis=1)
    compact_mask = jnp.asarray(np.arange(mask.size) < mask.sum())[None]
    expected, _, expected_stats = apply(compact, compact_mask)
    assert float(expected_stats["dropped"]) > 0
    assert_allclose(padded[0, mask], expected[0, : mask.sum()])
    jax.tree.map(assert_allclose, padded_stats, expected_stats)


def test_dispatch_gradient_has_no_scatter():
    x = jnp.ones((6, 8))
    ids = jnp.array([[0, 1], [1, 2], [2, 0], [0, 1], [3, 2], [1, 0]], jnp.int32)
    weights = jnp.full((6, 2), 0.5)
    up = jnp.ones((4, 8, 5))
    down = jnp.ones((4, 5, 8))

    def loss(x, weights, up, down):
        return jnp.sum(routed_expert_mlp(x, ids, weights, up, up, down, activation="swiglu", impl="xla"))

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, weights, up, down))
    assert "scatter" not in jaxpr and "gather" in jaxpr


def test_bias_balancing_updates_toward_the_mean_load(rng):
    config = dataclasses.replace(BASE, moe=CASES["sigmoid_scaled_bias"])
    module = MoeMlp(config)
    x = jax.random.normal(rng, (2, 9, config.d_model))
    bias = jnp.linspace(-0.1, 0.1, config.moe.total_experts)
    variables = {"params": random_params(module, rng, x), "balance": {"router_bias": bias}}
    (_, _, stats), state = jax.jit(lambda v, x: module.apply(v, x, mutable=["balance"]))(variables, x)
    counts = np.asarray(stats["counts"])
    expected = np.asarray(bias) + 0.01 * np.sign(counts.mean() - counts)
    assert_allclose(state["balance"]["router_bias"], expected)
    _, _, stats_frozen = jax.jit(module.apply)(variables, x)  # not mutable: the bias stays, no error
    np.testing.assert_array_equal(stats_frozen["counts"], counts)


def test_bias_balancing_lowers_the_max_load_of_a_skewed_router():
    """A router whose logits favour expert 0: repeated bias steps spread the load."""
    from ember.models.layers.router import route, updated_balance_bias

    logits = jax.random.normal(jax.random.PRNGKey(0), (256, 8)) * 0.3 + jnp.array([1.5, 1.0] + [0.0] * 6)
    bias = jnp.zeros(8)

    @jax.jit
    def max_over_mean(bias):
        ids = route(logits, top_k=2, score="sigmoid", renormalize=True, selection_bias=bias).expert_ids
        counts = jnp.bincount(ids.ravel(), length=8)
        return jnp.max(counts) / jnp.mean(counts), counts

    start, _ = max_over_mean(bias)
    for _ in range(60):
        _, counts = max_over_mean(bias)
        bias = updated_balance_bias(bias, counts, 0.01)
    end, _ = max_over_mean(bias)
    assert float(start) > 3.0 and float(end) < 1.5, (start, end)


MODEL = dataclasses.replace(
    BASE,
    num_layers=4,
    mlp_pattern=("moe", "dense"),
    moe=MoEConfig(num_experts=4, top_k=2, expert_dim=12, gating_residual=True, num_copy_experts=1),
)


@pytest.fixture(scope="module")
def decoder_params():
    return random_params(DecoderLM(MODEL), jax.random.PRNGKey(5), jnp.zeros((1, 8), jnp.int32))


def test_interleaved_moe_layers_scan_and_unrolled_agree_and_sow_global_losses(decoder_params, rng):
    tokens = jax.random.randint(rng, (2, 10), 0, MODEL.vocab_size)
    # Two scanned groups: the MoE++ gating residual crosses the scan's carry.
    assert MODEL.layer_mlps == ("moe", "dense", "moe", "dense") and MODEL.layer_period == 2
    (logits, _), sown = apply_sowing(MODEL, decoder_params, tokens)
    unrolled = dataclasses.replace(MODEL, scan_layers=False)
    layers = layers_to_list(MODEL, decoder_params)
    params_unrolled = {k: v for k, v in decoder_params.items() if k != "layers"} | layers_from_list(unrolled, layers)
    (logits_unrolled, _), sown_unrolled = apply_sowing(unrolled, params_unrolled, tokens)
    assert_allclose(logits, logits_unrolled, scale=10)
    jax.tree.map(lambda a, b: assert_allclose(a, b, scale=10), sown, sown_unrolled)
    assert len(sown["metrics"]["expert_load"]) == 2 and len(sown["losses"]["load_balance"]) == 1
    for load, imbalance in zip(sown["metrics"]["expert_load"], sown["metrics"]["load_imbalance"], strict=True):
        assert_allclose(np.sum(load), 1.0)
        assert_allclose(imbalance, np.max(load) / np.mean(load))
    # The global loss combines the layers' sums before the product; the mean of per-layer losses differs.
    intermediates = _router_logits_by_layer(unrolled, params_unrolled, tokens)
    statistics = jax.jit(
        lambda lg: balance_statistics(lg, jax.lax.top_k(jax.nn.softmax(lg), 2)[1], score="softmax", dropped=lg < 0)
    )
    per_layer = [statistics(lg) for lg in intermediates]
    total = jax.tree.map(lambda a, b: a + b, *per_layer)
    assert_allclose(sown["losses"]["load_balance"][0], load_balancing_loss(total), scale=10)
    assert_allclose(sown["losses"]["router_z"][0], router_z_loss(total), scale=10)
    assert abs(float(load_balancing_loss(total)) - np.mean([load_balancing_loss(s) for s in per_layer])) > 1e-4


def apply_sowing(config, params, tokens):
    model = DecoderLM(config)
    return jax.jit(lambda p, t: model.apply({"params": p}, t, mutable=["losses", "metrics"]))(params, tokens)


def _router_logits_by_layer(config, params, tokens):
    """Each MoE layer's router logits ``[tokens, R]``, captured with ``capture_intermediates``."""
    model = DecoderLM(config)
    capture = lambda module, _: type(module).__name__ == "Router"  # noqa: E731
    _, state = jax.jit(
        lambda p, t: model.apply({"params": p}, t, capture_intermediates=capture, mutable=["intermediates"])
    )(params, tokens)
    found = []
    for group in sorted(state["intermediates"]):
        for block in sorted(state["intermediates"][group]):
            found.append(state["intermediates"][group][block]["moe"]["router"]["__call__"][0])
    return found


def test_first_dense_layers_and_config_errors():
    config = dataclasses.replace(
        MODEL, scan_layers=False, mlp_pattern=("moe",), moe=dataclasses.replace(MODEL.moe, first_dense_layers=3)
    )
    assert config.layer_mlps == ("dense", "dense", "dense", "moe")
    shapes = jax.eval_shape(DecoderLM(config).init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    assert [sorted(shapes[f"group_{g}"]["block_0"]) for g in (2, 3)] == [
        ["attn", "attn_norm", "mlp", "mlp_norm"],
        ["attn", "attn_norm", "mlp_norm", "moe"],
    ]
    with pytest.raises(ConfigError, match=r"moe\.first_dense_layers needs scan_layers=false") as error:
        dataclasses.replace(config, scan_layers=True)
    assert error.value.key == "moe.first_dense_layers"
    with pytest.raises(ConfigError, match=r"moe.top_k must be in \[1, 4\]") as error:
        MoEConfig(num_experts=4, top_k=5)
    assert error.value.key == "moe.top_k"
    with pytest.raises(ConfigError, match=r"moe\.score must be one of softmax, sigmoid"):
        MoEConfig(score="relu")
    with pytest.raises(ConfigError, match="moe_impl must be one of"):
        dataclasses.replace(MODEL, moe_impl="cuda")


def test_moe_flops_count_the_active_experts():
    from ember.models.flops import flops_per_token

    dense = dataclasses.replace(BASE, mlp_dim=32)
    sparse = dataclasses.replace(dense, mlp_pattern=("moe",), moe=MoEConfig(num_experts=6, top_k=2, expert_dim=16))
    # Two experts of 16 channels are one MLP of 32; the router adds 2 * embed * experts per layer.
    router = 2 * BASE.d_model * 6 * BASE.num_layers
    assert flops_per_token(sparse, 8, training=False) == flops_per_token(dense, 8, training=False) + router


def test_training_padding_takes_no_capacity_and_is_left_out_of_the_losses(decoder_params):
    """A training batch's padding (segment id 0): the real tokens' logits, the balance and z
    losses and the expert loads are those of the same documents packed without padding, with
    capacity dropping slots (it counts the real tokens)."""
    config = dataclasses.replace(MODEL, moe=dataclasses.replace(MODEL.moe, capacity_factor=0.6))
    batches = padded_and_compact(config.vocab_size)
    model = DecoderLM(config)
    apply = jax.jit(
        lambda t, p, s: model.apply(
            {"params": decoder_params}, t, positions=p, segment_ids=s, mutable=["losses", "metrics"]
        )
    )
    (padded, _), padded_sown = apply(*batches.padded)
    (compact, _), compact_sown = apply(*batches.compact)
    assert all(float(d) > 0 for d in compact_sown["metrics"]["dropped_fraction"])
    assert_allclose(padded[batches.real], compact[0], scale=10)
    jax.tree.map(lambda a, b: assert_allclose(a, b, scale=10), padded_sown, compact_sown)


def test_calibration_sows_each_expert_s_grams_of_the_slots_it_was_dispatched(rng):
    """GPTQ's per-expert statistics against the routing written out by hand: each expert's
    ``gate``/``up`` Gram sums ``x x^T`` over the real tokens that chose it and kept their slot
    (capacity drops and padding are not its inputs), its ``down`` Gram ``h h^T`` over their hidden
    activations. Before, the layer sowed nothing for its experts (GPTQ rounded them to nearest)."""
    from ember.models.quantization import CALIBRATION

    config = dataclasses.replace(BASE, moe=CASES["capacity"])
    moe, module, generator = config.moe, MoeMlp(config), numpy_rng(rng)
    mask = np.array([True, True, False, True, True, True, False, True, True, True, True, True, True, False])
    x = jnp.asarray(generator.standard_normal((1, mask.size, config.d_model)), jnp.float32)
    params = random_params(module, rng, x)
    sown = jax.jit(lambda x: module.apply({"params": params}, x, None, mask[None], mutable=[CALIBRATION])[1])(x)
    grams = sown[CALIBRATION]["experts"]

    real = np.asarray(x[0, mask], np.float64)
    logits = real @ np.asarray(params["router"]["kernel"], np.float64)
    chosen = np.argsort(-logits, axis=-1, kind="stable")[:, : moe.top_k]  # softmax keeps the order
    capacity = int(np.ceil(moe.capacity_factor * mask.sum() * moe.top_k / moe.num_experts))
    dropped = reference_drops(chosen, moe.num_experts, capacity)
    assert dropped.any() and not dropped.all()
    experts = {name: np.asarray(w, np.float64) for name, w in params["experts"].items()}
    for e in range(moe.num_experts):
        rows = real[np.any((chosen == e) & ~dropped, axis=1)]
        silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
        hidden = silu(rows @ experts["gate"][e]) * (rows @ experts["up"][e])
        for name in ("gate", "up"):
            assert_allclose(grams[f"{name}_gram"][e], rows.T @ rows, scale=10, err_msg=f"expert {e} {name}")
        assert_allclose(grams["down_gram"][e], hidden.T @ hidden, scale=10, err_msg=f"expert {e} down")

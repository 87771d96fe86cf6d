"""Adapters as tree surgery: the default initialisation changes nothing, an adapted model
equals its merged weights (LoRA, rsLoRA, DoRA, experts, scanned and unrolled layers), merge
then unmerge is bit for bit, PiSSA keeps the model, gradients through the unmerged delta
equal those through the merged weight, adapters carry their weights' logical axes, dropout
applies only with a dropout RNG, and bad configs name their key."""

import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.core.errors import ConfigError
from ember.core.tree import param_paths
from ember.models.adapters import LoraConfig, adapter_mask, add_lora, merge, merged_weights, unmerge, without_adapters
from ember.models.adapters.layout import TARGETS, weight_layout
from ember.models.config import ModelConfig, MoEConfig
from ember.models.decoder import DecoderLM
from tests.moved_adapters import moved
from tests.tolerances import assert_allclose

DENSE = ModelConfig(vocab_size=53, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=24, max_seq_len=32)
MOE = dataclasses.replace(
    DENSE, mlp_pattern=("moe",), moe=MoEConfig(num_experts=3, top_k=2, expert_dim=8, shared_experts=1), moe_impl="xla"
)
ALL = ("q", "k", "v", "o", "gate", "up", "down")


@functools.cache
def programs(config):
    """The model's jitted init and forward (op by op, these tests took minutes on CPU)."""
    model = DecoderLM(config)
    forward = jax.jit(lambda params, tokens, rngs: model.apply({"params": params}, tokens, rngs=rngs)[0])
    return jax.jit(model.init), forward


def init(config, seed=0):
    tokens = jnp.zeros((1, 8), jnp.int32)
    return programs(config)[0](jax.random.key(seed), tokens)["params"]


def logits(config, params, tokens, rngs=None):
    return programs(config)[1](nn.meta.unbox(params), tokens, rngs)


def add_lora_jit(params, lora, rng):
    """``add_lora`` jitted (as is ``perturbed``): op by op, each compiled a program per leaf shape."""
    return jax.jit(lambda params, rng: add_lora(params, lora, rng))(params, rng)


@jax.jit
def perturbed(params, seed, scale=0.05):
    """Adapter leaves A, B and magnitudes moved away from their initial values."""
    return moved(nn.meta.unbox(params), seed, scale)


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(7), (2, 8), 0, DENSE.vocab_size)


@pytest.mark.parametrize(
    "config, lora",
    [
        (DENSE, LoraConfig(rank=4, targets=ALL)),
        (DENSE, LoraConfig(rank=4, targets=ALL, dora=True, rslora=True)),
        (MOE, LoraConfig(rank=2, targets=("q", "v", "experts", "up"), dora=True)),
    ],
    ids=["lora", "dora_rslora", "moe_experts_dora"],
)
def test_default_init_is_exact_and_merged_equals_unmerged(config, lora, tokens):
    base = init(config)
    adapted = add_lora_jit(base, lora, jax.random.key(1))
    if lora.dora:  # m / ||W|| is 1 up to the norm's summation order in another program
        assert_allclose(logits(config, adapted, tokens), logits(config, base, tokens))
    else:
        np.testing.assert_array_equal(logits(config, adapted, tokens), logits(config, base, tokens))
    trained = perturbed(adapted, seed=2)
    out = logits(config, trained, tokens)
    assert not np.allclose(out, logits(config, base, tokens), atol=1e-3)
    merged, record = jax.jit(merge)(trained)
    assert all("_lora_" not in p for p in param_paths(merged))
    assert_allclose(logits(config, merged, tokens), out, scale=10)  # f32 sums in another order
    restored = unmerge(merged, record)
    jax.tree.map(np.testing.assert_array_equal, restored, trained)


def test_unscanned_layers_and_boxed_axes(tokens):
    config = dataclasses.replace(DENSE, scan_layers=False)
    boxed = init(config)
    adapted = add_lora_jit(boxed, LoraConfig(rank=3, targets=("o", "down")), jax.random.key(0))
    flat = param_paths(adapted)
    o = "group_0/block_0/attn/o/kernel"
    assert flat[o + "_lora_a"].names == ("heads", "head_dim", None)
    assert flat[o + "_lora_b"].names == (None, "embed")
    assert flat[o + "_lora_a"].value.shape == (4, 4, 3)
    assert flat["group_1/block_0/mlp/down_lora_b"].names == (None, "embed")
    trained = perturbed(adapted, seed=3)
    assert_allclose(logits(config, merged_weights(trained), tokens), logits(config, trained, tokens), scale=10)
    scanned_a = param_paths(add_lora(init(DENSE), LoraConfig(targets=("q",)), jax.random.key(0)))
    assert scanned_a["layers/block_0/attn/q/kernel_lora_a"].names == ("layers", "embed", None)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_gradients_through_the_delta_equal_those_through_the_merged_weight(tokens, dora):
    lora = LoraConfig(rank=2, targets=("q", "up"), alpha=5, dora=dora)
    adapted = perturbed(add_lora_jit(init(DENSE), lora, jax.random.key(0)), 4)

    def loss_unmerged(p):
        return jnp.sum(logits(DENSE, p, tokens) ** 2)

    def loss_merged(p):
        return jnp.sum(logits(DENSE, merged_weights(p), tokens) ** 2)

    grads = jax.jit(jax.grad(loss_unmerged))(adapted)
    expected = jax.jit(jax.grad(loss_merged))(adapted)
    for path, value in param_paths(grads).items():
        if path.endswith(("_lora_a", "_lora_b", "_lora_magnitude")):
            assert np.abs(value).max() > 0, path
            assert_allclose(value, param_paths(expected)[path], scale=20, err_msg=path)


def test_pissa_moves_the_principal_part_into_the_adapter(tokens):
    base = nn.meta.unbox(init(DENSE))
    adapted = add_lora(base, LoraConfig(rank=4, alpha=8, targets=("q", "down"), init="pissa"), jax.random.key(0))
    assert_allclose(logits(DENSE, adapted, tokens), logits(DENSE, base, tokens), scale=10)
    flat, base_flat = param_paths(adapted), param_paths(base)
    q = "layers/block_0/attn/q/kernel"
    residual, a, b = flat[q], flat[q + "_lora_a"], flat[q + "_lora_b"]
    # The adapter holds the top singular directions: the residual's norm is the tail's.
    singular = np.linalg.svd(np.asarray(base_flat[q]).reshape(2, 16, 16), compute_uv=False)
    assert_allclose(np.linalg.norm(np.asarray(residual).reshape(2, -1), axis=1),
                    np.sqrt((singular[:, 4:] ** 2).sum(1)), scale=10)  # fmt: skip
    np.testing.assert_array_equal(flat[q + "_lora_a0"], a)
    np.testing.assert_array_equal(flat[q + "_lora_b0"], b)
    assert not np.any(np.all(np.asarray(b) == 0, axis=(1, 2, 3)))


def test_adapter_mask_trains_factors_and_magnitudes_only():
    adapted = add_lora(init(DENSE), LoraConfig(targets=("v",), dora=True, dropout=0.1), jax.random.key(0))
    mask = param_paths(adapter_mask(adapted))
    trained = sorted(p.rsplit("/", 1)[-1] for p, on in mask.items() if on)
    assert trained == ["kernel_lora_a", "kernel_lora_b", "kernel_lora_magnitude"]
    assert param_paths(without_adapters(adapted)).keys() == param_paths(init(DENSE)).keys()


def test_dropout_applies_only_with_a_dropout_rng(tokens):
    config = LoraConfig(rank=2, targets=("q", "up"), dropout=0.5)
    adapted = perturbed(add_lora(init(DENSE), config, jax.random.key(0)), 5, scale=0.5)
    plain = logits(DENSE, adapted, tokens)
    no_dropout = perturbed(add_lora(init(DENSE), dataclasses.replace(config, dropout=0.0), jax.random.key(0)), 5, 0.5)
    np.testing.assert_array_equal(plain, logits(DENSE, no_dropout, tokens))
    dropped = logits(DENSE, adapted, tokens, rngs={"dropout": jax.random.key(1)})
    assert not np.allclose(dropped, plain, atol=1e-4)
    again = logits(DENSE, adapted, tokens, rngs={"dropout": jax.random.key(1)})
    np.testing.assert_array_equal(dropped, again)


def test_dropout_on_routed_experts_is_refused():
    """The MoE layer merges expert adapters into their weights, so ``lora_dropout`` there never
    applied: with targets ("experts",), dropout 0.5 and a dropout RNG, the logits were those
    without dropout (max difference 0.0), silently."""
    params = jax.eval_shape(lambda: init(MOE))
    lora = LoraConfig(targets=("q", "experts"), dropout=0.5)
    with pytest.raises(ConfigError, match=r"adapter\.dropout 0\.5 cannot apply .*experts/") as error:
        jax.eval_shape(lambda p: add_lora(p, lora, jax.random.key(0)), params)
    assert error.value.key == "adapter.dropout"
    for lora in (LoraConfig(targets=("q", "experts")), LoraConfig(targets=("q",), dropout=0.5)):
        jax.eval_shape(lambda p, lora=lora: add_lora(p, lora, jax.random.key(0)), params)


@pytest.mark.parametrize(
    "kwargs, key, message",
    [
        (dict(rank=0), "adapter.rank", "positive"),
        (dict(dropout=1.0), "adapter.dropout", "[0, 1)"),
        (dict(init="svd"), "adapter.init", "pissa"),
        (dict(targets=("[",)), "adapter.targets", "neither a target name"),
        # Each field by its own key (these were keyed adapter.rank / .alpha / .ga_batches / .targets):
        (dict(rank_pattern={"q": 0}), "adapter.rank_pattern", "positive"),
        (dict(alpha_pattern={"q": -1.0}), "adapter.alpha_pattern", "positive"),
        (dict(ga_gamma=0.0), "adapter.ga_gamma", "positive"),
        (dict(rank_pattern={"(": 2}), "adapter.rank_pattern", "neither a target name"),
    ],
)
def test_bad_configs_name_their_key(kwargs, key, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")) as error:
        LoraConfig(**kwargs)
    assert error.value.key == key


def test_targets_that_select_nothing_or_no_matrix_are_errors():
    params = init(DENSE)
    with pytest.raises(ConfigError, match="matches no parameter; names: q, k, v"):
        add_lora(params, LoraConfig(targets=("experts",)), jax.random.key(0))
    with pytest.raises(ConfigError, match="not a weight an adapter can attach to"):
        add_lora(params, LoraConfig(targets=("attn_norm/scale$",)), jax.random.key(0))
    adapted = add_lora(params, LoraConfig(targets=("q",)), jax.random.key(0))
    with pytest.raises(ConfigError, match="already has an adapter"):
        add_lora(adapted, LoraConfig(targets=("q",)), jax.random.key(0))
    # The k projection maps 16 -> 2 * 4: PiSSA's rank (LoRA-GA's 2 * rank) singular directions must fit in 8.
    for method, rank in (("pissa", 9), ("lora_ga", 5)):
        lora = LoraConfig(rank=rank, targets=("k",), init=method)
        with pytest.raises(
            ConfigError, match=rf"rank {rank} is too large for init {method} on .*attn/k/kernel"
        ) as error:
            jax.eval_shape(lambda p, lora=lora: add_lora(p, lora, jax.random.key(0)), params)
        assert error.value.key == "adapter.rank"


@pytest.mark.parametrize(
    "config, target",
    [
        (DENSE, "embed"),
        (dataclasses.replace(DENSE, tie_embeddings=False), "head/kernel$"),
        (MOE, "router"),
        (dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, shared_expert_gate=True)), "shared_gate"),
    ],
)
def test_targets_whose_layer_reads_no_adapter_are_errors(config, target):
    """The embedding, LM head, MoE router and shared-expert gate are read as they are: adapters
    added there (targets ``embed``, ``head/kernel$`` ... were accepted) trained and changed
    nothing, the logits with moved adapters equal to the base's (max difference 0.0)."""
    params = jax.eval_shape(lambda: init(config))
    lora = LoraConfig(targets=("q", target))
    with pytest.raises(ConfigError, match=r"adapter target \S+: its layer applies no adapter") as error:
        jax.eval_shape(lambda p: add_lora(p, lora, jax.random.key(0)), params)
    assert error.value.key == "adapter.targets"


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_rank_and_alpha_patterns_that_select_no_adapted_weight_are_errors(field):
    """A per-weight rank or alpha whose pattern matches none of the adapted weights (a typo, or
    a weight left out of ``targets``) was ignored: every weight got the default rank/alpha."""
    params = jax.eval_shape(lambda: init(DENSE))
    for entry in ("dwn", "up"):  # a typo; a weight that is not among the targets
        lora = LoraConfig(rank=4, targets=("q", "down"), **{field: {entry: 2}})
        with pytest.raises(ConfigError, match=rf"adapter\.{field} entry '{entry}' matches none") as error:
            jax.eval_shape(lambda p, lora=lora: add_lora(p, lora, jax.random.key(0)), params)
        assert error.value.key == f"adapter.{field}"
    lora = LoraConfig(rank=4, targets=("q", "down"), **{field: {"down": 2}})
    adapted = param_paths(jax.eval_shape(lambda p: add_lora(p, lora, jax.random.key(0)), params))
    down = "layers/block_0/mlp/down"
    expected = (2, 8.0) if field == "rank_pattern" else (4, 0.5)  # (rank, alpha / rank) of the matched weight
    assert (adapted[down + "_lora_a"].value.shape[-1], lora.scale(down)) == expected


@pytest.mark.parametrize("scan_layers", [True, False])
def test_unboxed_trees_have_the_layouts_their_logical_axes_give(scan_layers):
    """Unboxed trees (hf.load, restored checkpoints) read layouts from names: CCA's 2-D q/k/v
    ([embed, latent]) were taken for [embed, heads, head_dim] (scanned: the layer axis as the
    input, so quantizing or adding LoRA failed; unscanned: refused as no matrix)."""
    config = ModelConfig(
        vocab_size=31, d_model=32, num_layers=2, num_heads=2, mlp_dim=24, block_pattern=("cca", "global"),
        mlp_pattern=("moe", "dense"), moe=MoEConfig(num_experts=2, top_k=1, expert_dim=8), cca_heads=2,
        scan_layers=scan_layers,
    )  # fmt: skip
    boxed = jax.eval_shape(DecoderLM(config).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    checked = 0
    for path, leaf in param_paths(boxed).items():
        if not any(re.search(pattern, path) for pattern in TARGETS.values()):
            continue
        expected = weight_layout(path, leaf)
        layout = weight_layout(path, jnp.zeros(leaf.value.shape))
        assert (layout.lead, layout.in_dims, layout.out_dims) == (expected.lead, expected.in_dims, expected.out_dims)
        checked += 1
    assert checked == 2 * 4 + 3 + 3  # q k v o of both layers, the dense MLP, the MoE layer's experts


@pytest.mark.parametrize("scan_layers", [True, False])
def test_unboxed_mamba2_in_projections_take_adapters(scan_layers, tokens):
    """A Mamba-2 mixer's in-projections (``z x B C dt``, HF's ``in_proj``) map from the model
    width like attention's q/k/v; in an unboxed tree (hf.load, a restored checkpoint: every
    fine-tuning base) LoRA on them (``targets: ['attn/x/kernel$']``) was refused: "is not a
    weight an adapter can attach to: a matrix into or out of the model width". Now their layout
    is their logical axes' and the adapted model merges to the same logits."""
    config = dataclasses.replace(
        DENSE, block_pattern=("mamba2", "global"), mlp_pattern=("none", "dense"), scan_layers=scan_layers
    )
    boxed = init(config)
    mixer = [(p, leaf) for p, leaf in param_paths(boxed).items() if "block_0/attn/" in p and p.endswith("/kernel")]
    assert len(mixer) == 6  # z x B C dt o
    for path, leaf in mixer:
        expected, layout = weight_layout(path, leaf), weight_layout(path, np.zeros(leaf.value.shape))
        assert (layout.lead, layout.in_dims, layout.out_dims) == (expected.lead, expected.in_dims, expected.out_dims)
    lora = LoraConfig(rank=2, targets=(r"attn/(z|x|B|C|dt)/kernel$",))
    trained = perturbed(add_lora_jit(nn.meta.unbox(boxed), lora, jax.random.key(1)), seed=2)
    assert_allclose(logits(config, merged_weights(trained), tokens), logits(config, trained, tokens), scale=10)
    assert not np.allclose(logits(config, trained, tokens), logits(config, boxed, tokens), atol=1e-3)


def test_lora_ga_first_step_follows_the_gradient_s_top_directions(tokens):
    """LoRA-GA starts at the base model, and one SGD step on A and B moves the adapted weight
    along the rank-2r truncation of -G (for ``A = U_r c``, ``B = V_{r:2r}^T c`` the update is
    ``-lr scale^2 c^2 (U_r U_r^T G + G V_{r:2r} V_{r:2r}^T)``), unlike the default init."""
    from ember.models.adapters.lora_ga import average_gradients, lora_ga_init

    base = nn.meta.unbox(init(DENSE))
    batches = [jax.random.randint(jax.random.key(i), (2, 8), 0, DENSE.vocab_size) for i in range(3)]

    def loss(params, batch):
        logits_ = DecoderLM(DENSE).apply({"params": params}, batch)[0]
        return jnp.mean(jax.nn.logsumexp(logits_, -1) - jnp.take_along_axis(logits_, batch[..., None], -1)[..., 0])

    grads = average_gradients(loss, base, batches)
    q = "layers/block_0/attn/q/kernel"
    rank, gamma = 2, 4.0
    lora = LoraConfig(rank=rank, alpha=4, targets=("q",), init="lora_ga")
    adapted = lora_ga_init(add_lora(base, lora, jax.random.key(0)), grads, gamma=gamma)
    assert_allclose(logits(DENSE, adapted, tokens), logits(DENSE, base, tokens), scale=10)
    g = np.asarray(param_paths(grads)[q], np.float64).reshape(2, 16, 16)
    scale, c = lora.scale(q), 16**0.25 / np.sqrt(gamma)
    u, _, vt = np.linalg.svd(g)
    top, next_ = u[:, :, :rank], np.swapaxes(vt[:, rank : 2 * rank], 1, 2)
    expected = -(scale**2) * c**2 * (top @ np.swapaxes(top, 1, 2) @ g + g @ next_ @ np.swapaxes(next_, 1, 2))

    def first_step(params):
        """The weight's first-order change ``scale (dA B + A dB)`` under one unit SGD step."""
        flat, step = param_paths(params), param_paths(average_gradients(loss, params, batches))
        a = np.asarray(flat[q + "_lora_a"], np.float64).reshape(2, 16, rank)
        b = np.asarray(flat[q + "_lora_b"], np.float64).reshape(2, rank, 16)
        da = np.asarray(step[q + "_lora_a"], np.float64).reshape(2, 16, rank)
        db = np.asarray(step[q + "_lora_b"], np.float64).reshape(2, rank, 16)
        return -scale * (da @ b + a @ db)

    update = first_step(adapted)
    np.testing.assert_allclose(update, expected, atol=1e-3 * np.abs(expected).max())
    default = first_step(add_lora(base, dataclasses.replace(lora, init="lora"), jax.random.key(0)))

    def cosine(x):
        return float(np.sum(x * -g) / np.linalg.norm(x) / np.linalg.norm(g))

    assert cosine(update) > 0.9 > cosine(default) + 0.3

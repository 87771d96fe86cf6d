"""Every parameter carries logical axes; the sharded forward on 8 CPU devices (FSDP and
tensor-parallel meshes) equals the single-device forward; Pallas kernels run per shard; the model
wraps for Flax NNX."""

import dataclasses
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ember.core.sharding import LOGICAL_AXES, MeshConfig, make_mesh, named_sharding, shard_variables, use_sharding
from ember.core.tree import param_paths, tree_from_paths
from ember.kernels_pallas.flash_attention import flash_attention
from ember.models.adapters import LoraConfig, add_lora
from ember.models.adapters.leaves import adapter_leaves, without_adapters
from ember.models.config import ModelConfig, MoEConfig, SSMConfig
from ember.models.decoder import DecoderLM
from ember.models.layers.kernel_shards import per_head_group_shard
from ember.models.quantization import QuantizeConfig, quantize_params
from tests.collectives import collectives
from tests.tolerances import assert_allclose

# One of each parameter kind: attention with biases and QK-norm, CCGQA, Hedgehog linear
# attention, an untied head.
CONFIG = ModelConfig(
    vocab_size=128,
    d_model=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    mlp_dim=128,
    qkv_bias=True,
    qk_norm=True,
    tie_embeddings=False,
    block_pattern=("global", "cca", "linear"),
    cca_heads=2,
    cca_kv_heads=1,
    linear_feature_map="hedgehog",
    attention_impl="xla",
    max_seq_len=64,
)


@pytest.fixture(scope="module")
def variables():
    return jax.jit(DecoderLM(CONFIG).init)(jax.random.key(0), jnp.ones((2, 16), jnp.int32))


def test_every_parameter_has_logical_axes_from_the_vocabulary(variables):
    leaves = jax.tree.leaves(variables, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert leaves and all(isinstance(leaf, nn.LogicallyPartitioned) for leaf in leaves)
    for leaf in leaves:
        assert len(leaf.names) == leaf.value.ndim
        assert set(leaf.names) - {None} <= set(LOGICAL_AXES)
        assert leaf.names[0] == "layers" or leaf.value.ndim <= 2  # scanned leaves lead with layers


@pytest.mark.parametrize(
    "mesh_config", [MeshConfig(data=2, fsdp=4), MeshConfig(data=2, tensor=4)], ids=["fsdp", "tensor"]
)
def test_sharded_forward_equals_single_device(mesh_config, variables, rng):
    model = DecoderLM(CONFIG)
    tokens = jax.random.randint(rng, (8, 16), 0, CONFIG.vocab_size)
    expected, _ = jax.jit(model.apply)(nn.meta.unbox(variables), tokens)
    mesh = make_mesh(mesh_config)
    sharded = shard_variables(variables, mesh)
    split = [leaf for leaf in jax.tree.leaves(sharded) if not leaf.sharding.is_fully_replicated]
    assert split, "no parameter was actually sharded"
    with use_sharding(mesh):
        tokens = jax.device_put(tokens, named_sharding(mesh, ("batch", "seq"), shape=tokens.shape))
        logits, _ = jax.jit(model.apply)(sharded, tokens)
    assert not logits.sharding.is_fully_replicated
    assert_allclose(logits, expected, scale=10)  # sharded matmuls reduce in another order


def test_wraps_for_flax_nnx(rng):
    config = dataclasses.replace(CONFIG, block_pattern=("global",), num_layers=2, tie_embeddings=True)
    tokens = jax.random.randint(rng, (2, 12), 0, config.vocab_size)
    with use_sharding(make_mesh(MeshConfig(data=-1))):  # NNX shards variables eagerly: needs a mesh
        model = nnx.bridge.ToNNX(DecoderLM(config), rngs=nnx.Rngs(0))
        # nnx.jit: one program each, where op by op they compiled ~140 programs
        nnx.jit(nnx.bridge.lazy_init)(model, tokens)
        logits, cache = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert cache is None
    expected, _ = jax.jit(DecoderLM(config).apply)({"params": params}, tokens)
    assert_allclose(logits, expected)
    assert np.asarray(params["layers"]["block_0"]["attn"]["q"]["kernel"]).shape == (2, 64, 4, 16)


def compiled_on_mesh(step, variables, tokens, arguments=lambda sharded: (sharded,), mesh_config=None):
    """``step`` compiled and run on a mesh (data=4 x tensor=2 unless ``mesh_config``): ``variables``
    sharded by their logical axes (passed as ``arguments(sharded)``), ``tokens`` split over the
    batch; returns (the compiled program, its outputs)."""
    mesh = make_mesh(mesh_config or MeshConfig(data=4, tensor=2))
    with use_sharding(mesh):
        sharded_tokens = jax.device_put(tokens, named_sharding(mesh, ("batch", "seq"), shape=tokens.shape))
        args = (*arguments(shard_variables(variables, mesh)), sharded_tokens)
        compiled = step.lower(*args).compile()
        return compiled, compiled(*args)


# Every sequence-mixer family that runs a Pallas kernel, in the Pallas interpreter: GQA attention,
# linear attention and Mamba-2's SSD with two B/C groups.
KERNEL_CONFIG = dataclasses.replace(
    CONFIG,
    num_layers=3,
    block_pattern=("global", "linear", "mamba2"),
    qkv_bias=False,
    qk_norm=False,
    linear_feature_map="elu",
    ssm=SSMConfig(n_groups=2, chunk_size=8),
    attention_impl="interpret",
)


def test_kernels_run_on_each_devices_shard_with_the_same_loss_and_gradients(rng):
    """A Pallas kernel is a custom call XLA cannot partition: on a data x tensor mesh the kernels
    had their operands gathered whole onto every device (92 all-gathers in this program). Now each
    runs on the batch rows and head groups its device holds: no all-gather at all, and the loss and
    gradients are the single device's."""
    model = DecoderLM(KERNEL_CONFIG)
    tokens = jax.random.randint(rng, (8, 16), 0, KERNEL_CONFIG.vocab_size)
    variables = jax.jit(model.init)(jax.random.key(0), tokens)

    def loss(params, tokens):
        logits, _ = model.apply(params, tokens)
        return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))

    step = jax.jit(jax.value_and_grad(loss))
    expected = step(nn.meta.unbox(variables), tokens)
    compiled, (value, grads) = compiled_on_mesh(step, variables, tokens)
    assert "all-gather" not in compiled.as_text()
    assert_allclose(value, expected[0])
    jax.tree.map(lambda got, want: assert_allclose(got, want, scale=10), grads, expected[1])


def test_kernel_shards_keep_query_heads_with_their_key_heads_when_the_mesh_splits_fewer_groups(rng):
    """Two key heads on a tensor axis of 4: the groups cannot split, so each device computes all of
    them (never a query head against another group's key head); values and gradients as on one device."""
    q, k, v = (jax.random.normal(key, (2, 8, heads, 8)) for key, heads in zip(jax.random.split(rng, 3), (8, 2, 2)))

    def loss(q, k, v):
        out = per_head_group_shard(
            lambda q, k, v: flash_attention(q, k, v, causal=True, impl="interpret"),
            (q, k, v),
            ("bsh.", "bsh.", "bsh."),
            out_layout="bsh.",
            groups=k.shape[2],
            kernel=True,
        )
        return jnp.sum(out * jnp.arange(8.0))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    expected = grad(q, k, v)
    with use_sharding(make_mesh(MeshConfig(data=2, tensor=4))):
        got = grad(q, k, v)
    jax.tree.map(assert_allclose, got, expected)


# QLoRA: an NF4 base with adapters on a column-parallel (q, v, up) and a row-parallel (o, down)
# weight of each kind.
QLORA_CONFIG = dataclasses.replace(CONFIG, num_layers=2, block_pattern=("global",), qkv_bias=False, qk_norm=False)


def qlora_loss_and_adapter_gradients(impl, rng, config=QLORA_CONFIG, targets=("q", "v", "o", "up", "down")):
    """(the jitted QLoRA loss-and-adapter-gradients step, its NF4 base with adapters whose B are
    nonzero, tokens, how the step takes the parameters)."""
    model = DecoderLM(dataclasses.replace(config, quantized_impl=impl))
    tokens = jax.random.randint(rng, (8, 16), 0, config.vocab_size)

    @jax.jit
    def qlora(tokens):
        params = model.init(jax.random.key(0), tokens)["params"]
        # rank 3: no adapter has the shape of a weight's NF4 absmax, so gathers tell them apart
        adapted = add_lora(params, LoraConfig(rank=3, targets=targets), jax.random.key(1))
        flat = param_paths(adapted)
        for path in [p for p in flat if p.endswith("lora_b")]:  # B = 0 would give A no gradient
            flat[path] = flat[path].replace_boxed(0.1 * jax.random.normal(jax.random.key(2), flat[path].value.shape))
        return quantize_params(tree_from_paths(flat), QuantizeConfig(format="nf4", group_size=16))

    def loss(adapters, base, tokens):
        params = tree_from_paths({**param_paths(base), **param_paths(adapters)})
        logits, _ = model.apply({"params": params}, tokens)
        return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))

    def adapters_and_base(params):
        return adapter_leaves(params), without_adapters(params)

    return jax.jit(jax.value_and_grad(loss)), qlora(tokens), tokens, adapters_and_base


@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_quantized_matmuls_run_on_each_devices_rows_and_columns_with_the_same_loss_and_adapter_gradients(impl, rng):
    """The quantized matmul is a Pallas kernel too: on a data x tensor mesh its activations and
    weights were gathered whole onto every device (34 all-gathers in this QLoRA program). Now each
    device multiplies its batch rows by the weight columns it holds (by the rows of a row-parallel
    weight, o and down, with its activations' columns, summed): no all-gather, and the loss and the
    adapters' gradients are the single device's. XLA's path gathered NF4's absmax codes to decode
    them (5 all-gathers); they now decode where they lie."""
    step, params, tokens, adapters_and_base = qlora_loss_and_adapter_gradients(impl, rng)
    expected = step(*adapters_and_base(nn.meta.unbox(params)), tokens)
    compiled, (value, grads) = compiled_on_mesh(step, params, tokens, adapters_and_base)
    assert "all-gather" not in compiled.as_text()
    assert_allclose(value, expected[0])
    jax.tree.map(lambda got, want: assert_allclose(got, want, scale=10), grads, expected[1])


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_fsdp_gathers_quantized_weights_as_their_codes_on_xlas_path(family, rng):
    """Under FSDP each device multiplies by whole weights gathered from their row shards. XLA's
    path dequantised each shard and gathered the float weights (f32 here, 8x the NF4 codes' bytes:
    14 such all-gathers in the dense program, 3 of the stacked experts in the MoE one); it now
    gathers the 4-bit codes, as the kernel's path does, with the same loss and adapter gradients.
    NF4's absmax scales were decoded to f32 before their gather on both paths; they now travel as
    their 8-bit codes. (The vocabulary, 96, keeps the float embedding and head apart from every
    quantized weight.)"""
    # 6 experts: the router's [64, 6] kernel and [tokens, 6] logits have no NF4 absmax's shape
    six_experts = dataclasses.replace(MOE_CONFIG, moe=dataclasses.replace(MOE_CONFIG.moe, num_experts=6))
    config, targets = {"dense": (QLORA_CONFIG, ("q", "v", "o", "up", "down")), "moe": (six_experts, ("q", "v"))}[family]
    step, params, tokens, adapters_and_base = qlora_loss_and_adapter_gradients(
        "xla", rng, dataclasses.replace(config, vocab_size=96), targets
    )
    expected = step(*adapters_and_base(nn.meta.unbox(params)), tokens)
    compiled, (value, grads) = compiled_on_mesh(
        step, params, tokens, adapters_and_base, mesh_config=MeshConfig(data=2, fsdp=4)
    )
    gathered = [
        re.match(r"(\w+)\[([\d,]*)\]", result).groups() for result, op in collectives(compiled) if op == "all-gather"
    ]
    assert "u8" in {dtype for dtype, _ in gathered}, "no quantized weight gathered: not an FSDP program"
    weights, absmax = float_forms(params)
    float_weights = [
        f"{dtype}[{shape}]"
        for dtype, shape in gathered
        if dtype.startswith(("f", "bf")) and _dims(map(int, shape.split(","))) in weights
    ]
    assert not float_weights
    decoded_absmax = [
        f"{dtype}[{shape}]"
        for dtype, shape in gathered
        if dtype == "f32" and _dims(map(int, shape.split(","))) in absmax
    ]
    assert not decoded_absmax  # NF4's scales travel as their 8-bit codes (f16 on CPU), decoded f32 after
    assert_allclose(value, expected[0])
    jax.tree.map(lambda got, want: assert_allclose(got, want, scale=10), grads, expected[1])


def float_forms(params) -> tuple[set[tuple[int, ...]], set[tuple[int, ...]]]:
    """The dimensions (sorted, without 1s) a layer's NF4 weights and their absmax scales have as
    floats: the codes ``[layers, (experts,) K // 2, *out]`` stand for ``[K, *out]`` or ``[K, N]``
    per matrix, and ``[experts, K, N]`` per MoE layer; the absmax ``[layers, (experts,) K // 16,
    *out]`` for ``[K // 16, *out]`` or ``[K // 16, N]``."""
    forms = {"nf4": set(), "absmax": set()}
    for path, array in param_paths(nn.meta.unbox(params)).items():
        part = path.rsplit("/", 1)[-1]
        if part in forms:
            experts = array.shape[1:2] if "experts" in path else ()
            rows, out = array.shape[1 + len(experts)] * (2 if part == "nf4" else 1), array.shape[2 + len(experts) :]
            forms[part] |= {_dims((rows, *out)), _dims((rows, math.prod(out))), _dims((*experts, rows, math.prod(out)))}
    return forms["nf4"], forms["absmax"]


def _dims(shape) -> tuple[int, ...]:
    return tuple(sorted(size for size in shape if size != 1))


# Two MoE layers whose capacity (1.25) drops token-slots of this batch.
MOE_CONFIG = dataclasses.replace(
    QLORA_CONFIG, mlp_pattern=("moe",), moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=1.25)
)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_moe_experts_run_on_each_devices_tokens_with_the_whole_batchs_capacity_drops(impl, rng):
    """The expert dispatch sorts token-slots by expert, a permutation XLA cannot partition: on a
    data x tensor mesh every device built the whole batch's sorted slots (an all-reduce of
    f32[256, 64], forward and backward) and ran the experts on all of them; the Pallas kernel's
    path also gathered the experts' weights and hidden activations (10 all-gathers, XLA's 3). Now
    each device dispatches its own tokens (the capacity drops still decided on the whole batch):
    no collective carries the batch's 256 slots, the only all-gather is of the expert ids the
    capacity ranks, and the loss, the drops and the gradients are the single device's. The router
    logits were gathered too (XLA does not split its TopK over the tokens, so every device chose
    the experts of the whole batch's tokens); each device now chooses its own tokens' experts."""
    model = DecoderLM(dataclasses.replace(MOE_CONFIG, moe_impl=impl))
    tokens = jax.random.randint(rng, (8, 16), 0, MOE_CONFIG.vocab_size)
    variables = {"params": jax.jit(model.init)(jax.random.key(0), tokens)["params"]}

    def loss(params, tokens):
        (logits, _), state = model.apply(params, tokens, mutable=["metrics"])
        fractions = [v for path, v in param_paths(state["metrics"]).items() if "dropped_fraction" in path]
        dropped = jnp.concatenate([jnp.ravel(leaf) for leaf in jax.tree.leaves(fractions)])
        return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) * jnp.arange(16.0)), dropped

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    expected = step(nn.meta.unbox(variables), tokens)
    assert jnp.any(expected[0][1] > 0), "no token-slot over capacity"
    compiled, ((value, dropped), grads) = compiled_on_mesh(step, variables, tokens)
    slots = tokens.size * MOE_CONFIG.moe.top_k
    found = collectives(compiled)
    assert not [shape for shape, _ in found if re.search(rf"[\[,]{slots}[,\]]", shape)]
    assert [result.split("[")[0] for result, op in found if op == "all-gather"] == ["s32"]  # the expert ids
    assert_allclose(value, expected[0][0])
    assert_allclose(dropped, expected[0][1])
    jax.tree.map(lambda got, want: assert_allclose(got, want, scale=10), grads, expected[1])

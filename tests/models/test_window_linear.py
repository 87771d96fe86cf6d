"""The linearised attention layer (``window_linear``, LoLCATs): its linear-time form equals its
quadratic reference (values and gradients, windows shorter and longer than the sequence,
packed documents, grouped-query heads, soft-capped scores, bf16), the reference equals the
formula written out for one query, and in attention-transfer mode a linearised model gives the
softmax model's logits exactly while sowing each layer's error."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.core.errors import ConfigError
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.layers.feature_maps import hedgehog_features
from ember.models.layers.window_linear_math import window_linear_attention, window_linear_reference
from ember.models.linearize import LinearizeConfig, linearized_config, linearized_params
from ember.training.task import apply_model
from tests.host_random import numpy_rng, perturbed
from tests.tolerances import assert_allclose

BATCH, SEQ, HEADS, KV_HEADS, DIM, FEATURES = 2, 21, 4, 2, 8, 3

features = jax.jit(hedgehog_features)  # op by op, each call compiled a program per op


def inputs(key, dtype=jnp.float32):
    generator = numpy_rng(key)

    def normal(*shape, scale=1.0):  # converted on the host: no device program per shape
        return jnp.asarray((scale * generator.standard_normal(shape)).astype(dtype))

    q, k, v = (
        normal(BATCH, SEQ, HEADS, DIM, scale=2.0),
        normal(BATCH, SEQ, KV_HEADS, DIM, scale=2.0),
        normal(BATCH, SEQ, KV_HEADS, DIM),
    )
    q_features = features(q, normal(HEADS, DIM, FEATURES))
    k_features = features(k, normal(KV_HEADS, DIM, FEATURES))
    factor = jnp.asarray(generator.uniform(0.1, 0.9, HEADS).astype(np.float32))
    segments = jnp.asarray(np.sort(generator.integers(0, 3, (BATCH, SEQ)), axis=1).astype(np.int32))
    return (q, k, v, q_features, k_features, factor), segments


@pytest.mark.parametrize("sm_scale", [None, 0.2])
def test_the_reference_is_the_formula_for_one_query(sm_scale, rng):
    """Query 17 of row 0, head 3 (key head 1), window 5: keys 13..17 by softmax (scores scaled
    by 1 / sqrt(head_dim) or by ``sm_scale``, Gemma's attention scale), 0..12 linearly."""
    (q, k, v, qf, kf, factor), _ = inputs(rng)
    # Jitted, and the inputs indexed as NumPy arrays: op by op, this compiled ~65 programs.
    reference = jax.jit(lambda *a: window_linear_reference(*a, window=5, sm_scale=sm_scale))
    out = np.asarray(reference(q, k, v, qf, kf, factor))
    t, h, g = 17, 3, 1
    q, k, v, qf, kf = (np.asarray(x, np.float64)[0] for x in (q, k, v, qf, kf))
    scale = 1 / np.sqrt(DIM) if sm_scale is None else sm_scale
    scores = np.array([q[t, h] @ k[j, g] * scale for j in range(13, 18)])
    soft = float(np.asarray(factor)[h]) * np.exp(scores - scores.max())
    linear = np.array([qf[t, h] @ kf[j, g] for j in range(13)])
    weights = np.concatenate([linear, soft])
    expected = weights @ v[:18, g] / weights.sum()
    assert_allclose(out[0, t, h], expected, scale=10)


@pytest.mark.parametrize(("window", "packed", "sm_scale"), [(1, True, None), (5, False, 0.2), (40, True, None)])
def test_linear_time_form_equals_the_reference_with_gradients(window, packed, sm_scale, rng):
    """Windows of one token, shorter than the sequence (21, not a multiple of 5, so the last
    window block is partial) and longer than it; packed documents; soft-capped scores, scaled
    by 1 / sqrt(head_dim) or another scale."""
    args, segments = inputs(rng)
    segment_ids = segments if packed else None
    options = dict(window=window, segment_ids=segment_ids, soft_cap=4.0, sm_scale=sm_scale)
    cotangent = jnp.asarray(
        numpy_rng(jax.random.fold_in(rng, 1)).standard_normal((BATCH, SEQ, HEADS, DIM)).astype(np.float32)
    )

    def loss(fn, *args):
        return jnp.sum(fn(*args, **options) * cotangent)

    fast = jax.jit(
        jax.value_and_grad(
            lambda *a: loss(lambda *b, **o: window_linear_attention(*b, impl="xla", **o), *a), argnums=range(6)
        )
    )
    slow = jax.jit(jax.value_and_grad(lambda *a: loss(window_linear_reference, *a), argnums=range(6)))
    (value, grads), (expected_value, expected_grads) = fast(*args), slow(*args)
    assert_allclose(value, expected_value, scale=20)
    for name, got, want in zip(("q", "k", "v", "q_features", "k_features", "factor"), grads, expected_grads):
        assert_allclose(got, want, scale=50, err_msg=name)
    # Both forwards in one program: op by op, they compiled ~50 programs.
    out, reference = jax.jit(
        lambda *a: (window_linear_attention(*a, impl="xla", **options), window_linear_reference(*a, **options))
    )(*args)
    assert_allclose(out, reference, scale=10)


def test_bf16_inputs_stay_within_bf16_tolerance(rng):
    args32, segments = inputs(rng)
    args16 = tuple(x.astype(jnp.bfloat16) if i < 5 else x for i, x in enumerate(args32))
    # Jitted here and below: op by op, these small models took 13-17 s each on CPU.
    out = jax.jit(lambda *a: window_linear_attention(*a, window=6, segment_ids=segments, impl="xla"))(*args16)
    assert out.dtype == jnp.bfloat16
    assert_allclose(out, jax.jit(lambda *a: window_linear_reference(*a, window=6, segment_ids=segments))(*args32))


TEACHER = ModelConfig(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64,
                      max_seq_len=32, qk_norm=True, attn_scale=0.3, attention_impl="xla")  # fmt: skip
LINEARISED = dataclasses.replace(TEACHER, block_pattern=("window_linear",), sliding_window=4,
                                 linear_feature_map="hedgehog", linear_feature_dim=4)  # fmt: skip


def test_attention_transfer_mode_gives_the_softmax_logits_and_sows_each_layers_error(rng):
    tokens = jnp.asarray(numpy_rng(rng).integers(0, 96, (2, 24)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))
    teacher = DecoderLM(TEACHER)
    teacher_params = perturbed(jax.jit(teacher.init)(rng, tokens, positions=positions)["params"], rng)
    student = DecoderLM(LINEARISED)
    fresh = jax.jit(student.init)(jax.random.fold_in(rng, 1), tokens, positions=positions)["params"]
    params = perturbed(fresh, jax.random.fold_in(rng, 2))  # features and mix away from their init
    params = linearized_params(teacher_params, params)

    teacher_logits, _ = jax.jit(teacher.apply)({"params": teacher_params}, tokens, positions=positions)
    transfer = DecoderLM(dataclasses.replace(LINEARISED, attention_transfer=True))
    outputs = jax.jit(lambda p: apply_model(transfer, p, tokens, positions=positions))(params)
    assert_allclose(outputs.output[0], teacher_logits, scale=10)
    linear_logits, _ = jax.jit(student.apply)({"params": params}, tokens, positions=positions)
    assert float(jnp.max(jnp.abs(linear_logits - teacher_logits))) > 1e-3  # the linearised model itself differs
    assert float(outputs.aux["attention_transfer"]) > 0
    with pytest.raises(ConfigError, match="window_linear layers take softmax scores"):
        dataclasses.replace(LINEARISED, score="sigmoid")


def test_attention_transfer_targets_each_teacher_layers_own_attention(rng):
    """A teacher with local and block-sparse layers (window 4, linearised with window 8): in
    attention-transfer mode each layer's target was the global softmax, so the stage-1 model
    neither reproduced the teacher nor trained toward the attention its layers had."""
    teacher_config = dataclasses.replace(
        TEACHER, num_layers=3, block_pattern=("local", "block_sparse", "global"), sliding_window=4, global_tokens=2
    )
    tokens = jnp.asarray(numpy_rng(rng).integers(0, 96, (2, 24)), jnp.int32)
    teacher = DecoderLM(teacher_config)
    teacher_params = perturbed(jax.jit(teacher.init)(rng, tokens)["params"], rng)
    transfer_config = linearized_config(
        teacher_config, LinearizeConfig(window=8, feature_dim=4), attention_transfer=True
    )
    transfer = DecoderLM(transfer_config)
    params = linearized_params(teacher_params, jax.jit(transfer.init)(jax.random.fold_in(rng, 1), tokens)["params"])
    teacher_logits, _ = jax.jit(teacher.apply)({"params": teacher_params}, tokens)
    outputs = jax.jit(lambda p: apply_model(transfer, p, tokens))(params)
    assert transfer_config.transfer_pattern == teacher_config.block_pattern and transfer_config.sliding_window == 8
    assert_allclose(outputs.output[0], teacher_logits, scale=10)
    assert float(outputs.aux["attention_transfer"]) > 0
    with pytest.raises(ConfigError, match="transfer_pattern: a window_linear layer replaced one of"):
        dataclasses.replace(transfer_config, transfer_pattern=("local", "mamba2", "global"))


def test_linearizing_a_config_and_its_weights_names_what_cannot_be_done():
    with pytest.raises(ConfigError, match=r"linear\.window must be a positive"):
        LinearizeConfig(window=0)
    linear = linearized_config(dataclasses.replace(TEACHER, block_pattern=("global", "mamba2")), LinearizeConfig(8, 4))
    assert linear.block_pattern == ("window_linear", "mamba2") and linear.sliding_window == 8
    with pytest.raises(ConfigError, match="only softmax attention layers"):
        linearized_config(
            dataclasses.replace(TEACHER, block_pattern=("mamba2",), mlp_pattern=("none",)), LinearizeConfig()
        )
    tokens = jnp.zeros((1, 8), jnp.int32)

    def shapes(config):  # the parameter tree's shapes are all the checks below need
        return jax.eval_shape(DecoderLM(config).init, jax.random.key(0), tokens)["params"]

    teacher, fresh, wider = shapes(TEACHER), shapes(LINEARISED), shapes(dataclasses.replace(TEACHER, mlp_dim=96))
    with pytest.raises(ValueError, match=r"mlp/down: the teacher's \(2, 96, 32\) against the linearised \(2, 64, 32\)"):
        linearized_params(wider, fresh)
    assert set(linearized_params(teacher, fresh)["layers"]["block_0"]["attn"]) == {
        "q", "k", "v", "o", "q_norm", "k_norm", "q_features", "k_features", "window_factor",
    }  # fmt: skip


def test_a_models_own_linear_layers_are_not_changed_by_linearising(rng):
    """Linear and window_linear layers share the config's feature map: linearising a softmax +
    linear hybrid (elu maps, the default) silently gave its linear layers fresh Hedgehog maps,
    so even the attention-transfer forward was no longer the teacher's (logits off by ~5e-3);
    with Hedgehog maps of another width, a bare ValueError from linearized_params."""
    hybrid = dataclasses.replace(TEACHER, block_pattern=("global", "linear"), linear_feature_dim=4)
    for feature_map, dim in (("elu", 4), ("hedgehog", 2)):
        with pytest.raises(ConfigError, match=f"linear layers use the {feature_map} feature map") as error:
            linearized_config(dataclasses.replace(hybrid, linear_feature_map=feature_map), LinearizeConfig(8, dim))
        assert error.value.key == "linear.feature_dim"
    teacher_config = dataclasses.replace(hybrid, linear_feature_map="hedgehog")  # the same maps: linearised
    tokens = jnp.asarray(numpy_rng(rng).integers(0, 96, (2, 24)), jnp.int32)
    teacher = DecoderLM(teacher_config)
    teacher_params = perturbed(jax.jit(teacher.init)(rng, tokens)["params"], rng)
    transfer = DecoderLM(linearized_config(teacher_config, LinearizeConfig(8, 4), attention_transfer=True))
    params = linearized_params(teacher_params, jax.jit(transfer.init)(jax.random.fold_in(rng, 1), tokens)["params"])
    teacher_logits, _ = jax.jit(teacher.apply)({"params": teacher_params}, tokens)
    assert_allclose(jax.jit(lambda p: apply_model(transfer, p, tokens))(params).output[0], teacher_logits, scale=10)

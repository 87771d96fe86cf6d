"""Quantized parameter trees: a model reads its quantized weights exactly as the dequantised
float model would compute, for every format, scanned or not; the stored form is packed;
NF4's double-quantised scales round-trip; GPTQ beats round-to-nearest on correlated inputs
(matrix and whole model); fake quantization's forward is the round trip and its gradient the
identity; LoRA on a quantized base equals LoRA on its dequantised weights."""

import dataclasses
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.core.errors import ConfigError
from ember.core.tree import param_paths
from ember.kernels_pallas.quantized_formats import dequantize
from ember.models.adapters import LoraConfig, MixLoraConfig, add_lora, add_mixlora, merge
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.quantization import (
    CALIBRATION,
    QuantizeConfig,
    calibration_grams,
    dequantize_params,
    quantize_params,
    quantized_paths,
    weight_bytes,
)
from ember.models.quantization.fake import fake_quantize_params
from ember.models.quantization.gptq import gptq_matrix
from ember.models.quantization.numerics import quantize_matrix, round_trip
from ember.models.quantization.stored import absmax_values, double_quantize
from tests.programs import programs_lowered
from tests.tolerances import assert_allclose

FORMATS = [("int8", None), ("int4", 32), ("nf4", 16)]


def perturbed(params, seed=3, scale=0.05):
    """Parameters moved away from their initial values (norm scales included)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [p + scale * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])


@pytest.fixture(scope="module", params=[True, False], ids=["scan", "unscanned"])
def model_and_params(request):
    # mlp_dim 96: the down projection's input rows are a multiple of 32 and 16, not of 64.
    config = ModelConfig(d_model=64, num_layers=2, num_heads=4, mlp_dim=96, scan_layers=request.param)
    model = DecoderLM(config)
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 256)
    # One program: op by op, the init and the perturbation compiled ~50 programs.
    params = jax.jit(lambda t: perturbed(nn.meta.unbox(model.init(jax.random.key(0), t)["params"])))(tokens)
    return model, params, tokens


@pytest.mark.parametrize("fmt,group", FORMATS)
def test_the_model_reads_quantized_weights_as_their_float_values(model_and_params, fmt, group):
    model, params, tokens = model_and_params
    forward = jax.jit(lambda p: model.apply({"params": p}, tokens)[0])
    # One program each for the whole tree (unjitted, one per weight shape each way).
    quantized = jax.jit(lambda p: quantize_params(p, QuantizeConfig(format=fmt, group_size=group)))(params)
    float_of_quantized = jax.jit(dequantize_params)(quantized, params)
    assert jax.tree.structure(float_of_quantized) == jax.tree.structure(params)  # every weight a float again
    # QAT trains against these values: NF4's fake quantization read its codes with the float
    # absmax, the stored weight with its double-quantised one (0.4% of the weight's norm apart).
    fake = jax.jit(lambda p: fake_quantize_params(p, fmt, group))(params)
    for a, b in zip(jax.tree.leaves(fake), jax.tree.leaves(float_of_quantized)):
        assert_allclose(a, b, dtype=jnp.float32)
    assert_allclose(forward(quantized), forward(float_of_quantized), scale=10)
    reference = forward(params)
    error = float(jnp.max(jnp.abs(forward(quantized) - reference)) / jnp.max(jnp.abs(reference)))
    assert error < {"int8": 0.02, "int4": 0.35, "nf4": 0.35}[fmt], error  # weights 2.5x init scale
    # Every attention and MLP projection is stored packed; embeddings and norms stay float.
    flat = param_paths(quantized)
    codes = [p for p in flat if p.endswith(f"/{fmt}")]
    assert len(codes) == 7 * (1 if "layers/block_0/mlp/up" in param_paths(params) else 2)
    for path in codes:
        weight = param_paths(params)[path.removesuffix(f"/{fmt}")]
        assert flat[path].nbytes == weight.size // (1 if fmt == "int8" else 2)
    assert weight_bytes(quantized) < weight_bytes(params)


def test_double_quantised_absmax_round_trips():
    # Jitted: op by op, this test compiled ~40 programs.
    @jax.jit
    def round_trip():
        # The absmax of 64-row blocks of a weight: 12 x 70 = 840 values, four blocks of 256 (one partial).
        weight = jax.random.normal(jax.random.key(0), (12 * 64, 70)) * jnp.linspace(0.5, 2.0, 70)
        absmax = jnp.max(jnp.abs(weight.reshape(12, 64, 70)), axis=1)
        stored = double_quantize(absmax)
        centred = jnp.abs(absmax - jnp.mean(absmax)).reshape(-1)
        scales = jnp.repeat(stored["absmax_scale"], 256)[: centred.size]
        error = jnp.abs(absmax_values(stored) - absmax).reshape(-1)
        return absmax, stored, centred, scales, error

    absmax, stored, centred, scales, error = round_trip()
    assert stored["absmax"].dtype == jnp.float8_e4m3fn and stored["absmax_scale"].shape == (4,)
    # e4m3 keeps 3 mantissa bits of each centred value c = absmax - mean (relative error <= 2^-4),
    # with subnormal steps of 2^-9 block scales near zero.
    assert bool(jnp.all(error <= 2**-4 * centred + 2**-10 * scales + 1e-6))
    assert float(jnp.mean(error / absmax.reshape(-1))) < 0.015


@pytest.mark.parametrize("fmt,group", [("int8", None), ("int4", 64), ("nf4", 32)])
def test_gptq_beats_round_to_nearest_on_correlated_inputs(fmt, group):
    k, n = 128, 48
    w = jax.random.normal(jax.random.key(0), (k, n))
    mixing = jax.random.normal(jax.random.key(2), (k, k)) * 0.2
    x = jax.random.normal(jax.random.key(1), (512, k)) @ mixing
    exact = x @ w

    # Jitted: op by op, quantizing and the errors compiled ~25 programs per format.
    @jax.jit
    def mean_squared_error(matrix):
        return jnp.mean((exact - x @ dequantize(matrix)) ** 2)

    def output_error(matrix):
        return float(mean_squared_error(matrix))

    rtn = jax.jit(quantize_matrix, static_argnums=(1, 2))(w, fmt, group)
    gptq = gptq_matrix(w, x.T @ x, fmt, group)
    assert gptq.values.dtype == rtn.values.dtype and gptq.scales.shape == rtn.scales.shape
    assert output_error(gptq) < 0.7 * output_error(rtn)


def test_gptq_on_a_model_from_calibration_grams(model_and_params):
    model, params, tokens = model_and_params
    apply_fn = lambda variables, batch: model.apply(variables, batch, mutable=[CALIBRATION])[1][CALIBRATION]  # noqa: E731
    grams = calibration_grams(apply_fn, {"params": params}, [tokens, tokens[::-1]])
    assert set(grams) == set(quantized_paths(params, QuantizeConfig()))  # one per attention/MLP projection
    for gram in grams.values():
        assert_allclose(gram, jnp.swapaxes(gram, -1, -2), scale=10)
    config = QuantizeConfig(format="int4", group_size=32, method="gptq")
    # Jitted: one program for the tree (unjitted, one per weight shape).
    gptq = jax.jit(lambda p, g: quantize_params(p, config, grams=g))(params, grams)
    rtn = jax.jit(lambda p: quantize_params(p, QuantizeConfig(format="int4", group_size=32)))(params)
    forward = jax.jit(lambda p: model.apply({"params": p}, tokens)[0])
    reference = forward(params)
    assert float(jnp.mean((forward(gptq) - reference) ** 2)) < float(jnp.mean((forward(rtn) - reference) ** 2))
    with pytest.raises(ConfigError, match="no calibration statistics"):
        jax.jit(lambda p: quantize_params(p, config, grams={}))(params)  # raised while tracing


def test_fake_quantization_is_the_round_trip_with_a_straight_through_gradient(model_and_params):
    _, params, _ = model_and_params
    # Jitted: op by op, this test took 9 s on CPU.
    fake = jax.jit(lambda p: fake_quantize_params(p, "int4", 32))(params)
    flat, originals = param_paths(fake), param_paths(params)
    path = next(p for p in flat if p.endswith("mlp/down"))
    weight = originals[path].reshape(-1, 96, 64)
    expected = jax.jit(jax.vmap(lambda w: round_trip(w, "int4", 32)))(weight).reshape(originals[path].shape)
    assert_allclose(flat[path], expected)
    assert not np.array_equal(flat[path], originals[path])
    np.testing.assert_array_equal(
        flat[next(p for p in flat if "embed" in p)], originals[next(p for p in flat if "embed" in p)]
    )
    grads = jax.jit(
        jax.grad(lambda p: sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(fake_quantize_params(p, "fp8"))))
    )(params)
    fp8 = param_paths(jax.jit(lambda p: fake_quantize_params(p, "fp8"))(params))
    assert_allclose(param_paths(grads)[path], jnp.cos(fp8[path]))  # d/dw sin(q(w)) = cos(q(w)) with STE


def test_fake_quantization_refuses_the_groups_ember_quantize_cannot_store(model_and_params):
    # mlp/down has 96 input rows: fewer than int4's default group of 128 and not a power of two,
    # a layout the quantized matmul cannot tile, so quantize_params refuses it. Before, QAT
    # fake-quantized it per output channel without a word: a run trained for weights that
    # 'ember quantize' of it then refused to store.
    _, params, _ = model_and_params
    for quantize, key in [
        (lambda p: quantize_params(p, QuantizeConfig(format="int4")), "quantize.group_size"),
        (lambda p: fake_quantize_params(p, "int4"), "qat.group_size"),
    ]:
        with pytest.raises(ConfigError, match=rf"mlp/down: its 96 input rows are not a multiple of {key} 128") as error:
            jax.eval_shape(quantize, params)
        assert error.value.key == key
    # 64 rows (the attention projections): one group of all rows, as they are stored.
    jax.eval_shape(lambda p: fake_quantize_params(p, "int4", targets=("q", "k", "v")), params)


def test_lora_on_a_quantized_base_equals_lora_on_its_float_values(model_and_params):
    model, params, tokens = model_and_params

    # Jitted: one program (unjitted, adding the adapters runs op by op, quantizing one program per weight shape).
    @jax.jit
    def adapted_params(p):
        adapted = add_lora(p, LoraConfig(rank=4, targets=("q", "v", "up", "down")), jax.random.key(5))
        return perturbed(adapted, seed=9, scale=0.02)  # non-zero B

    adapted = adapted_params(params)
    quantized = jax.jit(lambda p: quantize_params(p, QuantizeConfig(format="nf4", group_size=16)))(adapted)
    forward = jax.jit(lambda p: model.apply({"params": p}, tokens)[0])
    float_of_quantized = jax.jit(dequantize_params)(quantized, adapted)
    assert jax.tree.structure(float_of_quantized) == jax.tree.structure(adapted)
    assert_allclose(forward(quantized), forward(float_of_quantized), scale=10)
    with pytest.raises(ConfigError, match="does not merge into a quantized base"):
        merge(quantized)
    dora = jax.jit(lambda p: add_lora(p, LoraConfig(rank=4, targets=("q",), dora=True), jax.random.key(5)))(params)
    with pytest.raises(ConfigError, match=r"attn/q/kernel, which has a DoRA adapter: DoRA needs a float base") as error:
        jax.eval_shape(lambda p: quantize_params(p, QuantizeConfig(format="int8")), dora)  # before any work
    assert error.value.key == "quantize.targets"


def test_bad_quantize_configs_name_their_key(model_and_params):
    _, params, _ = model_and_params
    for kwargs, key in [
        ({"format": "int3"}, "quantize.format"),
        ({"method": "awq"}, "quantize.method"),
        ({"format": "int8", "group_size": 32}, "quantize.group_size"),
        ({"format": "int4", "group_size": 24}, "quantize.group_size"),
        ({"targets": ()}, "quantize.targets"),
    ]:
        with pytest.raises(ConfigError) as error:
            QuantizeConfig(**kwargs)
        assert error.value.key == key
    with pytest.raises(ConfigError, match=r"mlp/down: its 96 input rows are not a multiple of quantize\.group_size 64"):
        jax.jit(lambda p: quantize_params(p, QuantizeConfig(format="int4", group_size=64)))(params)
    with pytest.raises(ConfigError, match="matches no float weight"):
        quantize_params(params, QuantizeConfig(format="int4", targets=("experts",)))
    # A path regex selects float weights only: the parts of weights stored already are not weights.
    attention = {"attn": {name: {"kernel": jnp.ones((64, 4, 16))} for name in ("q", "k")}}
    half_quantized = quantize_params(attention, QuantizeConfig(format="int8", targets=("q",)))
    quantized = quantize_params(half_quantized, QuantizeConfig(format="int8", targets=("attn/",)))
    assert sorted(param_paths(quantized)) == [
        f"attn/{name}/kernel/{part}" for name in "kq" for part in ("int8", "scales")
    ]
    with pytest.raises(ConfigError, match="'attn/' matches no float weight"):
        quantize_params(quantized, QuantizeConfig(format="int8", targets=("attn/",)))
    # Quantizing a quantized model ('ember quantize' of its own output or of a QLoRA run): before,
    # only "matches no float weight; paths look like ..." with no word of why.
    with pytest.raises(ConfigError, match=r"'q' matches no float weight \(it selects attn/q/kernel, stored quantized"):
        quantize_params(quantized, QuantizeConfig(format="int8", targets=("q", "k")))
    # A selected weight that is no linear map was refused as an "adapter target" keyed adapter.targets.
    with pytest.raises(ConfigError, match=r"quantize\.targets entry 'attn_norm' selects .*attn_norm/scale") as error:
        quantize_params(params, QuantizeConfig(targets=("attn_norm",)))
    assert error.value.key == "quantize.targets"


def test_mixlora_mlps_are_not_stored_quantized():
    """Their layers read float weights: quantizing them is refused before anything is stored."""
    config = ModelConfig(d_model=32, num_layers=2, num_heads=4, mlp_dim=32)
    tokens = jnp.zeros((1, 4), jnp.int32)

    def shapes():  # abstract: the check needs no weights
        params = DecoderLM(config).init(jax.random.key(0), tokens)["params"]
        return add_mixlora(params, MixLoraConfig(num_experts=2, top_k=1, rank=2), jax.random.key(1))

    with pytest.raises(ConfigError, match="a MixLoRA MLP's weight") as error:
        jax.eval_shape(lambda p: quantize_params(p, QuantizeConfig(format="int8")), jax.eval_shape(shapes))
    assert error.value.key == "quantize.targets"


@pytest.mark.parametrize("fmt", ["nf4", "int4"])
def test_each_weight_shape_is_stored_and_read_back_by_one_program(fmt):
    """Op by op, storing this model's weights in NF4 built 168 programs (some 10 per matrix shape and
    stored part; reading them back, as many again). Now one per weight shape each way, whatever the
    number of layers and experts."""
    config = ModelConfig(vocab_size=40, d_model=48, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=80,
                         scan_layers=False)  # fmt: skip
    params = nn.meta.unbox(jax.jit(DecoderLM(config).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    flat = param_paths(params)
    shapes = {np.shape(flat[path]) for path in quantized_paths(params, QuantizeConfig())}
    assert len(shapes) == 5  # q; k and v; o; gate and up; down
    with programs_lowered() as lowered:
        stored = quantize_params(params, QuantizeConfig(format=fmt, group_size=16))
    assert len(lowered) <= len(shapes), lowered
    with programs_lowered() as lowered:
        dequantize_params(stored, params)
    assert len(lowered) <= len(shapes), lowered


def test_gptq_group_by_group_builds_one_program_per_step():
    """GPTQ of a 3-layer scanned model a group (layer) at a time, on two batches. Before, each
    group's weights were sliced and squeezed leaf by leaf, the batches embedded and the Grams
    added and counted op by op, and the quantized groups concatenated leaf by leaf: an XLA
    program per op and leaf shape, 31 for this model (8 squeezes, 6 concatenations, ...). Now
    one program each to embed a batch shape, slice any group, calibrate, add Grams, count the
    zero ones, run a quantized group and concatenate the groups, and one per stored weight shape."""
    from ember.models.quantization.sequential import sequential_gptq

    config = ModelConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=2, mlp_dim=32, scan_layers=True)
    tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, 64)
    params = nn.meta.unbox(jax.jit(DecoderLM(config).init)(jax.random.key(0), tokens)["params"])
    quantize = QuantizeConfig(format="int8", method="gptq", targets=("q", "k", "v", "o"))
    flat = param_paths(params)
    shapes = {np.shape(flat[path]) for path in quantized_paths(params, quantize)}
    assert len(shapes) == 2  # q, k and v; o
    batches = [tokens[:2], tokens[2:]]
    with programs_lowered() as lowered:
        quantized, uncalibrated = sequential_gptq(config, {"params": params}, batches, quantize)
    assert len(lowered) <= 7 + len(shapes), lowered
    assert uncalibrated == {}
    stored = [path.removesuffix("/int8") for path in param_paths(quantized) if path.endswith("/int8")]
    assert sorted(stored) == sorted(quantized_paths(params, quantize))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_routed_experts_are_stored_quantized_and_read_back_exactly(scan_layers):
    """Each expert's matrix is stored as a quantized matrix of its own by the default targets
    (before, refused: the layer read float weights only, and a model whose MLPs are all routed had
    no default target to store): the logits equal those of the dequantized float tree. GPTQ needs
    the experts' own statistics (see the next test); QAT's fake quantization reaches them too."""
    from ember.models.config import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, expert_dim=32)
    config = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, mlp_dim=32, mlp_pattern=("moe",),
                         moe=moe, scan_layers=scan_layers)  # fmt: skip
    model, tokens = DecoderLM(config), jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    # One program each (unjitted, the init runs op by op and quantizing builds one program per weight shape).
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), tokens)["params"])
    logits = jax.jit(lambda p: model.apply({"params": p}, tokens)[0])
    store = jax.jit(quantize_params, static_argnums=1)
    experts = {f"moe/experts/{name}" for name in ("gate", "up", "down")}
    for fmt in ("int8", "int4", "nf4") if scan_layers else ("nf4",):  # unrolled: the format with most parts
        quantized = store(params, QuantizeConfig(format=fmt))
        stored = {p.rsplit("/", 1)[0] for p in param_paths(quantized) if p.endswith(f"/{fmt}")}
        assert {p.split("/", 2)[-1] for p in stored if "/experts/" in p} == experts, stored
        assert_allclose(logits(quantized), logits(jax.jit(dequantize_params)(quantized, params)), dtype=np.float32)
        assert 0 < float(jnp.abs(logits(quantized) - logits(params)).max()) < 0.1, fmt  # rounded, near the float
    up = next(p for p in param_paths(params) if p.endswith("moe/experts/up"))
    grams = {p: jnp.eye(32) for p in quantized_paths(params, QuantizeConfig()) if "/experts/" not in p}
    with pytest.raises(ConfigError, match=r"no calibration statistics for .*moe/experts/"):
        quantize_params(params, QuantizeConfig(format="int8", method="gptq"), grams=grams)
    fake = jax.jit(fake_quantize_params, static_argnums=1)(params, "int8")
    assert not np.array_equal(param_paths(fake)[up], param_paths(params)[up])


def test_gptq_quantizes_each_routed_expert_with_the_grams_of_its_own_tokens():
    """GPTQ weighs each expert's rounding by the Gram matrices of the token-slots routed to it
    (``[layers, experts, K, K]``), so the experts alone quantized move the logits less than round
    to nearest, on the calibration windows and on others alike (before, GPTQ rounded every expert
    to nearest: the same error). An expert the router never picks (a selection bias of -1e9) gets
    zero Grams and is rounded to nearest, counted and warned about, where GPTQ would have zeroed it."""
    from ember.models.config import MoEConfig
    from ember.models.quantization import uncalibrated_matrices

    moe = MoEConfig(num_experts=4, top_k=2, expert_dim=32, bias_balancing_rate=0.01)
    config = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, mlp_dim=32, mlp_pattern=("moe",),
                         moe=moe)  # fmt: skip
    model = DecoderLM(config)
    calibration = jax.random.randint(jax.random.key(1), (16, 32), 0, 64)
    other = jax.random.randint(jax.random.key(2), (4, 32), 0, 64)
    variables = jax.jit(model.init)(jax.random.key(0), other)
    params = jax.jit(lambda v: perturbed(nn.meta.unbox(v["params"])))(variables)
    state = {"balance": {"layers": {"block_0": {"moe": {"router_bias": jnp.array([[0.0, 0, 0, -1e9]] * 2)}}}}}
    apply_fn = lambda v, batch: model.apply({**v, **state}, batch, mutable=[CALIBRATION])[1][CALIBRATION]  # noqa: E731
    grams = calibration_grams(apply_fn, {"params": params}, [calibration[:8], calibration[8:]])
    experts = [p for p in grams if "/experts/" in p]
    assert sorted(p.rsplit("/", 1)[-1] for p in experts) == ["down", "gate", "up"]
    assert all(grams[p].shape == (2, 4, 32, 32) for p in experts)
    assert uncalibrated_matrices(grams) == dict.fromkeys(experts, 2)  # expert 3 of both layers
    config = QuantizeConfig(format="int4", group_size=32, method="gptq", targets=("experts",))
    warning = r"GPTQ rounds 6 matrices to nearest, of the 24 in .*experts/\w+ and 2 more weights"
    with pytest.warns(UserWarning, match=warning):
        gptq = quantize_params(params, config, grams=grams)
    rtn = jax.jit(lambda p: quantize_params(p, dataclasses.replace(config, method="rtn")))(params)
    for path in experts:
        codes, rounded = param_paths(gptq)[f"{path}/int4"], param_paths(rtn)[f"{path}/int4"]
        np.testing.assert_array_equal(codes[:, 3], rounded[:, 3])
        assert not np.array_equal(codes[:, :3], rounded[:, :3])
    forward = jax.jit(lambda p, tokens: model.apply({"params": p, **state}, tokens)[0])
    for tokens, margin in ((calibration[:4], 0.7), (other, 1.0)):
        reference = forward(params, tokens)
        gptq_error, rtn_error = (float(jnp.mean((forward(p, tokens) - reference) ** 2)) for p in (gptq, rtn))
        assert gptq_error < margin * rtn_error, (gptq_error, rtn_error)


def test_quantized_impl_picks_the_quantized_matmuls_implementation(monkeypatch):
    """``quantized_impl`` reaches every quantized weight's matmul, in every layer kind (before,
    none: each ran ``impl="auto"``, XLA on CPU, whatever the setting — there was none), and the
    XLA path and the Pallas kernel (interpreted) give the same logits."""
    from ember.models.quantization import stored

    calls = []

    def recording(*args, impl, **kwargs):
        calls.append(impl)
        return matmul(*args, impl=impl, **kwargs)

    matmul = stored.quantized_matmul
    monkeypatch.setattr(stored, "quantized_matmul", recording)
    config = ModelConfig(vocab_size=64, d_model=32, num_layers=4, num_heads=2, mlp_dim=32, max_seq_len=16,
                         block_pattern=("global", "cca", "linear", "mamba2"), scan_layers=False,
                         attention_impl="xla")  # fmt: skip
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    params = nn.meta.unbox(jax.jit(DecoderLM(config).init)(jax.random.key(0), tokens)["params"])
    quantized = jax.jit(quantize_params, static_argnums=1)(params, QuantizeConfig(format="int8"))
    stored_weights = [p for p in param_paths(quantized) if p.endswith("/int8")]
    for layer in range(4):  # global, cca, linear, mamba2: each kind's projections
        assert f"group_0/block_{layer}/attn/o/kernel/int8" in stored_weights, stored_weights
    logits = {}
    for impl in ("xla", "interpret"):
        calls.clear()
        model = DecoderLM(dataclasses.replace(config, quantized_impl=impl))
        logits[impl] = jax.jit(model.apply)({"params": quantized}, tokens)[0]
        assert calls == [impl] * len(stored_weights), (impl, calls)
    assert_allclose(logits["interpret"], logits["xla"], dtype=np.float32)


def test_a_bad_quantized_impl_is_refused_naming_the_allowed_values():
    from ember.core.config import load_config
    from ember.training.lm.config import LMConfig

    # interpret_tpu: quantized_matmul has no TPU kernel to interpret.
    for bad in ("cuda", "interpret_tpu"):
        with pytest.raises(
            ConfigError, match=f"quantized_impl must be one of auto, pallas, interpret, xla; got '{bad}'"
        ) as error:
            load_config(LMConfig, None, ["data.dataset=d", "run_dir=r", f"model.quantized_impl={bad}"])
        assert error.value.key == "model.quantized_impl"


def _assert_sequential_gptq_matches_its_reference(model_config, variables, batches, config, monkeypatch):
    """GPTQ group by group (``sequential_gptq``) against a reference from existing pieces: the
    Grams it quantizes group ``g`` with equal the one-pass Grams (``calibration_grams`` of the
    whole model) of the model whose groups before ``g`` are their quantized weights dequantized,
    and its result equals ``quantize_params`` given those Grams. Before, ``ember quantize`` took
    every group's Grams from one pass of the float model, all at once."""
    from ember.models.layer_layout import layers_from_list, layers_to_list, num_groups
    from ember.models.quantization import sequential

    recorded, earlier = [], []

    def recording(params, paths, config, *, grams):
        assert all(ref() is None for ref in earlier), "the Grams of a group quantized before are still held"
        recorded.append({path: np.array(gram) for path, gram in grams.items()})  # copies: hold no Gram
        earlier.extend(weakref.ref(gram) for gram in grams.values())
        return quantize_weights(params, paths, config, grams=grams)

    quantize_weights = sequential.quantize_weights
    monkeypatch.setattr(sequential, "quantize_weights", recording)
    params, state = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    quantized, uncalibrated = sequential.sequential_gptq(model_config, variables, batches, config)
    groups, period = num_groups(model_config), model_config.layer_period
    assert len(recorded) == groups  # one group's Grams at a time

    model = DecoderLM(model_config)

    def apply_fn(variables, batch):
        return model.apply({**variables, **state}, **batch, mutable=[CALIBRATION])[1][CALIBRATION]

    float_layers = layers_to_list(model_config, params)
    dequantized_layers = layers_to_list(model_config, jax.jit(dequantize_params)(quantized, params))
    used = {}
    for g, grams in enumerate(recorded):
        layers = dequantized_layers[: g * period] + float_layers[g * period :]
        mixed = {**params, **layers_from_list(model_config, layers)}
        one_pass = calibration_grams(apply_fn, {"params": mixed}, batches)
        if g == 0:
            float_grams = one_pass
        for path, gram in grams.items():
            reference = one_pass[path][g : g + 1] if model_config.scan_layers else one_pass[path]
            assert_allclose(gram, reference, dtype=np.float32, scale=10)
            if g > 0:  # the quantized groups before moved this group's inputs
                float_gram = float_grams[path][g : g + 1] if model_config.scan_layers else float_grams[path]
                assert not np.allclose(gram, float_gram, rtol=1e-3), path
            used.setdefault(path, []).append(gram)
    assert set(used) == set(quantized_paths(params, config))
    grams = {path: jnp.concatenate(parts) if model_config.scan_layers else parts[0] for path, parts in used.items()}
    expected = quantize_params(params, config, grams=grams)
    assert jax.tree.structure(quantized) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(quantized), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)
    return uncalibrated


def test_sequential_gptq_calibrates_each_group_on_the_groups_quantized_before_it(model_and_params, monkeypatch):
    model, params, tokens = model_and_params
    batches = [{"tokens": tokens}, {"tokens": tokens[::-1]}]
    config = QuantizeConfig(format="int8", method="gptq", targets=("q", "k", "v", "o"))  # one GPTQ shape to compile
    uncalibrated = _assert_sequential_gptq_matches_its_reference(
        model.config, {"params": params}, batches, config, monkeypatch
    )
    assert uncalibrated == {}


def test_sequential_gptq_of_a_moe_model_carries_router_logits_state_and_segments(monkeypatch):
    """MoE layers with MoE++'s gating residual (router logits carried from group to group), a
    balance bias (model state, sliced per group) that keeps expert 3 unrouted, and packed
    calibration batches (segment ids, padding 0): each group as its reference, expert 3 of each
    layer rounded to nearest and counted."""
    from ember.models.config import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, expert_dim=32, bias_balancing_rate=0.01, gating_residual=True)
    config = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, mlp_dim=32, mlp_pattern=("moe",),
                         moe=moe)  # fmt: skip
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, 64)
    params = nn.meta.unbox(jax.jit(DecoderLM(config).init)(jax.random.key(0), tokens)["params"])
    router = params["layers"]["block_0"]["moe"]["router"]
    router["residual"] = 30 * router["residual"]  # the carried logits change which experts layer 1 picks
    state = {"balance": {"layers": {"block_0": {"moe": {"router_bias": jnp.array([[0.0, 0, 0, -1e9]] * 2)}}}}}
    segments = jnp.repeat(jnp.array([[1, 2, 0, 0]]), 4, axis=1).repeat(2, axis=0)  # two documents, then padding
    positions = jnp.tile(jnp.arange(4), 4)[None].repeat(2, axis=0)
    batches = [{"tokens": tokens[i : i + 2], "segment_ids": segments, "positions": positions} for i in (0, 2)]
    quantize = QuantizeConfig(format="int4", group_size=32, method="gptq")  # every matrix [32, 32], as above
    with pytest.warns(UserWarning, match=r"GPTQ rounds 6 matrices to nearest, of the 24 in .*experts/"):
        uncalibrated = _assert_sequential_gptq_matches_its_reference(
            config, {"params": params, **state}, batches, quantize, monkeypatch
        )
    assert uncalibrated == {f"layers/block_0/moe/experts/{name}": 2 for name in ("gate", "up", "down")}

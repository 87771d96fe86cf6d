"""Hugging Face parity: tiny random ``transformers`` models built locally (no download) give
the same logits as Ember after ``ember.models.hf.load``, and greedy decoding through Ember's
serving engine (its one decode path) matches ``generate`` token for token."""

import json
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.core.errors import ConfigError, DataError, PathNotFoundError
from ember.core.sharding import unbox
from ember.models import hf
from ember.models.adapters import LoraConfig, add_lora, merged_weights
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.quantization import QuantizeConfig, quantize_params
from ember.serving.engine import Engine
from ember.serving.requests import SamplingParams
from tests.hf_peers import ember_logits, random_hf_model
from tests.programs import programs_lowered
from tests.tolerances import assert_allclose

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
CASES = {
    # Llama-3 rope scaling with a short original context so that all three frequency bands occur.
    "llama": lambda: transformers.LlamaConfig(
        **COMMON,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=8),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
}
PROMPT_LEN, NEW_TOKENS = 12, 32


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(name, hf_model, directory it was saved to, ember config, ember params)."""
    name = request.param
    model = random_hf_model(CASES[name](), seed=len(name))
    path = tmp_path_factory.mktemp(name)
    # Mistral is saved in small shards to exercise the sharded-index reader.
    model.save_pretrained(path, max_shard_size="40KB" if name == "mistral" else "1GB")
    config, params = hf.load(path, attention_impl="xla")
    return name, model, path, config, jax.tree.map(jnp.asarray, params)


def initial_params(config, seed=0, *, boxed=False):
    """``DecoderLM(config)``'s initial parameters (unboxed unless ``boxed``), in one program: op by
    op, an init compiled ~40 programs per model shape."""
    params = jax.jit(DecoderLM(config).init)(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]
    return params if boxed else unbox(params)


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.array(tokens))).logits.numpy()


def test_config_maps_the_architecture(pair):
    name, _model, path, config, _ = pair
    assert config.kv_heads == 2 and config.num_heads == 4 and config.head_size == 16
    assert config.qkv_bias == (name == "qwen2")
    assert config.tie_embeddings == (name == "qwen2")
    assert config.block_pattern == (("local",) if name == "mistral" else ("global",))
    if name == "mistral":
        assert config.sliding_window == 8
        assert json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    if name == "llama":
        assert config.rope.scaling == "llama3" and config.rope.factor == 4.0 and config.rope.original_max_len == 16


def test_logits_match_transformers(pair, rng):
    _name, model, _, config, params = pair
    tokens = jax.random.randint(rng, (2, 40), 0, config.vocab_size)
    ours = ember_logits(config, params, tokens)
    # The bar is 1e-4 on float32 logits: torch and XLA sum the matmuls in different orders.
    assert_allclose(ours, hf_logits(model, tokens), scale=10)


def test_greedy_decode_matches_generate(pair, rng):
    _name, model, _, config, params = pair
    prompt = jax.random.randint(rng, (2, PROMPT_LEN), 0, config.vocab_size)
    with torch.no_grad():
        expected = model.generate(
            torch.as_tensor(np.array(prompt)), max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=None
        ).numpy()[:, PROMPT_LEN:]
    # The serving engine's ragged decode path (chunked prefill, paged cache, state slots).
    engine = Engine.from_model(
        config, params, num_slots=2, token_buckets=(2 * PROMPT_LEN,), max_context=PROMPT_LEN + NEW_TOKENS
    )
    results = engine.generate(np.asarray(prompt).tolist(), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    np.testing.assert_array_equal([r.tokens for r in results], expected)


def test_save_round_trips_through_transformers(pair, tmp_path, rng):
    name, _, _, config, params = pair
    hf.save(tmp_path, config, params, model_type=name)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = jax.random.randint(rng, (1, 24), 0, config.vocab_size)
    ours = ember_logits(config, params, tokens)
    assert_allclose(ours, hf_logits(reloaded, tokens), scale=10)  # same reason as above
    config_again, params_again = hf.load(tmp_path, attention_impl="xla")
    assert config_again == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params_again, params)


def test_save_refuses_adapters_and_quantized_weights(tmp_path):
    """Adapter leaves were dropped without a word (the base written as the fine-tuned model) and
    a quantized weight failed in a numpy reshape."""
    config = ModelConfig(vocab_size=31, d_model=32, num_layers=2, num_heads=2, mlp_dim=32, tie_embeddings=False)
    params = initial_params(config)
    # Jitted: one program each (unjitted, adding the adapters and merging run op by op).
    adapted = jax.jit(lambda p: add_lora(p, LoraConfig(rank=2, targets=("q",)), jax.random.key(1)))(params)
    with pytest.raises(DataError, match=r"carry adapters.*merged_weights"):
        hf.save(tmp_path, config, adapted)
    with pytest.raises(DataError, match=r"stored quantized.*dequantize_params"):
        hf.save(tmp_path, config, jax.jit(quantize_params, static_argnums=1)(params, QuantizeConfig(format="int8")))
    merged = jax.jit(merged_weights)(adapted)  # plain weights again
    hf.save(tmp_path, config, merged)
    q = [tree["layers"]["block_0"]["attn"]["q"]["kernel"] for tree in (hf.load(tmp_path)[1], merged)]
    np.testing.assert_array_equal(*q)


def test_unsupported_architectures_and_fields_are_named(tmp_path):
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        hf.config_from_hf({"model_type": "gpt2"})
    llama = CASES["llama"]().to_dict()
    with pytest.raises(ValueError, match="mlp_bias"):
        hf.config_from_hf({**llama, "mlp_bias": True})
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        hf.config_from_hf({**llama, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        hf.config_from_hf({**llama, "hidden_act": "relu"})
    # A GPTQ / AWQ / bitsandbytes checkpoint: before, "missing tensor '...q_proj.weight'" (GPTQ
    # stores qweight/qzeros/scales) or "has shape (512, 1) ...: the weights are not of this config".
    for method in ("gptq", "bitsandbytes"):
        with pytest.raises(ConfigError, match=rf"quantization_config \(quant_method '{method}'\).*ember quantize"):
            hf.config_from_hf({**llama, "quantization_config": {"quant_method": method, "bits": 4}})
    # Before, a KeyError traceback.
    scaling = {k: v for k, v in llama["rope_parameters"].items() if k != "original_max_position_embeddings"}
    with pytest.raises(ConfigError, match="llama3 rope scaling needs 'original_max_position_embeddings'"):
        hf.config_from_hf({**llama, "rope_parameters": scaling})


def test_save_over_a_sharded_checkpoint_loads_the_new_weights(tmp_path):
    """``save`` into a directory holding a sharded checkpoint writes ``model.safetensors`` beside the
    old index, and ``transformers`` reads the single file first. ``load`` read the stale shards
    instead: the old weights, without a word."""
    config = ModelConfig(vocab_size=31, d_model=32, num_layers=2, num_heads=2, mlp_dim=32, tie_embeddings=False)
    old, new = (initial_params(config, seed) for seed in (0, 1))
    hf.save(tmp_path, config, old)
    shard = tmp_path / "model-00001-of-00001.safetensors"
    (tmp_path / "model.safetensors").rename(shard)
    weight_map = {name: shard.name for name in hf.params_to_hf(config, old)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hf.save(tmp_path, config, new)
    _, loaded = hf.load(tmp_path)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), loaded, new)


def test_a_geglu_model_exports_with_gelu_pytorch_tanh(tmp_path, rng):
    """``load`` reads ``hidden_act: gelu_pytorch_tanh`` as ``mlp: geglu``, but ``save`` refused to
    write a geglu model back (ConfigError: needs mlp='swiglu')."""
    config = ModelConfig(
        vocab_size=31,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=48,
        mlp="geglu",
        qkv_bias=True,
    )
    # biases and norms off their init (one program: op by op, ~10 per leaf shape)
    params = jax.jit(lambda p: jax.tree.map(lambda x: x + 0.1 * jax.random.normal(rng, x.shape), p))(
        initial_params(config)
    )
    hf.save(tmp_path, config, params, model_type="qwen2")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = jax.random.randint(rng, (1, 16), 0, config.vocab_size)
    ours = ember_logits(config, params, tokens)
    assert_allclose(ours, hf_logits(reloaded, tokens), scale=10)  # as in test_logits_match_transformers
    assert hf.load(tmp_path)[0] == config
    # transformers' gelu_new and gelu_fast are the same tanh GELU; Ember refused them.
    hf_config = json.loads((tmp_path / "config.json").read_text())
    for name in ("gelu_new", "gelu_fast"):
        (tmp_path / "config.json").write_text(json.dumps({**hf_config, "hidden_act": name}))
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
        assert_allclose(ours, hf_logits(reloaded, tokens), scale=10)
        assert hf.load(tmp_path)[0] == config


def test_a_truncated_or_torn_checkpoint_is_a_data_error(tmp_path):
    """An interrupted download raised safetensors' own SafetensorError (not naming the file) and an
    index without a weight_map a KeyError: tracebacks from `ember generate`, not one-line errors."""
    config = ModelConfig(vocab_size=31, d_model=32, num_layers=2, num_heads=2, mlp_dim=32)
    hf.save(tmp_path, config, initial_params(config))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(DataError, match=r"model\.safetensors is not a complete safetensors file"):
        hf.load(tmp_path)
    weights.rename(tmp_path / "model-00001-of-00002.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(DataError, match="is not a safetensors index"):
        hf.load(tmp_path)
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(PathNotFoundError, match=r"no model-00002-of-00002\.safetensors in"):
        hf.load(tmp_path)


def test_weights_of_another_config_are_a_data_error_naming_the_tensor(tmp_path):
    """A config.json that does not describe its weights failed in a numpy reshape ("cannot reshape
    array of size 512 into shape (32,4,8)") or loaded and failed in the first forward."""
    config = ModelConfig(vocab_size=31, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48)
    hf.save(tmp_path, config, initial_params(config))
    saved = json.loads((tmp_path / "config.json").read_text())
    for field, value, tensor, shapes in (
        ("num_key_value_heads", 4, "model.layers.0.self_attn.k_proj.weight", r"\(16, 32\).*\(32, 32\)"),
        ("intermediate_size", 64, "model.layers.0.mlp.gate_proj.weight", r"\(48, 32\).*\(64, 32\)"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**saved, field: value}))
        with pytest.raises(DataError, match=rf"tensor '{tensor}' has shape {shapes}"):
            hf.load(tmp_path)


def test_save_takes_the_boxed_params_init_returns(tmp_path):
    """``model.init(...)["params"]`` (``nn.Partitioned`` leaves) failed in a numpy reshape ("cannot
    reshape array of size 1 into shape (32,newaxis)"), as ``save_peft_adapter`` takes them."""
    config = ModelConfig(vocab_size=31, d_model=32, num_layers=2, num_heads=2, mlp_dim=32)
    boxed = initial_params(config, boxed=True)
    hf.save(tmp_path, config, boxed)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), hf.load(tmp_path)[1], unbox(boxed))


def test_a_config_json_that_is_not_a_json_object_is_a_data_error(tmp_path):
    """Before, json's JSONDecodeError (or, for a list, an AttributeError in config_from_hf): a traceback."""
    for text, match in (('{"model_type": "llama",', "is not JSON"), ("[]", "is not a JSON object")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(DataError, match=rf"config\.json {match}"):
            hf.load(tmp_path)


@pytest.mark.parametrize(
    "kinds, max_window_layers",
    [(("global", "local", "local"), 1), (("local",) * 3, 0), (("global",) * 3, 3), (("local", "global", "local"), 3)],
)
def test_qwen2_export_sets_max_window_layers_for_readers_without_layer_types(kinds, max_window_layers):
    """transformers 4.x slides the layers from ``max_window_layers`` on; export wrote the layer
    count, so such a reader saw a model whose last layers slide as all global."""
    config = ModelConfig(
        vocab_size=31, d_model=32, num_layers=3, num_heads=2, mlp_dim=32, qkv_bias=True, block_pattern=kinds
    )
    exported = hf.config_to_hf(config, "qwen2")
    assert exported["max_window_layers"] == max_window_layers
    if max_window_layers < 3 or "local" not in kinds:  # expressible without layer_types
        del exported["layer_types"]
        assert hf.config_from_hf(exported).layer_kinds == config.layer_kinds
        assert transformers.Qwen2Config(**exported).layer_types == hf.config_to_hf(config, "qwen2")["layer_types"]


def test_load_gives_the_parameter_dtype_precision_asks_for(tmp_path):
    """``load(path, precision="pure_bf16")`` (what ``ember serve`` and a fine-tuning run's
    ``base_model.precision`` pass) returned float32 weights whatever the precision: a bf16-param
    run trained (and a LoRA run froze) a float32 base, twice the memory asked for, silently.
    The default dtype is now the config's parameter dtype, the dtype ``init`` gives."""
    config = ModelConfig(vocab_size=31, d_model=32, num_layers=1, num_heads=2, mlp_dim=32)
    params = initial_params(config)
    hf.save(tmp_path, config, params, dtype=jnp.bfloat16)
    for precision, expected in (("pure_bf16", jnp.bfloat16), ("bf16", jnp.float32), ("f32", jnp.float32)):
        loaded_config, loaded = hf.load(tmp_path, precision=precision)
        init = initial_params(loaded_config)
        assert {np.asarray(x).dtype for x in jax.tree.leaves(loaded)} == {np.dtype(expected)}
        jax.tree.map(lambda a, b: np.testing.assert_equal(np.asarray(a).dtype, b.dtype), loaded, init)
    assert hf.load(tmp_path, precision="pure_bf16", dtype=np.float32)[1]["embed"]["embedding"].dtype == np.float32


def test_load_reads_the_checkpoint_tensor_by_tensor_into_host_arrays(tmp_path):
    """``load`` read every tensor of the checkpoint into memory, converted each beside it and
    stacked the scanned layers on a device: twice the model in host memory, and the layers
    whole on one device, before anything was placed. It now reads each tensor from the
    memory-mapped file when it converts it, and fills NumPy stacks layer by layer: the model
    once, plus the layer being read and the one before it (~0.4x here, 6 layers)."""
    config = ModelConfig(vocab_size=32, d_model=64, num_layers=6, num_heads=4, mlp_dim=128)
    params = initial_params(config)
    with programs_lowered() as lowered:  # saving and loading slice and stack on the host: 10 programs each before
        hf.save(tmp_path, config, params)
        tracemalloc.start()
        try:
            _, loaded = hf.load(tmp_path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert not lowered
    leaves = jax.tree.leaves(loaded)
    assert {type(leaf) for leaf in leaves} == {np.ndarray}
    assert peak < 1.6 * sum(leaf.nbytes for leaf in leaves)  # all at once: 2.4x
    jax.tree.map(np.testing.assert_array_equal, loaded, jax.device_get(params))

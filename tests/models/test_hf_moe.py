"""Hugging Face MoE parity: tiny random Mixtral and Qwen2-MoE models built locally (no
download) give Ember's logits and load-balancing loss after ``ember.models.hf.load``, save back
through ``transformers``, load from the fused expert layout of transformers 5's modules, and
greedy decoding through the serving engine (Qwen2-MoE) and ``ember generate --checkpoint``
(Mixtral) equals a full-recompute argmax loop over the ``transformers`` forward."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.cli import main
from ember.core.errors import ConfigError
from ember.core.tree import param_paths, tree_from_paths
from ember.models import hf
from ember.models.config import ModelConfig, MoEConfig
from ember.models.decoder import DecoderLM
from ember.serving.engine import Engine
from ember.serving.requests import SamplingParams
from tests.hf_peers import ember_logits, random_hf_model
from tests.tolerances import assert_allclose

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=89,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
CASES = {
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, intermediate_size=24, num_hidden_layers=2, num_local_experts=4
    ),
    # Layer 0 dense (mlp_only_layers), layers 1 and 2 sparse: an interleaved pattern.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON,
        intermediate_size=40,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=20,
        num_hidden_layers=3,
        num_experts=5,
        mlp_only_layers=[0],
    ),
}
PROMPT_LEN, NEW_TOKENS = 6, 10


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(name, hf_model, directory it was saved to, ember config, ember params)."""
    name = request.param
    model = random_hf_model(CASES[name](), seed=len(name) + 7, scale=0.2)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    config, params = hf.load(path, attention_impl="xla", moe_impl="xla")
    return name, model, path, config, jax.tree.map(jnp.asarray, params)


def test_config_maps_the_moe_architecture(pair):
    name, _model, _path, config, _ = pair
    if name == "mixtral":
        assert config.layer_mlps == ("moe", "moe") and config.moe.renormalize and not config.moe.shared_experts
        assert (config.moe.num_experts, config.moe.top_k, config.expert_dim) == (4, 2, 24)
    else:
        assert config.layer_mlps == ("dense", "moe", "moe") and config.mlp_dim == 40 and config.qkv_bias
        assert (config.moe.num_experts, config.expert_dim, config.moe.shared_expert_dim) == (5, 16, 20)
        assert not config.moe.renormalize and config.moe.shared_expert_gate


def test_logits_and_load_balancing_loss_match_transformers(pair, rng):
    _name, model, _, config, params = pair
    tokens = jax.random.randint(rng, (2, 20), 0, config.vocab_size)
    apply = jax.jit(lambda p, t: DecoderLM(config).apply({"params": p}, t, mutable=["losses"]))
    (ours, _), sown = apply(params, tokens)
    with torch.no_grad():
        out = model(torch.as_tensor(np.array(tokens)), output_router_logits=True)
    # The bar is 1e-4 on float32 logits: torch and XLA sum the matmuls in different orders.
    assert_allclose(ours, out.logits.numpy(), scale=10)
    # transformers' global load_balancing_loss_func over every MoE layer's router logits.
    expected = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func(
        out.router_logits, config.moe.num_experts, config.moe.top_k
    )
    assert_allclose(sown["losses"]["load_balance"][0], float(expected), scale=10)


def test_padding_is_left_out_of_the_load_balancing_loss_as_transformers_does(pair, rng):
    """Right-padded rows: Ember's padding (segment id 0) against transformers' attention mask,
    which its load_balancing_loss_func also takes."""
    _name, model, _, config, params = pair
    tokens = jax.random.randint(rng, (2, 12), 0, config.vocab_size)
    real = np.arange(12)[None, :] < np.array([[12], [7]])
    apply = jax.jit(lambda p, t, s: DecoderLM(config).apply({"params": p}, t, segment_ids=s, mutable=["losses"]))
    (ours, _), sown = apply(params, tokens, jnp.asarray(real, jnp.int32))
    mask = torch.as_tensor(real.astype(np.int64))
    with torch.no_grad():
        out = model(torch.as_tensor(np.array(tokens)), attention_mask=mask, output_router_logits=True)
    assert_allclose(np.asarray(ours)[real], out.logits.numpy()[real], scale=10)
    expected = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func(
        out.router_logits, config.moe.num_experts, config.moe.top_k, mask
    )
    assert_allclose(sown["losses"]["load_balance"][0], float(expected), scale=10)


def test_fused_expert_layout_loads_the_same_params(pair):
    """transformers 5's modules hold ``experts.gate_up_proj`` / ``down_proj`` (what its
    ``state_dict()`` gives); ``save_pretrained`` wrote per-expert tensors."""
    name, model, _, config, params = pair
    state = {key: value.numpy() for key, value in model.state_dict().items()}
    assert any(key.endswith("experts.gate_up_proj") for key in state)
    fused = hf.params_from_hf(config, state, model_type=name)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), fused, params)


def test_save_round_trips_through_transformers(pair, tmp_path, rng):
    name, model, _, config, params = pair
    hf.save(tmp_path, config, params, model_type=name)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = torch.as_tensor(np.array(jax.random.randint(rng, (1, 16), 0, config.vocab_size)))
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(tokens).logits.numpy(), model(tokens).logits.numpy())
    config_again, params_again = hf.load(tmp_path, attention_impl="xla", moe_impl="xla")
    assert config_again == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params_again, params)


def hf_greedy(model, prompts, new_tokens):
    """Full-recompute greedy decoding: the argmax of the transformers forward, token by token."""
    results = []
    for prompt in prompts:
        sequence = list(prompt)
        for _ in range(new_tokens):
            with torch.no_grad():
                logits = model(torch.tensor([sequence])).logits[0, -1].numpy()
            sequence.append(int(np.argmax(logits)))
        results.append(sequence[len(prompt) :])
    return results


def test_greedy_decoding_matches_transformers(pair, tmp_path, rng):
    name, model, path, config, params = pair
    generator = np.random.default_rng(np.asarray(jax.random.key_data(rng)).ravel())
    prompts = [generator.integers(0, config.vocab_size, size=n).tolist() for n in (PROMPT_LEN, 3)]
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    if name == "qwen2_moe":  # the serving engine's ragged path (chunked prefill, paged cache)
        engine = Engine.from_model(config, params, num_slots=2, token_buckets=(4,), max_context=PROMPT_LEN + NEW_TOKENS)
        results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [r.tokens for r in results] == expected
        return
    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps({"prompt_tokens": p, "max_tokens": NEW_TOKENS}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    flags = ["--num-slots", "2", "--token-budget", "4", "--no-progress"]
    assert main(["generate", "--checkpoint", str(path), "--prompts", str(lines), "--out", str(out), *flags]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tokens"] for r in records] == expected


def test_moe_configs_that_hf_cannot_express_are_named(pair):
    name, _, _, config, _ = pair
    with pytest.raises(ValueError, match=f"does not export to {name}"):
        hf.config_to_hf(dataclasses.replace(config, moe=dataclasses.replace(config.moe, score="sigmoid")), name)
    with pytest.raises(ValueError, match="cannot express mlp placements"):
        hf.config_to_hf(config, "qwen2" if name == "qwen2_moe" else "llama")


@pytest.mark.parametrize("mlp_pattern,first_dense", [(("moe", "dense"), 0), (("moe",), 1)])
def test_mixtral_refuses_dense_layers(mlp_pattern, first_dense):
    """Mixtral has an MoE MLP in every layer: a dense one would be lost (transformers would fill it
    with random experts); such a model exports as qwen2_moe."""
    moe = MoEConfig(num_experts=4, expert_dim=24, first_dense_layers=first_dense)
    config = ModelConfig(num_layers=2, mlp_pattern=mlp_pattern, moe=moe, scan_layers=False)
    with pytest.raises(ConfigError, match=r"mixtral cannot express mlp placements.*exports as qwen2_moe"):
        hf.config_to_hf(config, "mixtral")


@pytest.mark.parametrize("pair", ["qwen2_moe"], indirect=True)
def test_qwen2_moe_without_qkv_bias_round_trips(pair, tmp_path, rng):
    """Qwen2-MoE's q/k/v biases are optional (``qkv_bias``): a model without them exports too."""
    _, _, _, config, params = pair
    config = dataclasses.replace(config, qkv_bias=False)
    params = tree_from_paths({p: v for p, v in param_paths(params).items() if not re.search(r"attn/./bias$", p)})
    hf.save(tmp_path, config, params, model_type="qwen2_moe")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = jax.random.randint(rng, (1, 16), 0, config.vocab_size)
    with torch.no_grad():
        expected = reloaded(torch.as_tensor(np.array(tokens))).logits.numpy()
    assert_allclose(ember_logits(config, params, tokens), expected, scale=10)
    assert hf.load(tmp_path, attention_impl="xla", moe_impl="xla")[0] == config


def test_qwen2_moe_sliding_window_needs_layer_types():
    """Without ``layer_types`` transformers releases disagree on which Qwen2-MoE layers slide."""
    hf_config = {**CASES["qwen2_moe"]().to_dict(), "use_sliding_window": True, "sliding_window": 4}
    hf_config.pop("layer_types", None)
    with pytest.raises(ConfigError, match="no layer_types"):
        hf.config_from_hf(hf_config)
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    assert hf.config_from_hf({**hf_config, "layer_types": layer_types}).layer_kinds == ("local", "global", "local")


@pytest.mark.parametrize("step", [0, -2])
def test_qwen2_moe_decoder_sparse_step_must_be_positive(step):
    """Layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0``: 0 crashed with
    ZeroDivisionError ('integer modulo by zero')."""
    hf_config = {**CASES["qwen2_moe"]().to_dict(), "decoder_sparse_step": step}
    with pytest.raises(ConfigError, match="decoder_sparse_step must be a positive integer") as error:
        hf.config_from_hf(hf_config)
    assert error.value.key == "decoder_sparse_step"


def test_qwen2_moe_without_a_shared_expert_loads(tmp_path, rng):
    """``shared_expert_intermediate_size: 0``: transformers builds a zero-width shared expert
    (its tensors are saved, its output is 0); the load refused them ('has tensors Ember does
    not use: ...shared_expert.down_proj.weight ...')."""
    model = random_hf_model(
        dataclasses.replace(CASES["qwen2_moe"](), shared_expert_intermediate_size=0), seed=3, scale=0.2
    )
    model.save_pretrained(tmp_path)
    config, params = hf.load(tmp_path, attention_impl="xla", moe_impl="xla")
    assert not config.moe.shared_experts
    tokens = jax.random.randint(rng, (1, 12), 0, config.vocab_size)
    with torch.no_grad():
        expected = model(torch.as_tensor(np.array(tokens))).logits.numpy()
    assert_allclose(ember_logits(config, params, tokens), expected, scale=10)


@pytest.mark.parametrize("field,value", [("num_experts", 0), ("mlp_only_layers", [0, 1, 2])])
def test_qwen2_moe_with_no_sparse_layer_loads_as_dense(field, value, tmp_path, rng):
    """transformers builds every layer dense; the import raised 'moe.top_k must be in [1, 1]'
    for num_experts 0 (its routing settings were checked though no layer routes)."""
    model = random_hf_model(dataclasses.replace(CASES["qwen2_moe"](), **{field: value}), seed=4, scale=0.2)
    model.save_pretrained(tmp_path)
    config, params = hf.load(tmp_path, attention_impl="xla")
    assert config.layer_mlps == ("dense",) * 3
    tokens = jax.random.randint(rng, (1, 12), 0, config.vocab_size)
    with torch.no_grad():
        expected = model(torch.as_tensor(np.array(tokens))).logits.numpy()
    assert_allclose(ember_logits(config, params, tokens), expected, scale=10)

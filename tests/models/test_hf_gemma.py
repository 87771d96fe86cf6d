"""Hugging Face Gemma, Gemma 2 and Gemma 3 (text) parity: tiny random ``transformers`` models built
locally (no download) give Ember's logits after ``ember.models.hf.load``, greedy decoding through
the serving engine gives a full-recompute argmax loop's tokens, and they save back to
``transformers``.

What Gemma adds to Llama (``ember.models.hf.gemma``): embeddings times ``sqrt(hidden)``, norms
multiplying by ``1 + weight``; Gemma 2 and 3 normalise each sublayer's output, scale attention by
``query_pre_attn_scalar ** -0.5`` (20 here, not ``head_dim`` 12) and slide a window (6 of the
20 tokens) on some layers; Gemma 2 soft-caps attention and output logits (small caps here, so
they bend the logits); Gemma 3 has QK-norm and rotates its sliding layers at their own base."""

import math

import jax
import numpy as np
import pytest

from ember.core.errors import ConfigError
from ember.models import hf
from ember.models.config import ModelConfig
from ember.serving.engine import Engine
from ember.serving.requests import SamplingParams
from tests.hf_peers import HEADS_WIDER_THAN_SPLIT, ember_logits, random_hf_model, saved_and_loaded
from tests.tolerances import assert_allclose

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = HEADS_WIDER_THAN_SPLIT
SANDWICH = dict(query_pre_attn_scalar=20, sliding_window=6)
CASES = {
    "gemma": lambda: transformers.GemmaConfig(**COMMON, num_hidden_layers=2),
    # Layers slide, attend, slide (layer_types); soft-caps small enough to bend the logits.
    "gemma2": lambda: transformers.Gemma2Config(
        **COMMON,
        **SANDWICH,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),
    # Untied head; the global layer's rotation scaled linearly, the sliding ones' at another base.
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **COMMON,
        **SANDWICH,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
        },
    ),
}
PROMPT_LEN, NEW_TOKENS = 10, 12


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(name, hf_model, ember config, ember params)."""
    return saved_and_loaded(request.param, CASES[request.param](), tmp_path_factory.mktemp(request.param))


def test_config_maps_the_architecture(pair):
    name, _, config, _ = pair
    assert config.mlp == "geglu" and config.embed_scale == math.sqrt(32)
    assert (config.num_heads, config.kv_heads, config.head_size) == (4, 2, 12)
    assert config.post_norms == (name != "gemma") and config.qk_norm == (name == "gemma3_text")
    assert config.attn_scale == (0.0 if name == "gemma" else 20**-0.5)
    assert (config.attn_soft_cap, config.final_soft_cap) == ((2.0, 3.0) if name == "gemma2" else (0.0, 0.0))
    kinds = {"gemma": ("global",) * 2, "gemma2": ("local", "global", "local"), "gemma3_text": ("local", "global")}
    assert config.layer_kinds == kinds[name]
    if name == "gemma3_text":
        assert (config.rope.theta, config.rope.scaling, config.rope.factor) == (1000.0, "linear", 4.0)
        assert config.local_rope_theta == 50.0 and not config.tie_embeddings
    else:
        assert config.local_rope_theta == 0.0 and config.tie_embeddings


def test_logits_match_transformers(pair, rng):
    _, model, config, params = pair
    tokens = jax.random.randint(rng, (2, 20), 0, config.vocab_size)
    with torch.no_grad():
        expected = model(torch.as_tensor(np.array(tokens))).logits.numpy()
    # The bar of the other HF parity tests, 1e-4 on float32 logits: torch and XLA sum in different orders.
    assert_allclose(ember_logits(config, params, tokens), expected, scale=10)


def test_greedy_decoding_through_the_engine_is_a_full_recompute_argmax_loop(pair, rng):
    _, model, config, params = pair
    prompts = np.asarray(jax.random.randint(rng, (2, PROMPT_LEN), 0, config.vocab_size))
    sequences = torch.as_tensor(prompts.copy())
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            sequences = torch.cat([sequences, model(sequences).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    engine = Engine.from_model(
        config, params, num_slots=2, token_buckets=(8, 2 * PROMPT_LEN), max_context=PROMPT_LEN + NEW_TOKENS
    )
    results = engine.generate(prompts.tolist(), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    np.testing.assert_array_equal([r.tokens for r in results], sequences.numpy()[:, PROMPT_LEN:])


def test_save_round_trips_through_transformers(pair, tmp_path, rng):
    name, model, config, params = pair
    hf.save(tmp_path, config, params, model_type=name)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reloaded) is type(model)
    tokens = torch.as_tensor(np.array(jax.random.randint(rng, (1, 16), 0, config.vocab_size)))
    with torch.no_grad():
        # A norm weight w comes back as (1 + w) - 1 in float32: w to a few ulps of 1.
        assert_allclose(reloaded(tokens).logits.numpy(), model(tokens).logits.numpy(), scale=10)
    config_again, params_again = hf.load(tmp_path, attention_impl="xla")
    assert config_again == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params_again, params)


def test_a_config_json_without_layer_types_or_per_layer_rope_reads_as_transformers_reads_it():
    """Released Gemma 2 and Gemma 3 configs predate ``layer_types`` (every second layer slides in
    Gemma 2, all but every sixth in Gemma 3) and Gemma 3's per-layer-type ``rope_parameters``
    (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``)."""
    sizes = dict(COMMON, **SANDWICH, num_hidden_layers=7)
    released = {
        "gemma2": dict(sizes, model_type="gemma2"),
        "gemma3_text": dict(
            sizes,
            model_type="gemma3_text",
            rope_theta=1000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            rope_local_base_freq=50.0,
            sliding_window_pattern=3,
        ),
    }
    for model_type, fields in released.items():
        written = transformers.AutoConfig.for_model(**fields).to_dict()
        assert "rope_local_base_freq" not in written
        ours = hf.config_from_hf(fields)
        assert ours == hf.config_from_hf(written), model_type
        period = 2 if model_type == "gemma2" else 3
        assert ours.layer_kinds == tuple("local" if (i + 1) % period else "global" for i in range(7))
    assert hf.config_from_hf(released["gemma3_text"]).local_rope_theta == 50.0


def test_a_config_that_another_type_cannot_express_is_refused_naming_why(tmp_path):
    gemma2, gemma3 = (hf.config_from_hf(CASES[name]().to_dict()) for name in ("gemma2", "gemma3_text"))
    llama = ModelConfig(vocab_size=89, d_model=32, num_heads=4, mlp_dim=40)
    params = {}  # refused before any weight is read
    for config, model_type, reason in (
        (gemma3, "llama", "embed_scale"),
        (gemma3, "gemma", "post_norms"),
        (gemma3, "gemma2", "local_rope_theta"),
        (gemma2, "gemma3_text", "qk_norm"),
        (gemma2, "qwen3", "soft-caps"),
        (llama, "gemma", "mlp='swiglu'"),
    ):
        with pytest.raises(ConfigError, match=reason):
            hf.save(tmp_path / model_type, config, params, model_type=model_type)


def test_a_multimodal_gemma3_checkpoint_loads_as_its_language_model(tmp_path, rng):
    """Gemma 3's 4B-27B releases are ``Gemma3ForConditionalGeneration``: Ember reads their
    ``text_config`` and ``language_model.*`` tensors (the vision tower and projector unread),
    gives the whole model's logits on text, and saves the language model as ``gemma3_text``."""
    text = dict(COMMON, **SANDWICH, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    multimodal = transformers.Gemma3Config(text_config=text, vision_config=dict(vision, patch_size=14))
    model = random_hf_model(multimodal, seed=3, scale=0.2)
    model.save_pretrained(tmp_path / "multimodal")
    config, params = hf.load(tmp_path / "multimodal", attention_impl="xla")
    assert config.qk_norm and config.post_norms and config.layer_kinds == ("local", "global")
    tokens = jax.random.randint(rng, (2, 20), 0, config.vocab_size)
    with torch.no_grad():
        expected = model(torch.as_tensor(np.array(tokens))).logits.numpy()
    assert_allclose(ember_logits(config, params, tokens), expected, scale=10)
    hf.save(tmp_path / "text", config, params, model_type="gemma3_text")
    text_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", attn_implementation="eager")
    with torch.no_grad():
        assert_allclose(text_model.eval()(torch.as_tensor(np.array(tokens))).logits.numpy(), expected, scale=10)

"""Hugging Face Qwen3 and Qwen3-MoE parity: tiny random ``transformers`` models built locally (no
download) give Ember's logits (and, for Qwen3-MoE, its load-balancing loss) after
``ember.models.hf.load``, and save back to ``transformers`` unchanged.

Qwen3 is Llama-shaped plus QK-norm (an RMSNorm over ``head_dim`` on each head's q and k, before
rotary embedding: Ember's ``qk_norm``), with ``head_dim`` here 12, not ``hidden / heads`` = 8.
Qwen3-MoE routes as Qwen2-MoE without the shared expert: softmax, top-k, renormalised or not
(``norm_topk_prob``); its dense layers come from ``mlp_only_layers`` or ``decoder_sparse_step``."""

import dataclasses

import jax
import numpy as np
import pytest

from ember.core.errors import ConfigError
from ember.models import hf
from ember.models.config import ModelConfig, MoEConfig
from ember.models.decoder import DecoderLM
from tests.hf_peers import HEADS_WIDER_THAN_SPLIT, saved_and_loaded
from tests.tolerances import assert_allclose

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = HEADS_WIDER_THAN_SPLIT
MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=16)
CASES = {
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_hidden_layers=2),
    # Tied embeddings, and a sliding-window layer (window 6 of the 20 tokens) after a global one.
    "qwen3_tied_sliding": lambda: transformers.Qwen3Config(
        **COMMON,
        num_hidden_layers=2,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=6,
        layer_types=["full_attention", "sliding_attention"],
    ),
    # Layer 0 dense (mlp_only_layers), layers 1 and 2 sparse, top-k weights renormalised.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, **MOE, num_hidden_layers=3, mlp_only_layers=[0], norm_topk_prob=True
    ),
    # Every second layer sparse (decoder_sparse_step 2: layer 0 dense, layer 1 sparse), weights not renormalised.
    "qwen3_moe_sparse_step": lambda: transformers.Qwen3MoeConfig(
        **COMMON, **MOE, num_hidden_layers=2, decoder_sparse_step=2, norm_topk_prob=False
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(name, hf_model, ember config, ember params)."""
    return saved_and_loaded(
        request.param, CASES[request.param](), tmp_path_factory.mktemp(request.param), moe_impl="xla"
    )


def test_config_maps_the_architecture(pair):
    name, model, config, _ = pair
    assert config.qk_norm and not config.qkv_bias
    assert (config.num_heads, config.kv_heads, config.head_size) == (4, 2, 12)
    assert config.tie_embeddings == (name == "qwen3_tied_sliding")
    assert config.layer_kinds == (
        ("global", "local") if name == "qwen3_tied_sliding" else ("global",) * len(config.layer_kinds)
    )
    if name == "qwen3_tied_sliding":
        assert config.sliding_window == 6
    if "moe" in name:
        expected = ("dense", "moe", "moe") if name == "qwen3_moe" else ("dense", "moe")
        assert config.layer_mlps == expected and config.mlp_dim == 40
        assert (config.moe.num_experts, config.moe.top_k, config.expert_dim) == (5, 2, 16)
        assert config.moe.renormalize == model.config.norm_topk_prob and not config.moe.shared_experts
    else:
        assert set(config.layer_mlps) == {"dense"}


def test_logits_and_load_balancing_loss_match_transformers(pair, rng):
    name, model, config, params = pair
    tokens = jax.random.randint(rng, (2, 20), 0, config.vocab_size)
    apply = jax.jit(lambda p, t: DecoderLM(config).apply({"params": p}, t, mutable=["losses"]))
    (ours, _), sown = apply(params, tokens)
    with torch.no_grad():
        out = model(torch.as_tensor(np.array(tokens)), output_router_logits="moe" in name)
    # The bar of the other HF parity tests, 1e-4 on float32 logits: torch and XLA sum in different orders.
    assert_allclose(ours, out.logits.numpy(), scale=10)
    if "moe" in name:  # transformers' global load_balancing_loss_func over the MoE layers' router logits
        expected = transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func(
            out.router_logits, config.moe.num_experts, config.moe.top_k
        )
        assert_allclose(sown["losses"]["load_balance"][0], float(expected), scale=10)


def test_save_round_trips_through_transformers(pair, tmp_path, rng):
    name, model, config, params = pair
    model_type = "qwen3_moe" if "moe" in name else "qwen3"
    hf.save(tmp_path, config, params, model_type=model_type)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reloaded) is type(model)
    tokens = torch.as_tensor(np.array(jax.random.randint(rng, (1, 16), 0, config.vocab_size)))
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(tokens).logits.numpy(), model(tokens).logits.numpy())
    config_again, params_again = hf.load(tmp_path, attention_impl="xla", moe_impl="xla")
    assert config_again == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params_again, params)


@pytest.mark.parametrize("pair", ["qwen3_moe"], indirect=True)
def test_fused_expert_layout_loads_the_same_params(pair):
    """transformers 5's modules hold ``experts.gate_up_proj`` / ``down_proj`` (``state_dict()``);
    ``save_pretrained`` wrote per-expert tensors."""
    name, model, config, params = pair
    state = {key: value.numpy() for key, value in model.state_dict().items()}
    assert any(key.endswith("experts.gate_up_proj") for key in state)
    fused = hf.params_from_hf(config, state, model_type=name)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), fused, params)


def test_what_ember_cannot_compute_is_refused_naming_it():
    qwen3 = CASES["qwen3"]().to_dict()
    # attention_bias also biases o_proj, which Ember's attention has no parameter for.
    with pytest.raises(ConfigError, match="unsupported qwen3 config field attention_bias=true"):
        hf.config_from_hf({**qwen3, "attention_bias": True})
    qwen3_moe = CASES["qwen3_moe"]().to_dict()
    with pytest.raises(ConfigError, match=r"qwen3_moe with use_sliding_window=true: transformers releases disagree"):
        hf.config_from_hf({**qwen3_moe, "use_sliding_window": True, "sliding_window": 8})
    with pytest.raises(ConfigError, match="qwen3_moe config field decoder_sparse_step must be a positive integer"):
        hf.config_from_hf({**qwen3_moe, "decoder_sparse_step": 0})


def test_qwen3_moe_has_no_shared_expert_whatever_the_config_json_says():
    """transformers' Qwen3-MoE builds no shared expert: a stray Qwen2-MoE field changes nothing."""
    qwen3_moe = CASES["qwen3_moe"]().to_dict()
    config = hf.config_from_hf({**qwen3_moe, "shared_expert_intermediate_size": 8})
    assert config == hf.config_from_hf(qwen3_moe) and not config.moe.shared_experts


def test_export_refuses_what_the_target_type_cannot_express():
    plain = ModelConfig(vocab_size=31, d_model=32, num_layers=2, num_heads=4, mlp_dim=32)
    qk_norm = dataclasses.replace(plain, qk_norm=True)
    assert hf.config_to_hf(qk_norm, "qwen3")["head_dim"] == 8
    # QK-norm was refused for every type; it is what qwen3 and qwen3_moe have, and only they.
    with pytest.raises(ConfigError, match="qk_norm=True cannot be expressed as llama: qwen3 and qwen3_moe always"):
        hf.config_to_hf(qk_norm, "llama")
    with pytest.raises(ConfigError, match="qk_norm=False cannot be expressed as qwen3: qwen3 and qwen3_moe always"):
        hf.config_to_hf(plain, "qwen3")
    moe = dataclasses.replace(qk_norm, mlp_pattern=("moe",), moe=MoEConfig(num_experts=4, expert_dim=16))
    assert hf.config_to_hf(moe, "qwen3_moe")["mlp_only_layers"] == []
    shared = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, shared_experts=1, shared_expert_gate=True))
    with pytest.raises(ConfigError, match=r"does not export to qwen3_moe: .* no shared experts"):
        hf.config_to_hf(shared, "qwen3_moe")
    with pytest.raises(ConfigError, match=r"qwen3_moe with use_sliding_window=true.*without sliding-window layers"):
        hf.config_to_hf(dataclasses.replace(moe, block_pattern=("local",)), "qwen3_moe")

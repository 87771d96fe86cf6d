"""A ``config.json`` that leaves fields out reads as transformers reads it: Ember's table of
transformers' defaults (``ember.models.hf.defaults``) against the installed config classes."""

import math

import pytest

from ember.core.errors import ConfigError
from ember.models import hf
from ember.models.hf.defaults import TRANSFORMERS_DEFAULTS

transformers = pytest.importorskip("transformers")

# The fields a hand-written tiny config of each type does set; the rest are left to the defaults.
DENSE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
GROUPED = dict(DENSE, num_key_value_heads=2)  # where transformers' default kv heads (8, 16, 32) exceed 4
TRIMMED = {
    "llama": DENSE,
    "mistral": GROUPED,
    "qwen2": GROUPED,
    "qwen3": GROUPED,  # no head_dim: transformers' is 128, not hidden_size / num_attention_heads
    # head_dim 256 too; no layer_types nor rope bases (Gemma 3's are per layer type)
    "gemma": GROUPED,
    "gemma2": GROUPED,
    "gemma3_text": GROUPED,
    "mixtral": GROUPED,
    "qwen2_moe": dict(GROUPED, num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    # transformers writes num_experts as num_local_experts (its attribute_map); the released configs as num_experts
    "qwen3_moe": dict(GROUPED, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32),
    "mamba2": dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16),
}


def transformers_default(model_type: str, field: str):
    config = transformers.AutoConfig.for_model(model_type)
    if field == "rope_theta" and getattr(config, "rope_parameters", None):  # transformers 5
        return config.rope_parameters["rope_theta"]
    return getattr(config, field)


@pytest.mark.parametrize("model_type", sorted(TRANSFORMERS_DEFAULTS))
def test_every_default_is_the_installed_transformers_one(model_type):
    assert model_type in hf.SUPPORTED_MODEL_TYPES
    for field, value in TRANSFORMERS_DEFAULTS[model_type].items():
        expected = transformers_default(model_type, field)
        assert value == expected or (isinstance(value, float) and math.isclose(value, expected)), (field, value)


@pytest.mark.parametrize("model_type", sorted(TRIMMED))
def test_a_trimmed_config_json_reads_as_the_transformers_config_it_builds(model_type):
    """Ember reads the trimmed dict as it reads the full one transformers writes for it:
    Mixtral's eps 1e-5 and theta 1e6, Mistral's 4096-token window, Qwen2-MoE's top-4 routing,
    Mamba-2's 8 groups (each differed from Ember's own fallbacks before), Qwen3's 128-wide heads."""
    trimmed = {"model_type": model_type, **TRIMMED[model_type]}
    full = transformers.AutoConfig.for_model(model_type, **TRIMMED[model_type]).to_dict()
    assert hf.config_from_hf(trimmed) == hf.config_from_hf(full)


@pytest.mark.parametrize("model_type", sorted(TRIMMED))
def test_a_null_or_non_numeric_field_is_a_config_error_naming_it(model_type):
    """``int(None)`` was a TypeError traceback from ``ember generate --checkpoint``."""
    trimmed = {"model_type": model_type, **TRIMMED[model_type]}
    for bad in (None, "wide", True):
        with pytest.raises(ConfigError, match=f"{model_type} config field hidden_size must be a number, got"):
            hf.config_from_hf({**trimmed, "hidden_size": bad})


def test_null_kv_heads_and_window_read_as_transformers_reads_them():
    """Null ``num_key_value_heads`` is one KV head per head and null ``sliding_window`` no window."""
    fields = dict(DENSE, num_key_value_heads=None)
    config = hf.config_from_hf({"model_type": "llama", **fields})
    assert config.num_kv_heads == transformers.AutoConfig.for_model("llama", **fields).num_key_value_heads == 4
    fields = dict(GROUPED, sliding_window=None)
    assert transformers.AutoConfig.for_model("mistral", **fields).sliding_window is None
    assert set(hf.config_from_hf({"model_type": "mistral", **fields}).layer_kinds) == {"global"}


def test_qwen3_moe_reads_num_experts_under_either_key_as_transformers_does():
    """``num_local_experts`` (what ``save_pretrained`` writes) wins over ``num_experts`` where both are there."""
    fields = dict(TRIMMED["qwen3_moe"])
    del fields["num_experts"]
    for keys in ({"num_local_experts": 6}, {"num_experts": 4, "num_local_experts": 6}, {"num_experts": 6}):
        assert transformers.Qwen3MoeConfig.from_dict({**fields, **keys}).num_experts == 6
        assert hf.config_from_hf({"model_type": "qwen3_moe", **fields, **keys}).moe.num_experts == 6

"""What transformers reads for a field a ``config.json`` leaves out, per model type.

``save_pretrained`` writes every field, but hand-written or trimmed configs omit some, and
transformers then builds the model from its config class's defaults. Ember reads such a
config the same way (:func:`with_transformers_defaults`), so that both compute the same
model: Mixtral's ``rms_norm_eps`` is 1e-5 and its rope theta 1e6, Mistral slides a 4096-token
window, Qwen2-MoE routes each token to 4 of 60 experts beside a shared one, Qwen3's heads are
128 wide whatever ``hidden_size / num_attention_heads`` is, Gemma 2 soft-caps its logits, Mamba-2
has 8 groups. Only the fields Ember maps are listed; tests/models/test_hf_defaults.py checks every
value against the installed transformers' config classes (read from transformers 5.24; Qwen3,
Qwen3-MoE and the Gemmas from 5.25).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from ember.core.errors import ConfigError

_DECODER = {
    "hidden_act": "silu",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "rope_theta": 10000.0,
}

_GEMMA_SANDWICH = {  # what Gemma 2 and Gemma 3 share
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "intermediate_size": 9216,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
}

TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_DECODER, "intermediate_size": 11008, "max_position_embeddings": 2048},
    "mistral": {
        **_DECODER,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
    },
    "qwen2": {
        **_DECODER,
        "vocab_size": 151936,
        "num_key_value_heads": 32,
        "intermediate_size": 22016,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "max_window_layers": 28,
    },
    "qwen3": {
        **_DECODER,
        "vocab_size": 151936,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "intermediate_size": 22016,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "max_window_layers": 28,
    },
    "gemma": {
        **_DECODER,
        "hidden_act": "gelu_pytorch_tanh",
        "vocab_size": 256000,
        "hidden_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "intermediate_size": 24576,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    "gemma2": {
        **_GEMMA_SANDWICH,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3_text": {  # its rope bases are per layer type (ember.models.hf.gemma reads them)
        **_GEMMA_SANDWICH,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    },
    "mixtral": {
        **_DECODER,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe": {
        **_DECODER,
        "vocab_size": 151936,
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "intermediate_size": 5632,
        "max_position_embeddings": 32768,
        "qkv_bias": True,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
    },
    "qwen3_moe": {
        **_DECODER,
        "vocab_size": 151936,
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_key_value_heads": 4,
        "intermediate_size": 6144,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
    },
    "mamba2": {
        "hidden_act": "silu",
        "vocab_size": 32768,
        "hidden_size": 4096,
        "num_hidden_layers": 64,
        "num_heads": 128,
        "head_dim": 64,
        "expand": 2,
        "state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
        "chunk_size": 256,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": False,
        "initializer_range": 0.1,
    },
}
"""Per ``model_type``, transformers' default of each field Ember maps (a field transformers
derives from others when it is absent, Llama's ``num_key_value_heads`` and ``head_dim``, is
left out: Ember derives it the same way)."""

ALIASES: dict[str, dict[str, str]] = {"qwen3_moe": {"num_local_experts": "num_experts"}}
"""Per ``model_type``, transformers' ``attribute_map``: a key a ``config.json`` may hold a field
under instead (Qwen3-MoE's ``save_pretrained`` writes ``num_local_experts``, the released
configs ``num_experts``); where both are there the alias wins, as transformers reads them."""


_NULLABLE = ("sliding_window", "num_key_value_heads", "attn_logit_softcapping", "final_logit_softcapping")
"""Numeric fields transformers reads null as something else: no window, as many KV heads as
heads, no soft-cap."""


def with_transformers_defaults(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``hf`` (a ``config.json`` dict of a supported ``model_type``) with every field it leaves
    out that Ember maps set to transformers' default and its :data:`ALIASES` under their field's
    name; fields it sets, even to null, are kept.
    ``ConfigError`` if a numeric field is null (other than those in ``_NULLABLE``) or not a number."""
    defaults = TRANSFORMERS_DEFAULTS.get(hf.get("model_type"), {})
    merged = {**defaults, **hf}
    for alias, key in ALIASES.get(hf.get("model_type"), {}).items():
        if alias in merged:
            merged[key] = merged.pop(alias)
    for key, default in defaults.items():
        value = merged[key]
        if _is_number(default) and not _is_number(value) and not (value is None and key in _NULLABLE):
            raise ConfigError(f"{hf['model_type']} config field {key} must be a number, got {value!r}", key=key)
    return merged


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


__all__ = ["ALIASES", "TRANSFORMERS_DEFAULTS", "with_transformers_defaults"]

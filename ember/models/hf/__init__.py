"""Hugging Face checkpoints (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, Mamba-2) <-> Ember ``(ModelConfig, params)``.

config, params = ember.models.hf.load("path/to/hf_model")
ember.models.hf.save("path/out", config, params, model_type="llama")
"""

from ember.models.hf.checkpoint import load, read_state, save
from ember.models.hf.config_map import SUPPORTED_MODEL_TYPES, config_from_hf, config_to_hf
from ember.models.hf.weights import params_from_hf, params_to_hf

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "config_from_hf",
    "config_to_hf",
    "load",
    "params_from_hf",
    "params_to_hf",
    "read_state",
    "save",
]

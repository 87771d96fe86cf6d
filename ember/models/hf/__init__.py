"""Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 text, Mixtral,
Qwen2-MoE, Qwen3-MoE, Mamba-2) <-> Ember ``(ModelConfig, params)``.

config, params = ember.models.hf.load("path/to/hf_model")   # NumPy arrays, read tensor by tensor
ember.models.hf.save("path/out", config, params, model_type="llama")
params = ember.models.hf.with_adapter(params, ember.models.hf.load_peft_adapter("path/adapter", config))
"""

from ember.models.hf.checkpoint import load, open_state, read_state, save
from ember.models.hf.config_map import SUPPORTED_MODEL_TYPES, config_from_hf, config_to_hf
from ember.models.hf.peft import load_peft_adapter, save_peft_adapter, with_adapter
from ember.models.hf.weights import params_from_hf, params_to_hf

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "config_from_hf",
    "config_to_hf",
    "load",
    "load_peft_adapter",
    "open_state",
    "params_from_hf",
    "params_to_hf",
    "read_state",
    "save",
    "save_peft_adapter",
    "with_adapter",
]

"""Flax Linen modules: layers (norm, rope, mlp, attention, CCA, linear attention), the
decoder LM, its cache, FLOPs and Hugging Face import/export (DESIGN.md section 3).

    from ember.models import DecoderLM, ModelConfig, init_cache_layers
    config = ModelConfig(vocab_size=256, d_model=64, num_layers=2)
    logits, _ = DecoderLM(config).apply({"params": params}, tokens)

Hugging Face checkpoints: ``ember.models.hf.load`` / ``ember.models.hf.save``.
"""

from ember.models.cache import init_cache_layers
from ember.models.config import ModelConfig, RopeConfig
from ember.models.decoder import DecoderLM
from ember.models.flops import flops_per_token
from ember.models.layer_layout import layers_from_list, layers_to_list

__all__ = [
    "DecoderLM",
    "ModelConfig",
    "RopeConfig",
    "flops_per_token",
    "init_cache_layers",
    "layers_from_list",
    "layers_to_list",
]

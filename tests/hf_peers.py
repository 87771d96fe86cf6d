"""Tiny random Hugging Face ``transformers`` models for the parity tests, built here from a
config (nothing is downloaded), and Ember's forward to hold against them."""

import functools
from typing import Any

import jax

from ember.models.decoder import DecoderLM


@functools.partial(jax.jit, static_argnums=0)  # one program per model: op by op a forward compiled ~40
def ember_logits(config: Any, params: Any, tokens: jax.Array) -> jax.Array:
    """``DecoderLM(config)``'s logits ``[batch, seq, vocab]`` for ``tokens [batch, seq]``."""
    return DecoderLM(config).apply({"params": params}, tokens)[0]


def random_hf_model(config: Any, *, seed: int, scale: float = 0.1) -> Any:
    """The ``transformers`` causal LM of ``config`` in eval mode, with eager attention (the
    reference forward), every weight moved away from HF's initialisation (zero biases, unit norms
    would hide mistakes): norm scales ``1 + scale * N(0, 1)``, biases ``3 * scale * N(0, 1)``,
    matrices ``scale * N(0, 1)``, drawn after ``torch.manual_seed(seed)``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param) * scale
            param.copy_(1.0 + noise if "norm" in name else noise * (3.0 if param.ndim == 1 else 1.0))
    return model


HEADS_WIDER_THAN_SPLIT = dict(
    vocab_size=89,
    hidden_size=32,
    intermediate_size=40,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
"""A tiny config's sizes whose heads are 12 wide, not ``hidden_size / num_attention_heads`` = 8
(as Qwen3's and Gemma's may be), with no special tokens."""


def saved_and_loaded(name: str, hf_config: Any, directory: Any, **overrides: Any) -> tuple:
    """``(name, hf_model, ember config, ember params)``: :func:`random_hf_model` of ``hf_config``
    (seeded by the name's length, weights at scale 0.2) saved to ``directory`` and read back by
    ``ember.models.hf.load(directory, attention_impl="xla", **overrides)``."""
    import jax.numpy as jnp

    from ember.models import hf

    model = random_hf_model(hf_config, seed=len(name), scale=0.2)
    model.save_pretrained(directory)
    config, params = hf.load(directory, attention_impl="xla", **overrides)
    return name, model, config, jax.tree.map(jnp.asarray, params)

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

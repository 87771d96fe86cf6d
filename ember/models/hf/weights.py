"""Hugging Face state-dict names <-> Ember parameter trees (Llama / Mistral / Qwen2 layout;
Mamba-2's in ``ember.models.hf.mamba2``).

HF linear weights are ``[out, in]``; Ember kernels are ``[in, ...out]`` with heads split:
``q/kernel [embed, heads, head_dim]``, ``o/kernel [heads, head_dim, embed]``. Rotary
embedding uses the same "rotate half" channel order, so no permutation is needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ember.core.errors import DataError
from ember.models.config import ModelConfig
from ember.models.decoder import layers_from_list, layers_to_list
from ember.models.hf.mamba2 import mamba2_params_from_hf, mamba2_params_to_hf


def params_from_hf(config: ModelConfig, state: Mapping[str, np.ndarray], dtype: Any = np.float32) -> dict[str, Any]:
    """Ember ``params`` from a HF state dict (``name -> array``) for ``config``.

    Raises:
      DataError (a ``ValueError``): naming the tensors that are missing or that Ember would ignore.
    """
    heads, kv_heads, head_dim, d_model = config.num_heads, config.kv_heads, config.head_size, config.d_model
    used: set[str] = set()

    def take(name: str) -> np.ndarray:
        if name not in state:
            raise DataError(f"Hugging Face checkpoint is missing tensor {name!r}")
        used.add(name)
        return np.asarray(state[name]).astype(dtype)

    if "mamba2" in config.layer_kinds:
        params = mamba2_params_from_hf(config, take)
        _check_all_used(config, state, used)
        return params
    layers = []
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        attn = {
            "q": {"kernel": take(prefix + "self_attn.q_proj.weight").T.reshape(d_model, heads, head_dim)},
            "k": {"kernel": take(prefix + "self_attn.k_proj.weight").T.reshape(d_model, kv_heads, head_dim)},
            "v": {"kernel": take(prefix + "self_attn.v_proj.weight").T.reshape(d_model, kv_heads, head_dim)},
            "o": {"kernel": take(prefix + "self_attn.o_proj.weight").T.reshape(heads, head_dim, d_model)},
        }
        if config.qkv_bias:
            attn["q"]["bias"] = take(prefix + "self_attn.q_proj.bias").reshape(heads, head_dim)
            attn["k"]["bias"] = take(prefix + "self_attn.k_proj.bias").reshape(kv_heads, head_dim)
            attn["v"]["bias"] = take(prefix + "self_attn.v_proj.bias").reshape(kv_heads, head_dim)
        layers.append(
            {
                "attn_norm": {"scale": take(prefix + "input_layernorm.weight")},
                "attn": attn,
                "mlp_norm": {"scale": take(prefix + "post_attention_layernorm.weight")},
                "mlp": {
                    "gate": take(prefix + "mlp.gate_proj.weight").T,
                    "up": take(prefix + "mlp.up_proj.weight").T,
                    "down": take(prefix + "mlp.down_proj.weight").T,
                },
            }
        )
    params: dict[str, Any] = {
        "embed": {"embedding": take("model.embed_tokens.weight")},
        "final_norm": {"scale": take("model.norm.weight")},
        **layers_from_list(config, layers),
    }
    if not config.tie_embeddings:
        params["head"] = {"kernel": take("lm_head.weight").T}
    _check_all_used(config, state, used)
    return params


def _check_all_used(config: ModelConfig, state: Mapping[str, np.ndarray], used: set[str]) -> None:
    if config.tie_embeddings and "lm_head.weight" in state:
        used.add("lm_head.weight")  # tied checkpoints may still store the (shared) head
    ignored = sorted(name for name in state if name not in used and not name.endswith("rotary_emb.inv_freq"))
    if ignored:
        raise DataError(
            f"Hugging Face checkpoint has tensors Ember does not use: {', '.join(ignored[:8])}"
            f"{' ...' if len(ignored) > 8 else ''}"
        )


def params_to_hf(config: ModelConfig, params: Mapping[str, Any], dtype: Any = None) -> dict[str, np.ndarray]:
    """The HF state dict (``name -> numpy array``) of Ember ``params``."""
    d_model = config.d_model

    def out(x) -> np.ndarray:
        x = np.asarray(x)
        return np.ascontiguousarray(x if dtype is None else x.astype(dtype))

    if "mamba2" in config.layer_kinds:
        return mamba2_params_to_hf(config, params, out)
    state = {
        "model.embed_tokens.weight": out(params["embed"]["embedding"]),
        "model.norm.weight": out(params["final_norm"]["scale"]),
    }
    if not config.tie_embeddings:
        state["lm_head.weight"] = out(np.asarray(params["head"]["kernel"]).T)
    for i, layer in enumerate(layers_to_list(config, params)):
        prefix = f"model.layers.{i}."
        attn = layer["attn"]
        state[prefix + "input_layernorm.weight"] = out(layer["attn_norm"]["scale"])
        state[prefix + "post_attention_layernorm.weight"] = out(layer["mlp_norm"]["scale"])
        for name in ("q", "k", "v"):
            state[prefix + f"self_attn.{name}_proj.weight"] = out(
                np.asarray(attn[name]["kernel"]).reshape(d_model, -1).T
            )
            if config.qkv_bias:
                state[prefix + f"self_attn.{name}_proj.bias"] = out(np.asarray(attn[name]["bias"]).reshape(-1))
        state[prefix + "self_attn.o_proj.weight"] = out(np.asarray(attn["o"]["kernel"]).reshape(-1, d_model).T)
        for name in ("gate", "up", "down"):
            state[prefix + f"mlp.{name}_proj.weight"] = out(np.asarray(layer["mlp"][name]).T)
    return state

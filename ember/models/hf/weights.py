"""Hugging Face state-dict names <-> Ember parameter trees (Llama / Mistral / Qwen2 / Qwen3
layout, plus the MoE layers of Mixtral, Qwen2-MoE and Qwen3-MoE and Gemma's norms (every scale
the weight plus one; Gemma 2 and 3 normalise each sublayer's output too,
``post_attention_layernorm`` and ``post_feedforward_layernorm``, their MLP's input by
``pre_feedforward_layernorm``); Mamba-2's in ``ember.models.hf.mamba2``).

HF linear weights are ``[out, in]``; Ember kernels are ``[in, ...out]`` with heads split:
``q/kernel [embed, heads, head_dim]``, ``o/kernel [heads, head_dim, embed]``. Rotary
embedding uses the same "rotate half" channel order, so no permutation is needed. Qwen3's
QK-norm weights ``self_attn.{q,k}_norm.weight [head_dim]`` are ``attn/{q,k}_norm/scale``
(both a plain multiplier, initialised to one).

MoE experts load from either layout: per-expert tensors (``experts.<e>.w1`` / ``gate_proj``,
what ``save_pretrained`` writes) or the fused ``experts.gate_up_proj [E, 2f, embed]`` and
``experts.down_proj [E, embed, f]`` of transformers 5's modules. They save per expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ember.core.errors import DataError
from ember.core.sharding import unbox
from ember.core.tree import param_paths
from ember.models.adapters.leaves import adapter_part
from ember.models.config import ModelConfig
from ember.models.hf.gemma import GEMMA_MODEL_TYPES, NORM_OFFSET
from ember.models.hf.mamba2 import mamba2_params_from_hf, mamba2_params_to_hf
from ember.models.layer_layout import layers_from_list, layers_to_list
from ember.models.quantization.stored import stored_weight_paths

# The MoE block's module name and its experts' (gate, up, down) names, per model type.
_MOE_NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def params_from_hf(
    config: ModelConfig, state: Mapping[str, np.ndarray], dtype: Any = np.float32, *, model_type: str = "llama"
) -> dict[str, Any]:
    """Ember ``params`` from a HF state dict (``name -> array``) for ``config``.

    Raises:
      DataError (a ``ValueError``): naming the tensors that are missing, of another shape than the
        config implies, or that Ember would ignore.
    """
    heads, kv_heads, head_dim, d_model = config.num_heads, config.kv_heads, config.head_size, config.d_model
    used: set[str] = set()

    def take(*names: str, shape: tuple[int, ...]) -> np.ndarray:
        """The first of ``names`` (alternative spellings of one tensor) the checkpoint has, which
        must have the ``shape`` the config implies."""
        for name in names:
            if name in state:
                used.add(name)
                array = np.asarray(state[name])
                if array.shape != tuple(shape):
                    raise DataError(
                        f"Hugging Face tensor {name!r} has shape {array.shape}, but config.json implies "
                        f"{tuple(shape)}: the weights are not of this config"
                    )
                return array.astype(dtype)
        raise DataError(f"Hugging Face checkpoint is missing tensor {names[0]!r}")

    if "mamba2" in config.layer_kinds:
        params = mamba2_params_from_hf(config, take)
        check_all_used(config, state, used)
        return params
    offset = NORM_OFFSET if model_type in GEMMA_MODEL_TYPES else 0.0

    def norm(name: str, width: int = d_model) -> dict[str, np.ndarray]:
        scale = take(name, shape=(width,))
        return {"scale": (scale.astype(np.float32) + offset).astype(scale.dtype) if offset else scale}

    def layer(i: int) -> dict[str, Any]:
        prefix = f"model.layers.{i}."
        attn = {}
        for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            weight = take(prefix + f"self_attn.{name}_proj.weight", shape=(n * head_dim, d_model))
            attn[name] = {"kernel": weight.T.reshape(d_model, n, head_dim)}
            if config.qkv_bias:
                bias = take(prefix + f"self_attn.{name}_proj.bias", shape=(n * head_dim,))
                attn[name]["bias"] = bias.reshape(n, head_dim)
        o = take(prefix + "self_attn.o_proj.weight", shape=(d_model, heads * head_dim))
        attn["o"] = {"kernel": o.T.reshape(heads, head_dim, d_model)}
        if config.qk_norm:
            for name in ("q_norm", "k_norm"):
                attn[name] = norm(prefix + f"self_attn.{name}.weight", head_dim)
        tree = {"attn_norm": norm(prefix + "input_layernorm.weight"), "attn": attn}
        for ours, theirs in _block_norm_names(config).items():
            tree[ours] = norm(prefix + theirs)
        if config.layer_mlps[i] == "moe":
            tree["moe"] = _moe_from_hf(take, state, prefix, config, model_type)
        else:
            tree["mlp"] = _mlp_from_hf(take, prefix + "mlp.", d_model, config.mlp_dim)
        return tree

    params: dict[str, Any] = {
        "embed": {"embedding": take("model.embed_tokens.weight", shape=(config.vocab_size, d_model))},
        "final_norm": norm("model.norm.weight"),
        **layers_from_list(config, (layer(i) for i in range(config.num_layers))),  # read one layer at a time
    }
    if not config.tie_embeddings:
        params["head"] = {"kernel": take("lm_head.weight", shape=(config.vocab_size, d_model)).T}
    check_all_used(config, state, used)
    return params


def _block_norm_names(config: ModelConfig) -> dict[str, str]:
    """A block's norms after its attention's input norm: Ember's name -> HF's."""
    if config.post_norms:
        return {
            "attn_post_norm": "post_attention_layernorm.weight",
            "mlp_norm": "pre_feedforward_layernorm.weight",
            "mlp_post_norm": "post_feedforward_layernorm.weight",
        }
    return {"mlp_norm": "post_attention_layernorm.weight"}


def check_all_used(
    config: ModelConfig, state: Mapping[str, np.ndarray], used: set[str], what: str = "Hugging Face checkpoint"
) -> None:
    """Raises ``DataError`` naming the tensors of ``state`` (``what``: the file, in the message)
    not in ``used``, which Ember would otherwise silently ignore."""
    if config.tie_embeddings and "lm_head.weight" in state:
        used.add("lm_head.weight")  # tied checkpoints may still store the (shared) head
    ignored = sorted(name for name in state if name not in used and not name.endswith("rotary_emb.inv_freq"))
    if ignored:
        raise DataError(
            f"{what} has tensors Ember does not use: {', '.join(ignored[:8])}{' ...' if len(ignored) > 8 else ''}"
        )


def _mlp_shapes(d_model: int, width: int) -> dict[str, tuple[int, int]]:
    """The HF (``[out, in]``) shapes of a gated MLP's ``gate``/``up``/``down`` weights."""
    return {"gate": (width, d_model), "up": (width, d_model), "down": (d_model, width)}


def _mlp_from_hf(take, prefix: str, d_model: int, width: int) -> dict[str, np.ndarray]:
    """A gated MLP's ``gate``/``up``/``down`` kernels from ``<prefix>{gate,up,down}_proj.weight``."""
    return {
        name: take(prefix + f"{name}_proj.weight", shape=shape).T for name, shape in _mlp_shapes(d_model, width).items()
    }


def _moe_from_hf(take, state: Mapping[str, Any], prefix: str, config: ModelConfig, model_type: str) -> dict[str, Any]:
    """One MoE layer's params (``router``, ``experts``, ``shared``, ``shared_gate``); ``state``: the
    checkpoint's tensors, to tell the fused expert layout from the per-expert one."""
    block, (gate_name, up_name, down_name) = _MOE_NAMES[model_type]
    d_model, num_experts, width = config.d_model, config.moe.num_experts, config.expert_dim
    router = take(prefix + f"{block}.gate.weight", prefix + "mlp.gate.weight", shape=(num_experts, d_model)).T
    fused = prefix + "mlp.experts.gate_up_proj", prefix + f"{block}.experts.gate_up_proj"
    if not any(name in state for name in fused):
        expert = [prefix + f"{block}.experts.{e}." for e in range(num_experts)]
        shapes = _mlp_shapes(d_model, width)
        experts = {
            key: np.stack([take(p + f"{name}.weight", shape=shapes[key]).T for p in expert])
            for key, name in (("gate", gate_name), ("up", up_name), ("down", down_name))
        }
    else:
        gate_up = take(*fused, shape=(num_experts, 2 * width, d_model))  # gate rows then up rows
        down = take(
            prefix + "mlp.experts.down_proj", prefix + f"{block}.experts.down_proj", shape=(num_experts, d_model, width)
        )
        half = gate_up.shape[1] // 2
        experts = {
            "gate": gate_up[:, :half].transpose(0, 2, 1),
            "up": gate_up[:, half:].transpose(0, 2, 1),
            "down": down.transpose(0, 2, 1),
        }
    params: dict[str, Any] = {"router": {"kernel": router}, "experts": experts}
    if config.moe.shared_experts:
        shared_width = config.moe.shared_experts * (config.moe.shared_expert_dim or width)
        params["shared"] = _mlp_from_hf(take, prefix + "mlp.shared_expert.", d_model, shared_width)
        params["shared_gate"] = take(prefix + "mlp.shared_expert_gate.weight", shape=(1, d_model)).T
    elif prefix + "mlp.shared_expert_gate.weight" in state:  # shared_expert_intermediate_size 0: adds exactly 0
        _mlp_from_hf(take, prefix + "mlp.shared_expert.", d_model, 0)
        take(prefix + "mlp.shared_expert_gate.weight", shape=(1, d_model))
    return params


def _moe_to_hf(layer: Mapping[str, Any], prefix: str, model_type: str, out) -> dict[str, np.ndarray]:
    """One MoE layer's HF tensors, experts saved one by one."""
    block, names = _MOE_NAMES[model_type]
    moe = layer["moe"]
    state = {prefix + f"{block}.gate.weight": out(np.asarray(moe["router"]["kernel"]).T)}
    for key, name in zip(("gate", "up", "down"), names):
        for e, matrix in enumerate(np.asarray(moe["experts"][key])):
            state[prefix + f"{block}.experts.{e}.{name}.weight"] = out(matrix.T)
    if "shared" in moe:
        for name in ("gate", "up", "down"):
            state[prefix + f"mlp.shared_expert.{name}_proj.weight"] = out(np.asarray(moe["shared"][name]).T)
        state[prefix + "mlp.shared_expert_gate.weight"] = out(np.asarray(moe["shared_gate"]).T)
    return state


def _check_plain_weights(params: Mapping[str, Any]) -> None:
    """Raises ``DataError`` for adapter leaves (they would be dropped) or quantized weights."""
    flat = param_paths(params)
    adapted = [path for path in flat if adapter_part(path) is not None]
    if adapted:
        raise DataError(
            f"the parameters carry adapters ({adapted[0]}, ...), which a Hugging Face checkpoint of plain weights "
            "would drop: merge them in first (ember.models.adapters.merged_weights) or save them as a PEFT adapter "
            "(ember.models.hf.save_peft_adapter)"
        )
    quantized = stored_weight_paths(flat)
    if quantized:
        raise DataError(
            f"{quantized[0]} is stored quantized; a Hugging Face checkpoint holds float weights: save the float "
            "params (ember.models.quantization.dequantize_params gives them back)"
        )


def params_to_hf(
    config: ModelConfig, params: Mapping[str, Any], dtype: Any = None, *, model_type: str = "llama"
) -> dict[str, np.ndarray]:
    """The HF state dict (``name -> numpy array``) of Ember ``params`` as a ``model_type`` model.

    ``params`` may be boxed (``nn.Partitioned`` leaves, as ``init`` returns them) or not.

    Raises:
      DataError: ``params`` carry adapters or quantized weights (a checkpoint holds plain weights).
    """
    params = unbox(params)
    _check_plain_weights(params)
    params = jax.device_get(params)  # sliced per layer on the host, not by a device op per layer and leaf
    d_model = config.d_model

    def out(x) -> np.ndarray:
        x = np.asarray(x)
        return np.ascontiguousarray(x if dtype is None else x.astype(dtype))

    if "mamba2" in config.layer_kinds:
        return mamba2_params_to_hf(config, params, out)
    offset = NORM_OFFSET if model_type in GEMMA_MODEL_TYPES else 0.0

    def norm(tree: Mapping[str, Any]) -> np.ndarray:
        scale = np.asarray(tree["scale"])
        return out((scale.astype(np.float32) - offset).astype(scale.dtype) if offset else scale)

    state = {
        "model.embed_tokens.weight": out(params["embed"]["embedding"]),
        "model.norm.weight": norm(params["final_norm"]),
    }
    if not config.tie_embeddings:
        state["lm_head.weight"] = out(np.asarray(params["head"]["kernel"]).T)
    for i, layer in enumerate(layers_to_list(config, params)):
        prefix = f"model.layers.{i}."
        attn = layer["attn"]
        state[prefix + "input_layernorm.weight"] = norm(layer["attn_norm"])
        for ours, theirs in _block_norm_names(config).items():
            state[prefix + theirs] = norm(layer[ours])
        for name in ("q", "k", "v"):
            state[prefix + f"self_attn.{name}_proj.weight"] = out(
                np.asarray(attn[name]["kernel"]).reshape(d_model, -1).T
            )
            if config.qkv_bias:
                state[prefix + f"self_attn.{name}_proj.bias"] = out(np.asarray(attn[name]["bias"]).reshape(-1))
        state[prefix + "self_attn.o_proj.weight"] = out(np.asarray(attn["o"]["kernel"]).reshape(-1, d_model).T)
        if config.qk_norm:
            for name in ("q_norm", "k_norm"):
                state[prefix + f"self_attn.{name}.weight"] = norm(attn[name])
        if "moe" in layer:
            state.update(_moe_to_hf(layer, prefix, model_type, out))
            continue
        for name in ("gate", "up", "down"):
            state[prefix + f"mlp.{name}_proj.weight"] = out(np.asarray(layer["mlp"][name]).T)
    return state

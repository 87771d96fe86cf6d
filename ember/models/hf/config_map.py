"""``ModelConfig`` <-> Hugging Face ``config.json`` for Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2,
Gemma 3 (text), Mixtral, Qwen2-MoE, Qwen3-MoE and Mamba-2 (what Gemma adds in
``ember.models.hf.gemma``, Mamba-2 in ``ember.models.hf.mamba2``).

Only fields that change the computation are mapped; a field Ember cannot honour (an
architecture, activation, rope type or bias it does not implement) raises ``ConfigError``
naming it, rather than loading a model that silently computes something else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ember.core.errors import ConfigError
from ember.models.config import ModelConfig, MoEConfig
from ember.models.hf.defaults import with_transformers_defaults
from ember.models.hf.gemma import (
    GEMMA_MODEL_TYPES,
    MULTIMODAL_GEMMA3,
    SANDWICH_MODEL_TYPES,
    check_exportable,
    gemma3_text_config,
    gemma_activation,
    gemma_fields,
    gemma_layer_kinds,
    gemma_to_hf,
)
from ember.models.hf.mamba2 import mamba2_config_from_hf, mamba2_config_to_hf
from ember.models.hf.rope_map import rope_from_hf, rope_to_hf

SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "llama", "mistral", "qwen2", "qwen3", *GEMMA_MODEL_TYPES, "mixtral", "qwen2_moe", "qwen3_moe", "mamba2",
)  # fmt: skip
MOE_MODEL_TYPES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe")
QK_NORM_MODEL_TYPES: tuple[str, ...] = ("qwen3", "qwen3_moe")
"""Types whose attention RMS-normalises each head's q and k over head_dim before rotary
embedding (``self_attn.q_norm`` / ``k_norm``, eps ``rms_norm_eps``): Ember's ``qk_norm``."""
# gelu_new and gelu_fast are the tanh approximation of GELU too, written out differently.
_ACTIVATIONS = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu_pytorch_tanh": "geglu",
    "gelu_new": "geglu",
    "gelu_fast": "geglu",
}
_HIDDEN_ACTS = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}  # what each gated MLP exports as
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_QKV_BIAS = ("qwen2", "qwen2_moe")
_QWEN3_MOE_SLIDING = (
    "qwen3_moe with use_sliding_window=true: transformers releases disagree on which layers slide (4.x those from "
    "max_window_layers on, 5.x every layer, and neither reads layer_types)"
)


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """The ``ModelConfig`` equivalent to a Hugging Face config dict (``config.json``).

    A field the dict leaves out takes transformers' default for its ``model_type``
    (:mod:`ember.models.hf.defaults`), as transformers reads it. ``overrides`` replace fields
    of the result (``precision``, ``scan_layers``, ...).
    """
    model_type = hf.get("model_type")
    if model_type == MULTIMODAL_GEMMA3:  # its language model alone
        return config_from_hf(gemma3_text_config(hf), **overrides)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"unsupported Hugging Face model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
            f"(and {MULTIMODAL_GEMMA3}'s language model)"
        )
    quantization = hf.get("quantization_config")
    if quantization:  # its weights are packed integers (GPTQ, AWQ, bitsandbytes, ...), not the float tensors read here
        method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
        raise ConfigError(
            f"unsupported {model_type} config field quantization_config (quant_method {method!r}): a quantized "
            "checkpoint; Ember reads float Hugging Face weights: load the float model and quantize it with "
            "'ember quantize' (int8, int4, nf4; rtn or gptq)"
        )
    if model_type == "mamba2":
        return mamba2_config_from_hf(hf, **overrides)
    hf = with_transformers_defaults(hf)
    activation = gemma_activation(hf, model_type) if model_type in GEMMA_MODEL_TYPES else hf["hidden_act"]
    if activation not in _ACTIVATIONS:
        raise ConfigError(
            f"unsupported hidden_act {activation!r} in {model_type} config; supported: {', '.join(_ACTIVATIONS)}"
        )
    for flag in ("mlp_bias", "attention_bias"):
        if hf.get(flag):
            raise ConfigError(
                f"unsupported {model_type} config field {flag}=true (Ember's attention/MLP have no such bias)"
            )
    num_layers = int(hf["num_hidden_layers"])
    kinds = _layer_kinds(hf, model_type, num_layers)
    num_heads = int(hf["num_attention_heads"])
    fields = dict(
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["hidden_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
        mlp_dim=int(hf["intermediate_size"]),
        mlp=_ACTIVATIONS[activation],
        norm="rmsnorm",
        norm_eps=float(hf["rms_norm_eps"]),
        rope=rope_from_hf(hf) if model_type != "gemma3_text" else None,  # gemma_fields: per layer type
        max_seq_len=int(hf["max_position_embeddings"]),
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        qkv_bias=model_type in _QKV_BIAS and bool(hf.get("qkv_bias", True)),
        qk_norm=model_type in QK_NORM_MODEL_TYPES,
        block_pattern=_shortest_period(kinds),
        sliding_window=int(hf.get("sliding_window") or 4096),
        init_std=float(hf["initializer_range"]),
    )
    if model_type in GEMMA_MODEL_TYPES:
        fields.update(gemma_fields(hf, model_type))
    if model_type in MOE_MODEL_TYPES:
        fields.update(_moe_from_hf(hf, model_type, num_layers))
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """A Hugging Face config dict for ``config`` as a ``model_type`` model."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type must be one of {', '.join(SUPPORTED_MODEL_TYPES)}; got {model_type!r}")
    if model_type == "mamba2":
        return mamba2_config_to_hf(config)
    kinds = set(config.layer_kinds)
    capped = (config.attn_soft_cap or config.final_soft_cap) and model_type not in SANDWICH_MODEL_TYPES
    if not kinds <= {"global", "local"} or config.score != "softmax" or capped:
        raise ConfigError(
            f"only softmax global/local attention without soft-caps (but in gemma2 and gemma3_text) exports to "
            f"{model_type}; this config has layer kinds {sorted(kinds)}, score={config.score!r}, "
            f"attn_soft_cap={config.attn_soft_cap}, final_soft_cap={config.final_soft_cap}"
        )
    check_exportable(config, model_type)
    if model_type not in GEMMA_MODEL_TYPES and config.qk_norm != (model_type in QK_NORM_MODEL_TYPES):
        raise ConfigError(
            f"qk_norm={config.qk_norm} cannot be expressed as {model_type}: qwen3 and qwen3_moe always have "
            "QK-norm (self_attn.q_norm / k_norm), the other model types never",
            key="qk_norm",
        )
    if config.norm != "rmsnorm" or config.mlp not in _HIDDEN_ACTS:
        raise ConfigError(
            f"{model_type} needs norm='rmsnorm' and mlp one of {', '.join(_HIDDEN_ACTS)}; "
            f"got {config.norm!r}, {config.mlp!r}"
        )
    if model_type != "qwen2_moe" and config.qkv_bias != (model_type == "qwen2"):
        raise ConfigError(
            f"qkv_bias={config.qkv_bias} cannot be expressed as {model_type} (qwen2 always has q/k/v biases, "
            "qwen2_moe has them or not, the others never)",
            key="qkv_bias",
        )
    placements = {"mixtral": {"moe"}, "qwen2_moe": {"moe", "dense"}, "qwen3_moe": {"moe", "dense"}}
    allowed = placements.get(model_type, {"dense"})
    if not set(config.layer_mlps) <= allowed or ("moe" in config.layer_mlps) != (model_type in MOE_MODEL_TYPES):
        raise ConfigError(
            f"{model_type} cannot express mlp placements {sorted(set(config.layer_mlps))}: mixtral has an moe MLP "
            "in every layer, qwen2_moe and qwen3_moe moe layers and dense ones (so moe with dense layers exports as "
            "qwen2_moe or qwen3_moe), the others dense layers only",
            key="mlp_pattern",
        )
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.mlp_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_size,
        "hidden_act": _HIDDEN_ACTS[config.mlp],
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "rope_theta": config.rope.theta,
        "rope_scaling": rope_to_hf(config.rope),
    }
    if model_type in GEMMA_MODEL_TYPES:
        hf.update(gemma_to_hf(config, model_type, kinds))
    elif model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
        if "local" in kinds:
            raise ConfigError("llama has no sliding-window layers; export as mistral or qwen2")
    elif model_type in ("mistral", "mixtral"):
        if kinds == {"global", "local"}:
            raise ConfigError("mistral applies one sliding window to every layer; a mixed pattern exports as qwen2")
        hf["sliding_window"] = config.sliding_window if "local" in kinds else None
    elif model_type == "qwen3_moe":
        if "local" in kinds:
            raise ConfigError(_QWEN3_MOE_SLIDING + "; Ember exports qwen3_moe without sliding-window layers only")
        hf.update(use_sliding_window=False, sliding_window=None, attention_bias=False)
    else:
        if model_type == "qwen3":
            hf["attention_bias"] = False
        hf["use_sliding_window"] = "local" in kinds
        hf["sliding_window"] = config.sliding_window if "local" in kinds else None
        hf["layer_types"] = ["sliding_attention" if k == "local" else "full_attention" for k in config.layer_kinds]
        hf["max_window_layers"] = _first_of_sliding_suffix(config.layer_kinds)
    if model_type in MOE_MODEL_TYPES:
        hf.update(_moe_to_hf(config, model_type))
    if hf["rope_scaling"] is None:
        del hf["rope_scaling"]
    return hf


def _first_of_sliding_suffix(kinds: Sequence[str]) -> int:
    """``max_window_layers`` for readers without ``layer_types`` (transformers 4.x), which slide
    the layers from it on: the first of the trailing local layers when no local layer comes
    before them (else the layer count, all global; such a pattern needs ``layer_types``)."""
    first = len(kinds)
    while first and kinds[first - 1] == "local":
        first -= 1
    return len(kinds) if "local" in kinds[:first] else first


def _moe_from_hf(hf: Mapping[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The MoE fields of a Mixtral (every layer sparse), Qwen2-MoE (``decoder_sparse_step``,
    ``mlp_only_layers``, a sigmoid-gated shared expert) or Qwen3-MoE (the same layout, no shared
    expert) config. ``router_aux_loss_coef`` is a training weight, not architecture: Ember's is
    ``train.aux_loss_weights.load_balance``."""
    top_k = int(hf["num_experts_per_tok"])
    if model_type == "mixtral":
        moe = MoEConfig(num_experts=int(hf["num_local_experts"]), top_k=top_k, expert_dim=int(hf["intermediate_size"]))
        return {"mlp_pattern": ("moe",), "moe": moe}
    num_experts = int(hf["num_experts"])
    step, dense_layers = int(hf["decoder_sparse_step"]), set(hf.get("mlp_only_layers") or ())
    if step < 1:  # layer i is sparse when (i + 1) % decoder_sparse_step == 0
        raise ConfigError(
            f"{model_type} config field decoder_sparse_step must be a positive integer (every n-th layer sparse), "
            f"got {step}",
            key="decoder_sparse_step",
        )
    sparse = [i not in dense_layers and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)]
    mlps = ["moe" if is_sparse else "dense" for is_sparse in sparse]
    if not any(sparse):  # num_experts 0, or every layer in mlp_only_layers: a dense model
        return {"mlp_pattern": ("dense",)}
    # Qwen3-MoE has no shared expert (transformers ignores the field there).
    shared_dim = int(hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    moe = MoEConfig(
        num_experts=max(num_experts, 1),
        top_k=top_k,
        expert_dim=int(hf["moe_intermediate_size"]),
        renormalize=bool(hf["norm_topk_prob"]),
        shared_experts=1 if shared_dim else 0,
        shared_expert_dim=shared_dim,
        shared_expert_gate=bool(shared_dim),
    )
    return {"mlp_pattern": _shortest_period(mlps), "moe": moe}


def _moe_to_hf(config: ModelConfig, model_type: str) -> dict[str, Any]:
    moe = config.moe
    if model_type == "qwen2_moe":
        shared_ok = moe.shared_experts == 1 and moe.shared_expert_gate
    else:
        shared_ok = not moe.shared_experts
    needs = {
        "mixtral": "renormalize=true and no shared experts",
        "qwen2_moe": "one gated shared expert",
        "qwen3_moe": "no shared experts",
    }[model_type]
    if (
        moe.score != "softmax"
        or moe.routed_scaling != 1.0
        or moe.capacity_factor
        or moe.total_experts != moe.num_experts
        or moe.gating_residual
        or moe.bias_balancing_rate
        or not shared_ok
        or (model_type == "mixtral" and not moe.renormalize)
    ):
        raise ConfigError(
            f"this moe config does not export to {model_type}: it needs softmax scores, routed_scaling 1, no "
            "capacity factor, no MoE++ experts or gating residual, no bias balancing, " + needs,
            key="moe",
        )
    hf: dict[str, Any] = {"num_experts_per_tok": moe.top_k, "output_router_logits": False}
    if model_type == "mixtral":
        hf.update(num_local_experts=moe.num_experts, intermediate_size=config.expert_dim, router_jitter_noise=0.0)
        return hf
    hf.update(
        num_experts=moe.num_experts,
        moe_intermediate_size=config.expert_dim,
        norm_topk_prob=moe.renormalize,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, placement in enumerate(config.layer_mlps) if placement == "dense"],
    )
    if model_type == "qwen2_moe":
        hf.update(shared_expert_intermediate_size=moe.shared_expert_dim or config.expert_dim, qkv_bias=config.qkv_bias)
    return hf


def _layer_kinds(hf: Mapping[str, Any], model_type: str, num_layers: int) -> list[str]:
    if model_type in GEMMA_MODEL_TYPES and (kinds := gemma_layer_kinds(hf, model_type, num_layers)) is not None:
        return kinds
    if model_type == "llama":
        return ["global"] * num_layers
    if model_type in ("mistral", "mixtral"):
        return ["local" if hf.get("sliding_window") else "global"] * num_layers
    if model_type == "qwen3_moe":  # transformers 5 reads no layer_types for it
        if hf.get("use_sliding_window") and hf.get("sliding_window"):
            raise ConfigError(
                _QWEN3_MOE_SLIDING + "; Ember reads qwen3_moe with use_sliding_window=false only (as released)",
                key="use_sliding_window",
            )
        return ["global"] * num_layers
    layer_types = hf.get("layer_types")
    if layer_types is None:
        sliding = bool(hf.get("use_sliding_window")) and hf.get("sliding_window")
        if sliding and model_type == "qwen2_moe":
            raise ConfigError(
                "qwen2_moe config with use_sliding_window=true but no layer_types: transformers releases disagree "
                "on which layers slide (4.x those from max_window_layers on, and in flash attention only; 5.x the "
                "even ones below max_window_layers); write the intended layer_types into config.json",
                key="layer_types",
            )
        # transformers 4.x Qwen2 (and 5.x's default): sliding window on layers from max_window_layers on.
        first_sliding = int(hf.get("max_window_layers", num_layers))
        return ["local" if sliding and i >= first_sliding else "global" for i in range(num_layers)]
    known = {"full_attention": "global", "sliding_attention": "local"}
    for layer_type in layer_types:
        if layer_type not in known:
            raise ConfigError(
                f"unsupported {model_type} layer_types entry {layer_type!r}; supported: {', '.join(known)}"
            )
    return [known[t] for t in layer_types]


def _shortest_period(kinds: list[str]) -> tuple[str, ...]:
    for period in range(1, len(kinds) + 1):
        if len(kinds) % period == 0 and kinds == kinds[:period] * (len(kinds) // period):
            return tuple(kinds[:period])
    return tuple(kinds)

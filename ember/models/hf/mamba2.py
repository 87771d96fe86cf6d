"""Hugging Face ``Mamba2ForCausalLM`` <-> Ember: the config and the state-dict names.

A Hugging Face Mamba-2 model is an Ember ``DecoderLM`` with ``block_pattern: [mamba2]`` and
``mlp_pattern: [none]``: ``backbone.layers.<i>.norm`` is the block's ``attn_norm`` and
``backbone.layers.<i>.mixer`` its ``attn`` (:class:`ember.models.layers.mamba2.Mamba2Mixer`).
The fused ``in_proj`` (rows ``z | x | B | C | dt``) is split into Ember's per-part kernels;
``conv1d.weight [conv_dim, 1, width]`` is ``conv_weight [width, conv_dim]`` transposed.

The gated norm follows ``mamba_ssm`` (per group of ``inner / n_groups`` channels), as
transformers >= 4.48 does; transformers releases before that normalised the whole inner
width in their torch path, so for ``n_groups > 1`` their logits differ from both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ember.core.errors import ConfigError
from ember.models.config import ModelConfig, SSMConfig
from ember.models.hf.defaults import with_transformers_defaults
from ember.models.layer_layout import layers_from_list, layers_to_list


def _json_float(value: Any) -> float:
    """A float of a ``config.json``: a number, or transformers' encoding of a non-finite one
    (``{"__float__": "Infinity"}``, what recent releases write for the default step-size limit)."""
    if isinstance(value, Mapping) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _json_limit(limit: tuple[float, float]) -> list[Any]:
    """``time_step_limit`` for a ``config.json``: an infinite bound as transformers writes it
    (``{"__float__": "Infinity"}``; a bare ``Infinity`` is not JSON)."""
    return [value if math.isfinite(value) else {"__float__": "Infinity"} for value in limit]


def mamba2_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face ``mamba2`` config dict, with transformers' default
    for each field it leaves out (:func:`ember.models.hf.defaults.with_transformers_defaults`)."""
    hf = with_transformers_defaults(hf)
    for flag, allowed in (("use_bias", False), ("hidden_act", "silu"), ("rms_norm", True)):
        if hf.get(flag, allowed) != allowed:
            raise ConfigError(
                f"unsupported mamba2 config field {flag}={hf[flag]!r} (Ember's Mamba-2 mixer has {flag}={allowed!r})"
            )
    d_model, expand, head_dim = int(hf["hidden_size"]), int(hf["expand"]), int(hf["head_dim"])
    if expand * d_model != int(hf["num_heads"]) * head_dim:
        raise ConfigError(
            f"mamba2 num_heads ({hf['num_heads']}) * head_dim ({head_dim}) must equal expand ({expand}) * "
            f"hidden_size ({d_model})"
        )
    chunk = int(hf["chunk_size"])
    if chunk < 8 or chunk & (chunk - 1):
        chunk = 64  # SSD's results do not depend on the chunk; Ember's kernels need a power of two
    limit = hf.get("time_step_limit") or (0.0, math.inf)
    try:
        low, high = (_json_float(value) for value in limit)
    except (TypeError, ValueError):  # null, a string, not two bounds
        raise ConfigError(
            f"mamba2 config field time_step_limit must be [low, high] (two numbers), got {limit!r}",
            key="time_step_limit",
        ) from None
    ssm = SSMConfig(
        state_size=int(hf["state_size"]),
        n_groups=int(hf["n_groups"]),
        expand=expand,
        head_dim=head_dim,
        conv_kernel=int(hf["conv_kernel"]),
        chunk_size=chunk,
        time_step_limit=(low, high),
        use_conv_bias=bool(hf["use_conv_bias"]),
    )
    fields = dict(
        vocab_size=int(hf["vocab_size"]),
        d_model=d_model,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=1,  # no attention layers: the attention fields are unused
        norm="rmsnorm",
        norm_eps=float(hf["layer_norm_epsilon"]),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        block_pattern=("mamba2",),
        mlp_pattern=("none",),
        ssm=ssm,
        init_std=float(hf["initializer_range"]),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def mamba2_config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A Hugging Face ``mamba2`` config dict for ``config`` (every layer a ``mamba2`` block without MLP, no
    ``final_soft_cap``)."""
    if set(config.layer_kinds) != {"mamba2"} or set(config.layer_mlps) != {"none"} or config.norm != "rmsnorm":
        raise ConfigError(
            "only models whose every layer is a mamba2 block without an MLP, with rmsnorm, export to mamba2; "
            f"this config has layer kinds {sorted(set(config.layer_kinds))}, MLPs {sorted(set(config.layer_mlps))}, "
            f"norm={config.norm!r}"
        )
    if config.final_soft_cap:
        raise ConfigError(
            f"final_soft_cap={config.final_soft_cap} cannot be expressed as mamba2 (its logits are not capped)",
            key="final_soft_cap",
        )
    ssm = config.ssm
    hf = {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.num_layers,
        "state_size": ssm.state_size,
        "expand": ssm.expand,
        "head_dim": ssm.head_dim,
        "num_heads": ssm.heads(config.d_model),
        "n_groups": ssm.n_groups,
        "conv_kernel": ssm.conv_kernel,
        "chunk_size": ssm.chunk_size,
        "time_step_limit": _json_limit(ssm.time_step_limit),
        "use_conv_bias": ssm.use_conv_bias,
        "use_bias": False,
        "hidden_act": "silu",
        "layer_norm_epsilon": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "residual_in_fp32": True,
    }
    if ssm.time_step_limit == (0.0, math.inf):  # transformers' default (and Ember's): nothing to write
        del hf["time_step_limit"]
    return hf


def mamba2_params_from_hf(config: ModelConfig, take: Callable[..., np.ndarray]) -> dict[str, Any]:
    """Ember ``params`` from a HF Mamba-2 state dict read through ``take(name, shape=...)``."""
    ssm, d_model = config.ssm, config.d_model
    heads, head_dim, groups, state = ssm.heads(d_model), ssm.head_dim, ssm.n_groups, ssm.state_size
    inner = heads * head_dim
    sizes = {"z": inner, "x": inner, "B": groups * state, "C": groups * state, "dt": heads}
    shapes = {"z": (heads, head_dim), "x": (heads, head_dim), "B": (groups, state), "C": (groups, state)}
    conv_dim, width = inner + 2 * groups * state, config.ssm.conv_kernel

    def layer(i: int) -> dict[str, Any]:
        prefix = f"backbone.layers.{i}."
        in_proj = take(prefix + "mixer.in_proj.weight", shape=(sum(sizes.values()), d_model)).T  # [embed, projection]
        parts = np.split(in_proj, np.cumsum(list(sizes.values()))[:-1], axis=1)
        mixer = {
            name: {"kernel": part.reshape(d_model, *shapes.get(name, (heads,)))} for name, part in zip(sizes, parts)
        }
        mixer.update(
            conv_weight=take(prefix + "mixer.conv1d.weight", shape=(conv_dim, 1, width))[:, 0, :].T,
            dt_bias=take(prefix + "mixer.dt_bias", shape=(heads,)),
            A_log=take(prefix + "mixer.A_log", shape=(heads,)),
            D=take(prefix + "mixer.D", shape=(heads,)),
            norm_scale=take(prefix + "mixer.norm.weight", shape=(inner,)).reshape(heads, head_dim),
            o={
                "kernel": take(prefix + "mixer.out_proj.weight", shape=(d_model, inner)).T.reshape(
                    heads, head_dim, d_model
                )
            },
        )
        if ssm.use_conv_bias:
            mixer["conv_bias"] = take(prefix + "mixer.conv1d.bias", shape=(conv_dim,))
        return {"attn_norm": {"scale": take(prefix + "norm.weight", shape=(d_model,))}, "attn": mixer}

    vocab = (config.vocab_size, d_model)
    params: dict[str, Any] = {
        "embed": {"embedding": take("backbone.embeddings.weight", shape=vocab)},
        "final_norm": {"scale": take("backbone.norm_f.weight", shape=(d_model,))},
        **layers_from_list(config, (layer(i) for i in range(config.num_layers))),  # read one layer at a time
    }
    if not config.tie_embeddings:
        params["head"] = {"kernel": take("lm_head.weight", shape=vocab).T}
    return params


def mamba2_params_to_hf(config: ModelConfig, params: Mapping[str, Any], out: Callable[[Any], np.ndarray]):
    """The HF Mamba-2 state dict of Ember ``params`` (``out`` converts each array)."""
    d_model = config.d_model
    state = {
        "backbone.embeddings.weight": out(params["embed"]["embedding"]),
        "backbone.norm_f.weight": out(params["final_norm"]["scale"]),
    }
    if not config.tie_embeddings:
        state["lm_head.weight"] = out(np.asarray(params["head"]["kernel"]).T)
    for i, layer in enumerate(layers_to_list(config, params)):
        prefix = f"backbone.layers.{i}."
        mixer = {name: value if isinstance(value, dict) else np.asarray(value) for name, value in layer["attn"].items()}
        in_proj = np.concatenate(
            [np.asarray(mixer[name]["kernel"]).reshape(d_model, -1) for name in ("z", "x", "B", "C", "dt")], axis=1
        )
        state[prefix + "norm.weight"] = out(layer["attn_norm"]["scale"])
        state[prefix + "mixer.in_proj.weight"] = out(in_proj.T)
        state[prefix + "mixer.conv1d.weight"] = out(mixer["conv_weight"].T[:, None, :])
        if config.ssm.use_conv_bias:
            state[prefix + "mixer.conv1d.bias"] = out(mixer["conv_bias"])
        for name in ("dt_bias", "A_log", "D"):
            state[prefix + f"mixer.{name}"] = out(mixer[name])
        state[prefix + "mixer.norm.weight"] = out(mixer["norm_scale"].reshape(-1))
        state[prefix + "mixer.out_proj.weight"] = out(np.asarray(mixer["o"]["kernel"]).reshape(-1, d_model).T)
    return state

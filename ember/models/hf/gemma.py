"""What Gemma, Gemma 2 and Gemma 3 (text) add to the Llama layout, both ways.

- Token embeddings times ``sqrt(hidden_size)`` (in their dtype): Ember's ``embed_scale``.
- RMSNorms multiply by ``1 + weight``: Ember's norm scales are the HF weights plus one (a
  plain multiplier, as every other model's), written back minus one.
- Gemma 2 and 3: "sandwich" norms, each sublayer's output normalised before the residual
  (``post_attention_layernorm``, ``post_feedforward_layernorm``: Ember's ``post_norms``; the
  MLP's input norm is ``pre_feedforward_layernorm``); attention scaled by
  ``query_pre_attn_scalar ** -0.5`` (``attn_scale``); sliding-window layers (``layer_types``,
  or every second layer in Gemma 2 and five of six in Gemma 3 where a config predates it);
  logit soft-caps (Gemma 2's 50 and 30, Gemma 3's none).
- Gemma 3: QK-norm, and its sliding layers rotate at their own unscaled base
  (``rope_local_base_freq``, or ``rope_parameters["sliding_attention"]`` in transformers 5):
  ``local_rope_theta``; the global layers' base and scaling are ``rope``.

The multimodal ``gemma3`` checkpoints (``Gemma3ForConditionalGeneration``: the 4B, 12B and 27B
releases) load as their language model alone (:func:`gemma3_text_config`,
:class:`Gemma3TextTensors`): its ``text_config`` and ``language_model.*`` tensors, the vision
tower and its projector left unread; they save as ``gemma3_text``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ember.core.errors import ConfigError
from ember.models.config import ModelConfig, RopeConfig
from ember.models.hf.rope_map import rope_from_hf, rope_to_hf

GEMMA_MODEL_TYPES: tuple[str, ...] = ("gemma", "gemma2", "gemma3_text")
MULTIMODAL_GEMMA3 = "gemma3"
"""The ``model_type`` of Gemma 3 with its vision tower: read as its ``gemma3_text`` language model."""
SANDWICH_MODEL_TYPES: tuple[str, ...] = ("gemma2", "gemma3_text")
"""Gemma types with post-sublayer norms, ``query_pre_attn_scalar``, ``layer_types`` and soft-caps."""
NORM_OFFSET = 1.0
"""Gemma's RMSNorm multiplies by ``1 + weight``: Ember's scale is the weight plus this."""

_SLIDING_PERIOD = {"gemma2": 2, "gemma3_text": 6}
"""Where a config has no ``layer_types``: layer ``i`` slides unless ``(i + 1) % period == 0``."""


def gemma_activation(hf: Mapping[str, Any], model_type: str) -> str:
    """The MLP activation's name: Gemma 2 and 3 read ``hidden_activation``, Gemma ``hidden_act``."""
    return hf["hidden_activation" if model_type in SANDWICH_MODEL_TYPES else "hidden_act"]


def gemma_layer_kinds(hf: Mapping[str, Any], model_type: str, num_layers: int) -> list[str] | None:
    """The layer kinds of a config without ``layer_types`` (None where it has them: read as
    every other type's): all global for Gemma, the sliding pattern transformers derives else."""
    if model_type == "gemma":
        return ["global"] * num_layers
    if hf.get("layer_types") is not None:
        return None
    period = int(hf.get("sliding_window_pattern") or _SLIDING_PERIOD[model_type])
    return ["local" if (i + 1) % period else "global" for i in range(num_layers)]


def gemma_fields(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields a Gemma config sets beyond the Llama ones (module docstring)."""
    fields: dict[str, Any] = {"embed_scale": math.sqrt(int(hf["hidden_size"]))}
    if model_type not in SANDWICH_MODEL_TYPES:
        return fields
    fields.update(
        post_norms=True,
        attn_scale=float(hf["query_pre_attn_scalar"]) ** -0.5,
        attn_soft_cap=float(hf.get("attn_logit_softcapping") or 0.0),
        final_soft_cap=float(hf.get("final_logit_softcapping") or 0.0),
    )
    if model_type == "gemma3_text":
        fields.update(qk_norm=True, **_gemma3_rope(hf))
    return fields


def _gemma3_rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``rope`` (the global layers') and ``local_rope_theta`` of a Gemma 3 config, from
    transformers 5's per-layer-type ``rope_parameters`` or 4.x's ``rope_theta``,
    ``rope_scaling`` and ``rope_local_base_freq``."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        rope = rope_from_hf({"rope_parameters": params.get("full_attention") or {}, "rope_theta": 1e6})
        local = rope_from_hf({"rope_parameters": params.get("sliding_attention") or {}, "rope_theta": 1e4})
    else:
        rope = rope_from_hf({**hf, "rope_theta": hf.get("rope_theta", 1e6)})
        local = RopeConfig(theta=float(hf.get("rope_local_base_freq", 1e4)))
    if local.scaling != "none":
        raise ConfigError(
            f"gemma3_text sliding_attention rope scaling {local.scaling!r}: Ember's local layers rotate unscaled "
            "(local_rope_theta)",
            key="rope_parameters",
        )
    return {"rope": rope, "local_rope_theta": local.theta}


def gemma3_text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The ``gemma3_text`` config dict of a multimodal ``gemma3`` one: its ``text_config`` (whose
    embeddings are tied as the whole model's are)."""
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError("gemma3 config has no text_config object (the language model's config)", key="text_config")
    tied = {"tie_word_embeddings": hf["tie_word_embeddings"]} if "tie_word_embeddings" in hf else {}
    return {**tied, **text, "model_type": "gemma3_text"}


class Gemma3TextTensors(Mapping[str, np.ndarray]):
    """A multimodal ``gemma3`` checkpoint's tensors as its language model's alone, under the
    names ``Gemma3ForCausalLM`` gives them (``language_model.model.*`` -> ``model.*``,
    ``language_model.lm_head.weight`` -> ``lm_head.weight``); the others are not listed."""

    _PREFIX = "language_model."

    def __init__(self, state: Mapping[str, np.ndarray]):
        self._state = state

    def __getitem__(self, name: str) -> np.ndarray:
        return self._state[self._PREFIX + name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._PREFIX + name in self._state

    def __iter__(self) -> Iterator[str]:
        return (name.removeprefix(self._PREFIX) for name in self._state if name.startswith(self._PREFIX))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def check_exportable(config: ModelConfig, model_type: str) -> None:
    """Raises ``ConfigError`` where ``config`` is not a ``model_type`` model (any of its fields
    Gemma fixes set otherwise), or, for the other types, where it uses a Gemma field."""
    gemma, sandwich = model_type in GEMMA_MODEL_TYPES, model_type in SANDWICH_MODEL_TYPES
    problems = []
    if gemma and config.mlp != "geglu":
        problems.append(f"mlp={config.mlp!r} (gemma types' MLP is geglu: gelu_pytorch_tanh)")
    if gemma and not math.isclose(config.embed_scale, math.sqrt(config.d_model), rel_tol=1e-6):
        problems.append(f"embed_scale={config.embed_scale} (gemma types scale by sqrt(d_model))")
    if not gemma and config.embed_scale != 1.0:
        problems.append(f"embed_scale={config.embed_scale} (only gemma types scale their embeddings)")
    if config.post_norms != sandwich:
        problems.append(f"post_norms={config.post_norms} (gemma2 and gemma3_text have them, the others not)")
    if config.attn_scale and not sandwich and not math.isclose(config.attn_scale, config.head_size**-0.5):
        problems.append(f"attn_scale={config.attn_scale} (only gemma2 and gemma3_text set query_pre_attn_scalar)")
    if config.local_rope_theta and model_type != "gemma3_text":
        problems.append(f"local_rope_theta={config.local_rope_theta} (only gemma3_text rotates local layers apart)")
    if problems:
        raise ConfigError(f"this config does not export to {model_type}: " + "; ".join(problems))


def gemma_to_hf(config: ModelConfig, model_type: str, kinds: set[str]) -> dict[str, Any]:
    """The Gemma fields of the ``config.json`` of ``config`` as a ``model_type`` model."""
    if model_type == "gemma":
        if kinds != {"global"} or config.attn_soft_cap or config.final_soft_cap or config.qk_norm:
            raise ConfigError("gemma has global layers only, no soft-caps and no qk_norm (gemma2/gemma3_text may)")
        return {"attention_bias": False}
    if config.qk_norm != (model_type == "gemma3_text"):
        raise ConfigError(f"qk_norm={config.qk_norm}: gemma3_text always has QK-norm, gemma2 never", key="qk_norm")
    scalar = (config.attn_scale or config.head_size**-0.5) ** -2
    hf: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "query_pre_attn_scalar": round(scalar) if math.isclose(scalar, round(scalar)) else scalar,
        "attn_logit_softcapping": config.attn_soft_cap or None,
        "final_logit_softcapping": config.final_soft_cap or None,
        "sliding_window": config.sliding_window,
        "layer_types": ["sliding_attention" if k == "local" else "full_attention" for k in config.layer_kinds],
    }
    if model_type == "gemma3_text":
        hf["rope_local_base_freq"] = config.local_rope_theta or config.rope.theta
        hf["rope_scaling"] = rope_to_hf(config.rope)
    return hf


__all__ = [
    "GEMMA_MODEL_TYPES",
    "MULTIMODAL_GEMMA3",
    "NORM_OFFSET",
    "SANDWICH_MODEL_TYPES",
    "Gemma3TextTensors",
    "check_exportable",
    "gemma3_text_config",
    "gemma_activation",
    "gemma_fields",
    "gemma_layer_kinds",
    "gemma_to_hf",
]

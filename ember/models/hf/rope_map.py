"""Rotary embedding settings <-> Hugging Face config fields: ``rope_theta`` with ``rope_scaling``
(transformers 4.x) or ``rope_parameters`` (transformers 5, the base inside)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ember.core.errors import ConfigError
from ember.models.config import RopeConfig


def rope_from_hf(hf: Mapping[str, Any]) -> RopeConfig:
    """The rotary embedding of config dict ``hf`` (its ``rope_theta`` a fallback for the base)."""
    # transformers 5 writes "rope_parameters" (theta inside); 4.x writes "rope_theta" + "rope_scaling".
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf["rope_theta"]))
    rope_type = params.get("rope_type", params.get("type", "default"))

    def need(field: str) -> float:
        if params.get(field) is None:
            raise ConfigError(f"{rope_type} rope scaling needs {field!r} (rope_scaling / rope_parameters)", key=field)
        return float(params[field])

    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, scaling="linear", factor=need("factor"))
    if rope_type == "llama3":
        return RopeConfig(
            theta=theta,
            scaling="llama3",
            factor=need("factor"),
            low_freq_factor=need("low_freq_factor"),
            high_freq_factor=need("high_freq_factor"),
            original_max_len=int(need("original_max_position_embeddings")),
        )
    raise ConfigError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3")


def rope_to_hf(rope: RopeConfig) -> dict[str, Any] | None:
    """``rope_scaling`` for ``rope`` (None: unscaled)."""
    if rope.scaling == "none":
        return None
    if rope.scaling == "linear":
        return {"rope_type": "linear", "factor": rope.factor}
    return {
        "rope_type": "llama3",
        "factor": rope.factor,
        "low_freq_factor": rope.low_freq_factor,
        "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_max_len,
    }


__all__ = ["rope_from_hf", "rope_to_hf"]

"""A model's variables: its parameters and the state some models carry beside them.

Some models keep non-gradient variables that their forward pass updates (the MoE layer's
load-balancing bias in collection ``"balance"``, BatchNorm-style statistics). Every Linen
collection ``init`` returns except the ones below is such **model state**: the trainer
keeps it in its train state (never optimized), checkpoints it, and serving applies it with
the parameters.

    params, model_state = split_variables(model.init(rng, x))
    weights = serving_weights(params, model_state)    # what serving carries as "params"
    model.apply(as_variables(weights), x)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

NOT_STATE = ("params", "losses", "metrics", "intermediates", "calibration")
"""Collections that are not model state: the parameters and what a pass sows (aux losses,
metrics, captured intermediates, GPTQ's calibration statistics), which is recomputed on every pass."""


def split_variables(variables: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(params, model state)`` of the variables ``init`` returned (state: ``{}`` if none)."""
    return variables["params"], {name: value for name, value in variables.items() if name not in NOT_STATE}


def serving_weights(params: Any, model_state: Mapping[str, Any] | None) -> Any:
    """What serving carries as a model's weights: ``params`` alone for a model without state
    (the common case), else ``{"params": params, **model_state}``."""
    return {"params": params, **model_state} if model_state else params


def as_variables(weights: Any) -> dict[str, Any]:
    """The ``apply`` variables of :func:`serving_weights` output (a param tree, whose
    top-level names are modules, or a variables dict with a ``"params"`` collection)."""
    return dict(weights) if isinstance(weights, Mapping) and "params" in weights else {"params": weights}


__all__ = ["NOT_STATE", "as_variables", "serving_weights", "split_variables"]

"""The pretrained model a fine-tuning or GRPO run starts from: loaded once, its weights given
the logical axes of the model's own ``init`` so they shard as a fresh model would."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from ember.core.config import run_kind
from ember.core.errors import ConfigError
from ember.core.sharding import box_like
from ember.core.tree import param_paths
from ember.models.adapters import adapter_leaves, merged_weights
from ember.models.decoder import DecoderLM
from ember.models.layer_layout import convert_layer_layout, saved_layout
from ember.models.quantization.stored import stored_weight_paths
from ember.models.variables import as_variables, serving_weights, split_variables
from ember.serving.loading import LoadedModel, load_model
from ember.training.finetune.config import BaseModelConfig

T = TypeVar("T")
MERGED_ON_LOAD: tuple[str, ...] = ("linearize", "grpo")
"""Run kinds whose LoRA adapters a base loaded from them has folded into its weights: they write
no merged export (a fine-tuning run does: ``export.merged``, and is refused as a base)."""


def load_base(config: BaseModelConfig) -> LoadedModel:
    """The model ``config.path`` names (its tokenizer required: runs read text), its weights as
    host (NumPy) arrays, read without a device (trainers place them on their mesh, where no one
    device need hold the model). A linearising or GRPO run's LoRA adapters are merged into its
    weights.

    Raises:
      ConfigError: the model has no tokenizer, its weights are stored quantized, or it carries
        adapters (a LoRA fine-tuning run: its weights are not a base model's); keyed
        ``base_model.path``; see ``load_model``.
    """
    step = None if config.step < 0 else config.step
    try:
        base = load_model(config.path, step=step, host=True, **config.overrides())
    except ConfigError as error:  # load_model keys its own argument "step": here it is base_model.step
        if error.key != "step":
            raise
        raise ConfigError(str(error), key="base_model.step") from None
    if base.tokenizer is None:
        raise ConfigError(f"base model {config.path} has no tokenizer (tokenizer.json)", key="base_model.path")
    quantized = stored_weight_paths(param_paths(base.params))
    if quantized:  # the runs train float weights (QLoRA quantizes its float base itself)
        raise ConfigError(
            f"base model {config.path} stores its weights quantized ({quantized[0]} and {len(quantized) - 1} more: "
            "an 'ember quantize' output or a QLoRA run); train from the float model instead (for QLoRA, with "
            "base_model.quantize)",
            key="base_model.path",
        )
    params, model_state = split_variables(as_variables(base.params))
    if adapter_leaves(params):
        if run_kind(config.path) in MERGED_ON_LOAD:  # no merged export to start from: folded in here
            base = dataclasses.replace(base, params=serving_weights(merged_weights(params), model_state))
            return dataclasses.replace(base, params=jax.device_get(base.params))
        raise ConfigError(
            f"base_model.path {config.path} is a fine-tuning run with adapters, not a base model: fine-tune its "
            "merged export (a run with export.merged true writes it to run_dir/merged) instead",
            key="base_model.path",
        )
    return base


def boxed_variables(model: DecoderLM, seq_len: int, pretrained: dict[str, Any]) -> dict[str, Any]:
    """``{"params": ..., <state>: ...}`` of ``pretrained`` (``{"params", "state"}``) in the
    logical-partitioning boxes ``model.init`` gives at ``[1, seq_len]``."""
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    positions = jnp.arange(seq_len, dtype=jnp.int32)[None]
    abstract = jax.eval_shape(lambda key: model.init(key, tokens, positions=positions), jax.random.key(0))
    state = {name: box_like(value, abstract[name]) for name, value in pretrained["state"].items()}
    return {"params": box_like(pretrained["params"], abstract["params"]), **state}


def restore_base_layout(
    base: LoadedModel, saved_params: Any, task_over: Callable[[LoadedModel], T]
) -> tuple[T, Callable[[Any], Any]] | None:
    """``Task.restore_layout`` of a task over a loaded ``base``: ``None`` when a checkpoint whose
    params look like ``saved_params`` (metadata) has ``base.config.scan_layers``'s layout;
    otherwise ``(task_over(base in the saved layout), convert)``, ``convert`` mapping a
    train-state tree (optimizer moments included) from the saved layout to ``base``'s.
    ``base_model.scan_layers`` is a runtime setting, so a resume may change it."""
    layout = saved_layout(base.config, saved_params)
    if layout is None:
        return None
    saved_model, convert = layout
    saved_weights = convert_layer_layout(base.params, base.config, saved_model)
    return task_over(dataclasses.replace(base, config=saved_model, params=saved_weights)), convert


__all__ = ["boxed_variables", "load_base", "restore_base_layout"]

"""A softmax decoder turned into its linearised form (LoLCATs): the config and the weights.

    config = linearized_config(teacher_config, LinearizeConfig(window=16, feature_dim=4))
    params = linearized_params(teacher_params, DecoderLM(config).init(...)["params"])

Every softmax-family layer (``global``, ``local``, ``block_sparse``) becomes a
``window_linear`` layer with the same projections; other layers (SSM, linear, CCA) stay as
they are. The new parameters (Hedgehog feature maps, identity-initialised, and the window mix)
come from the linearised model's own ``init``; everything the teacher has is the teacher's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ember.core.errors import ConfigError
from ember.core.sharding import box_like, unbox
from ember.core.tree import param_paths, tree_from_paths
from ember.models.config import SOFTMAX_FAMILY, ModelConfig

NEW_PARAMETERS: tuple[str, ...] = ("q_features", "k_features", "window_factor")
"""Path elements of the parameters a linearised layer adds (what attention transfer trains)."""


@dataclasses.dataclass(frozen=True)
class LinearizeConfig:
    """The linearised layers: exact softmax attention over the last ``window`` tokens, Hedgehog
    feature maps of ``feature_dim`` projections (``2 * feature_dim`` features; 0: ``head_dim``)
    for every earlier token."""

    window: int = 64
    feature_dim: int = 0

    def __post_init__(self):
        if self.window < 1:
            raise ConfigError(
                f"linear.window must be a positive number of tokens, got {self.window}", key="linear.window"
            )
        if self.feature_dim < 0:
            raise ConfigError(
                f"linear.feature_dim must be >= 0 (0 = head_dim), got {self.feature_dim}", key="linear.feature_dim"
            )


def linearized_config(config: ModelConfig, linear: LinearizeConfig, *, attention_transfer: bool = False) -> ModelConfig:
    """``config`` with its softmax-family layers replaced by ``window_linear`` ones;
    ``attention_transfer``: in that mode (stage 1), each layer's target the attention it
    replaced (``config``'s kind and ``sliding_window``).

    Raises:
      ConfigError: the model has no softmax attention layer, scores that are not softmax, or
        ``linear`` layers whose feature maps are not Hedgehog maps of ``linear.feature_dim``
        (the two kinds share the config's feature map).
    """
    if not set(config.block_pattern) & set(SOFTMAX_FAMILY):
        raise ConfigError(
            f"only softmax attention layers ({', '.join(SOFTMAX_FAMILY)}) are linearised; the model's "
            f"block_pattern is {list(config.block_pattern)}",
            key="base_model.path",
        )
    if config.score != "softmax":
        raise ConfigError(f"a model with {config.score} attention scores cannot be linearised", key="base_model.path")
    # linear and window_linear layers read one linear_feature_map / linear_feature_dim: set to
    # Hedgehog's below, they would change the model's own linear layers (not "stay as they are").
    shared = (config.linear_feature_map, config.linear_feature_dim)
    if "linear" in config.block_pattern and shared != ("hedgehog", linear.feature_dim):
        raise ConfigError(
            f"the model's linear layers use the {config.linear_feature_map} feature map (linear_feature_dim "
            f"{config.linear_feature_dim}), which the window_linear layers would share as hedgehog with "
            f"linear.feature_dim {linear.feature_dim}: a model with linear layers is linearised only when they "
            "use hedgehog maps, with linear.feature_dim set to their linear_feature_dim",
            key="linear.feature_dim",
        )
    pattern = tuple("window_linear" if kind in SOFTMAX_FAMILY else kind for kind in config.block_pattern)
    return dataclasses.replace(
        config,
        block_pattern=pattern,
        sliding_window=linear.window,
        linear_feature_map="hedgehog",
        linear_feature_dim=linear.feature_dim,
        attention_transfer=attention_transfer,
        transfer_pattern=config.block_pattern if attention_transfer else (),
        transfer_window=config.sliding_window if attention_transfer else 0,
    )


def linearized_params(teacher: Any, fresh: Any) -> Any:
    """``fresh`` (the linearised model's init, boxed or not) with every leaf the teacher has
    replaced by the teacher's (boxed like ``fresh``).

    Raises:
      ValueError: a teacher weight the linearised model lacks, or one whose shape differs.
    """
    teacher_paths, fresh_paths = param_paths(unbox(teacher)), param_paths(unbox(fresh))
    missing = sorted(set(teacher_paths) - set(fresh_paths))
    if missing:
        raise ValueError(f"the linearised model has no parameter for the teacher's {', '.join(missing[:4])}")
    for path, weight in teacher_paths.items():
        if weight.shape != fresh_paths[path].shape:
            raise ValueError(f"{path}: the teacher's {weight.shape} against the linearised {fresh_paths[path].shape}")
    return box_like(tree_from_paths({**fresh_paths, **teacher_paths}), fresh)


def is_new_parameter(path: str) -> bool:
    """Whether ``path`` (``/``-joined) is a parameter linearising adds (:data:`NEW_PARAMETERS`)."""
    return any(name in path.split("/") for name in NEW_PARAMETERS)


__all__ = ["NEW_PARAMETERS", "LinearizeConfig", "is_new_parameter", "linearized_config", "linearized_params"]

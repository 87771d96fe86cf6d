"""MixLoRA (Li et al. 2024): LoRA experts in every dense MLP, behind a top-k router.

    params = add_mixlora(params, MixLoraConfig(num_experts=8, top_k=2, rank=8), rng)
    mask = adapter_mask(params)     # trains the routers and the expert adapters

Each dense ``mlp`` gets a router ``mixlora_router_top<k> [embed, E]`` and, on every target
matrix (``gate``, ``up``, ``down``), ``E`` stacked LoRA experts ``<w>_lora_a [E, in, rank]``
(Kaiming-uniform, as LoRA's ``A``), ``<w>_lora_b [E, rank, out]`` (zero) and
``<w>_lora_scale``; scanned layers carry a leading ``[layers]`` axis and boxed trees the
logical axes of their weights. The layer is ``ember.models.layers.mixlora_mlp``; the
decoder sows the router's load-balancing loss (``load_balance``, weighted by
``train.aux_loss_weights``) and ``router_z`` with ``expert_load`` metrics as for MoE layers.
Attention projections can take plain LoRA beside it (``add_lora``), as the paper does.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.errors import ConfigError
from ember.core.tree import param_paths, tree_from_paths
from ember.models.adapters.layout import leaf_value, weight_layout
from ember.models.adapters.lowrank import part_name

MLP_WEIGHTS = ("gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class MixLoraConfig:
    """``num_experts`` LoRA experts of ``rank`` (scale ``alpha / rank``, ``alpha /
    sqrt(rank)`` with ``rslora``) on the MLP matrices ``targets``, ``top_k`` per token."""

    num_experts: int = 8
    top_k: int = 2
    rank: int = 8
    alpha: float = 16.0
    rslora: bool = False
    targets: tuple[str, ...] = MLP_WEIGHTS
    router_init_std: float = 0.02

    def __post_init__(self):
        def fail(field, message):
            raise ConfigError(f"mixlora.{field} {message}", key=f"mixlora.{field}")

        if self.num_experts < 2:
            fail("num_experts", f"must be at least 2, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            fail("top_k", f"must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        for field in ("rank", "alpha", "router_init_std"):
            if getattr(self, field) <= 0:
                fail(field, f"must be positive, got {getattr(self, field)}")
        if not self.targets or any(t not in MLP_WEIGHTS for t in self.targets):
            fail("targets", f"must name MLP matrices among {', '.join(MLP_WEIGHTS)}, got {list(self.targets)}")

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.rslora else self.alpha / self.rank


def add_mixlora(params: Mapping[str, Any], config: MixLoraConfig, rng: jax.Array) -> dict[str, Any]:
    """``params`` with MixLoRA experts in every dense MLP (see the module docstring).

    Raises:
      ConfigError: the model has no dense MLP, has MoE layers, already has MixLoRA, or a target
        matrix already has an adapter.
    """
    flat = param_paths(params)
    if any("/moe/" in f"/{p}" for p in flat):
        raise ConfigError("MixLoRA adds experts to dense MLPs; this model has MoE layers already", key="mixlora")
    mlps = sorted({p.rsplit("/", 1)[0] for p in flat if re.search(r"(^|/)mlp/up$", p)})
    if not mlps:
        raise ConfigError("MixLoRA needs dense MLPs (mlp_pattern 'dense'); this model has none", key="mixlora")
    updates = {}
    for index, mlp in enumerate(mlps):
        if any(p.startswith(f"{mlp}/mixlora_router") for p in flat):
            raise ConfigError(f"{mlp} already has MixLoRA experts", key="mixlora")
        adapted = [f"{mlp}/{name}" for name in config.targets if part_name(f"{mlp}/{name}", "lora_a") in flat]
        if adapted:  # its experts' leaves would overwrite that adapter's A, B and scale
            raise ConfigError(
                f"{adapted[0]} already has an adapter; MixLoRA's experts go on MLP matrices without one "
                "(leave it out of mixlora.targets, or put the plain LoRA on other weights)",
                key="mixlora.targets",
            )
        key = jax.random.fold_in(rng, index)
        updates.update(_router(mlp, flat[f"{mlp}/up"], config, key))
        for j, name in enumerate(config.targets):
            if f"{mlp}/{name}" in flat:
                updates.update(_experts(f"{mlp}/{name}", flat[f"{mlp}/{name}"], config, jax.random.fold_in(key, j + 1)))
    return tree_from_paths({**flat, **updates})


def _router(mlp: str, up: Any, config: MixLoraConfig, rng: jax.Array) -> dict[str, Any]:
    layout = weight_layout(f"{mlp}/up", up)
    lead, (embed,), _ = layout.split(leaf_value(up).shape)
    value = config.router_init_std * jax.random.normal(rng, (*lead, embed, config.num_experts), jnp.float32)
    name = f"{mlp}/mixlora_router_top{config.top_k}"
    if layout.names is None:
        return {name: value.astype(leaf_value(up).dtype)}
    return {name: nn.Partitioned(value.astype(leaf_value(up).dtype), (*layout.names[: layout.lead], "embed", None))}


def _experts(path: str, leaf: Any, config: MixLoraConfig, rng: jax.Array) -> dict[str, Any]:
    layout = weight_layout(path, leaf)
    kernel = leaf_value(leaf)
    lead, in_shape, out_shape = layout.split(kernel.shape)
    experts, rank = config.num_experts, config.rank
    bound = 1.0 / math.sqrt(math.prod(in_shape))
    values = {
        "lora_a": jax.random.uniform(rng, (*lead, experts, *in_shape, rank), jnp.float32, -bound, bound),
        "lora_b": jnp.zeros((*lead, experts, rank, *out_shape), jnp.float32),
        "lora_scale": jnp.full(lead, config.scale, jnp.float32),
    }
    result = {}
    for part, value in values.items():
        value = value if part == "lora_scale" else value.astype(kernel.dtype)
        if layout.names is None:
            result[part_name(path, part)] = value
            continue
        names = layout.names
        head, ins, outs = (
            names[: layout.lead],
            names[layout.lead : layout.lead + layout.in_dims],
            names[-layout.out_dims :],
        )
        axes = {"lora_a": (*head, None, *ins, None), "lora_b": (*head, None, None, *outs), "lora_scale": head}[part]
        result[part_name(path, part)] = nn.Partitioned(value, axes)
    return result


__all__ = ["MixLoraConfig", "add_mixlora"]

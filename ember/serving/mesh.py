"""Serving one model split over the devices of a mesh: tensor-parallel, and its experts expert-parallel.

    mesh = serving_mesh(MeshConfig(data=1, tensor=4))       # over the first 4 devices
    mesh = serving_mesh(MeshConfig(data=1, expert=2, tensor=2))  # an MoE model over 4
    loaded = load_model("runs/tiny", mesh=mesh)             # read straight into the shards
    engine = Engine.from_model(loaded.config, loaded.params, mesh=mesh)

The step is compiled with explicit shardings (``ember.serving.model_program.step_placement``):
the weights are placed by their logical axes under the default rules (``ember.core.sharding``:
heads, key heads, MLP columns and vocabulary split over ``tensor``, routed experts over
``expert``; a quantized weight's codes and scales as the float weight they store), the cache by
its entries' (``ember.models.cache.layer_state_axes``: the pages over their key heads), and the
step's inputs (the token budget, the sampling settings) and outputs are replicated. A mesh axis
that does not divide a dimension leaves it whole, as everywhere in Ember (four devices and two
key heads: every device holds both key heads' pages).

Only the model is split: one step is one flat token budget, with no batch dimension to split
over ``data`` or ``fsdp``, so the step runs under :data:`SERVING_RULES` (the batch whole). Over
``expert`` the tokens are therefore not exchanged: every device holds the step's tokens, runs its
own experts on the slots routed to them and the partial outputs are summed with the tensor
axis's (``ember.models.layers.moe_dispatch.routed_expert_mlp_per_shard``), one all-reduce per MoE
layer; the rest of the model is replicated over ``expert`` (attention is split by ``tensor``
only). Every mesh axis but :data:`SPLIT_AXES` must have size 1, except ``data`` for
:func:`replica_meshes`: ``data`` replicas of the engine, each on ``tensor x expert`` devices of
its own, serving one batch together (``ember.serving.replicas``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from ember.core.errors import ConfigError
from ember.core.sharding import MeshConfig, logical_rules, make_mesh

SPLIT_AXES: tuple[str, ...] = ("tensor", "expert")
"""The mesh axes a served model may be split over."""

REPLICA_AXIS = "data"
"""The mesh axis whose size is the number of replicas of one engine (``ember.serving.replicas``)."""

SERVING_RULES = logical_rules({"batch": ()})
"""The logical rules a step runs under: the defaults, with the batch (one step's flat token
budget) whole on every device."""


@dataclasses.dataclass(frozen=True)
class StepPlacement:
    """Where a step's arguments and results live on a mesh: ``params`` and ``kv`` are trees of
    ``NamedSharding``s (the weights', the cache's), ``replicated`` the batch's, the settings'
    and the sampled tokens'."""

    params: Any
    kv: Any
    replicated: NamedSharding

    @property
    def in_shardings(self) -> tuple[Any, ...]:
        return self.params, self.kv, self.replicated, self.replicated

    @property
    def out_shardings(self) -> tuple[Any, ...]:
        return self.kv, self.replicated, self.replicated


def check_serving_mesh(sizes: Mapping[str, int], *, replicas: bool = False) -> None:
    """Raises ``ConfigError`` (keyed ``mesh.<axis>``) for a mesh axis other than :data:`SPLIT_AXES`
    (and, with ``replicas``, :data:`REPLICA_AXIS`) whose size (``mesh.shape``, or
    ``MeshConfig.sizes()``) is not 1."""
    for axis, size in sizes.items():
        if size == 1 or axis in SPLIT_AXES or (replicas and axis == REPLICA_AXIS):
            continue
        if axis == REPLICA_AXIS:
            raise ConfigError(
                f"mesh.{axis}={size}: one engine splits only the model, over mesh.tensor and mesh.expert; replicas "
                f"of it over mesh.{axis} are served by ember.serving.replicas (ember generate --mesh {axis}=N)",
                key=f"mesh.{axis}",
            )
        raise ConfigError(
            f"mesh.{axis}={size}: serving splits only the model, over mesh.tensor and mesh.expert (one "
            f"step's flat token budget has no batch to split over mesh.{axis}); give mesh.{axis}=1",
            key=f"mesh.{axis}",
        )


def serving_mesh(config: MeshConfig) -> Mesh:
    """The mesh of ``config`` (checked by :func:`check_serving_mesh`) over the first devices
    it needs (``tensor=-1`` or ``expert=-1``: all of them)."""
    sizes = _checked_sizes(config, replicas=False)
    return make_mesh(config, jax.devices()[: sizes["tensor"] * sizes["expert"]])


def replica_meshes(config: MeshConfig) -> list[Mesh]:
    """The meshes of ``config.data`` replicas of one engine (checked by :func:`check_serving_mesh`
    with ``replicas``), each over ``tensor x expert`` devices of its own, in device order
    (``data=-1``: as many as the devices hold).

    Raises:
      ConfigError: keyed ``mesh.data``, the replicas need more devices than there are.
    """
    sizes, devices = _checked_sizes(config, replicas=True), jax.devices()
    each = sizes["tensor"] * sizes["expert"]
    if sizes[REPLICA_AXIS] * each > len(devices):
        raise ConfigError(
            f"mesh.{REPLICA_AXIS}={sizes[REPLICA_AXIS]} replicas of {each} device(s) each need "
            f"{sizes[REPLICA_AXIS] * each} devices; there are {len(devices)}",
            key=f"mesh.{REPLICA_AXIS}",
        )
    one = dataclasses.replace(config, **{REPLICA_AXIS: 1})
    return [make_mesh(one, devices[i * each : (i + 1) * each]) for i in range(sizes[REPLICA_AXIS])]


def _checked_sizes(config: MeshConfig, *, replicas: bool) -> dict[str, int]:
    """``config``'s axis sizes, checked by :func:`check_serving_mesh` (``replicas`` as there), a
    ``-1`` resolved over every device."""
    sizes = config.sizes()
    check_serving_mesh(sizes, replicas=replicas)
    return config.resolve(len(jax.devices())) if -1 in sizes.values() else sizes


__all__ = [
    "REPLICA_AXIS",
    "SERVING_RULES",
    "SPLIT_AXES",
    "StepPlacement",
    "check_serving_mesh",
    "replica_meshes",
    "serving_mesh",
]

"""Where GRPO's rollout engine runs when the policy trains tensor- or expert-parallel.

    mesh = rollout_mesh(trainer.mesh, config)  # None: the trainer's mesh.tensor (and mesh.expert) is 1
    weights = jax.tree.map(lambda x: held_on(x, mesh), trained)       # the trainer's own buffers
    engine.update_params(weights)                                     # copied into the engine's shards
    meshes = rollout_meshes(trainer.mesh, config, replicas=-1)        # one engine per block (grpo.engine_replicas)

The engine is split over the axes serving splits a model over (``ember.serving.mesh``:
``tensor``, and ``expert`` for a model with MoE layers). Where they have more than one device,
it runs on the block of the training mesh spanning them that holds this process's first device
of the mesh (index 0 of every other axis in a one-process run: the tensor row, or the tensor x
expert block), as a mesh of its own whose other axes have size 1. Why that block: the engine
splits its weights by the same logical rules as the trainer (heads, key heads, MLP columns and
vocabulary over ``tensor``, routed experts over ``expert``), so under the default rules every
weight the trainer splits only over those axes already has the engine's shards on these devices:
syncing copies each shard on its own device, with no transfer between devices and no gather onto
one device or the host (:func:`held_on`). A weight the trainer also splits over another axis
(``fsdp``) is gathered over it, device to device in one process (a ``device_put`` into the
engine's shardings), through the host where that axis spans processes
(``ember.core.sharding.addressable_here``). Each process of a multi-process run samples its share
on its own block; a block across processes is refused (the trainer refuses a tensor axis across
processes first: ``ember.training.mesh_checks.check_process_rows``).

With ``grpo.engine_replicas`` > 1 (-1: all) a process samples each rollout on several engines at
once (``ember.serving.replicas``), one per block of its devices along the other axes (``data``,
``fsdp``): on one host of 8 devices and ``mesh.tensor`` = 2, four engines of two devices each
rather than one. Each holds its own copy of the policy's serving weights and its own cache beside
the training state on its devices.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ember.core.errors import ConfigError
from ember.models.config import ModelConfig
from ember.serving.mesh import SPLIT_AXES


def rollout_mesh(mesh: Mesh, config: ModelConfig) -> Mesh | None:
    """The engine's mesh for a policy ``DecoderLM(config)`` trained on ``mesh`` (see the module
    docstring): None when the axes it is served over (``tensor``, and ``expert`` where ``config``
    has MoE layers) all have size 1 (the engine is then on one device), else the block spanning
    them that holds this process's first device of ``mesh``, with ``mesh``'s axis names (size 1
    but those) and device order.

    Raises:
      ConfigError: (keyed ``mesh.<axis>``) that block has devices of other processes.
    """
    split = _split_axes(mesh, config)
    if not split:
        return None
    here = jax.process_index()
    first = next(device for device in mesh.devices.flat if device.process_index == here)
    block = next(block for block in _blocks(mesh, split) if first in block.flat)
    if any(device.process_index != here for device in block.flat):
        axes = " x ".join(f"mesh.{axis}={mesh.shape[axis]}" for axis in split)
        raise ConfigError(
            f"{axes} spans processes: each process samples its GRPO rollouts on its own devices, "
            f"so the axes the engine is split over must stay within one process's {jax.local_device_count()} devices",
            key=f"mesh.{split[0]}",
        )
    return Mesh(block, mesh.axis_names, axis_types=mesh.axis_types)


def rollout_meshes(mesh: Mesh, config: ModelConfig, replicas: int = 1) -> list[Mesh | None]:
    """The meshes of this process's ``replicas`` rollout engines (``ember.serving.replicas``; -1:
    one per block it holds) for a policy ``DecoderLM(config)`` trained on ``mesh``. One engine:
    ``[rollout_mesh(mesh, config)]``. Several: the blocks spanning the axes the engine is split
    over (one device each where those all have size 1) whose devices are all this process's, the
    first ``replicas`` in the mesh's device order, each a mesh with ``mesh``'s axis names.

    Raises:
      ConfigError: (keyed ``grpo.engine_replicas``) this process holds fewer blocks.
    """
    if replicas == 1:
        return [rollout_mesh(mesh, config)]
    split, here = _split_axes(mesh, config), jax.process_index()
    blocks = [
        Mesh(block, mesh.axis_names, axis_types=mesh.axis_types)
        for block in _blocks(mesh, split)
        if all(device.process_index == here for device in block.flat)
    ]
    if not blocks or len(blocks) < replicas:
        each = " x ".join(f"mesh.{axis}={mesh.shape[axis]}" for axis in split) or "one device"
        raise ConfigError(
            f"grpo.engine_replicas={replicas}: this process holds {len(blocks)} block(s) of {each} for rollout "
            f"engines; give at most {len(blocks)} (or -1 for all of them)",
            key="grpo.engine_replicas",
        )
    return blocks if replicas == -1 else blocks[:replicas]


def _blocks(mesh: Mesh, split: list[str]) -> list[np.ndarray]:
    """The devices of every block of ``mesh`` spanning the axes ``split`` (one position on each
    other axis: size 1 there), in the mesh's device order."""
    others = [i for i, name in enumerate(mesh.axis_names) if name not in split]
    blocks = []
    for position in np.ndindex(*(mesh.devices.shape[i] for i in others)):
        index = [slice(None)] * mesh.devices.ndim
        for axis, at in zip(others, position):
            index[axis] = slice(at, at + 1)
        blocks.append(mesh.devices[tuple(index)])
    return blocks


def _split_axes(mesh: Mesh, config: ModelConfig) -> list[str]:
    """The axes of ``mesh`` of more than one device that the engine of ``DecoderLM(config)`` is split
    over: those serving splits a model over (``tensor``; ``expert`` where ``config`` has MoE layers)."""
    served = [axis for axis in SPLIT_AXES if axis != "expert" or "moe" in config.layer_mlps]
    return [axis for axis in served if mesh.shape.get(axis, 1) > 1]


def held_on(x: jax.Array, mesh: Mesh) -> jax.Array:
    """``x`` as an array on ``mesh`` (a row of the mesh ``x`` is sharded on, as
    :func:`rollout_mesh` gives) made of the shards ``x`` already has on its devices, nothing
    moved nor copied: when every mesh axis ``x`` is split over has the same size in both meshes,
    those shards are the whole of ``x``. Otherwise (split over an axis the row cuts, or not a
    ``NamedSharding``) ``x`` itself. The result shares ``x``'s buffers: copy it before ``x``
    is donated (``ember.serving.program.owned_copy``)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return x
    split = [axis for entry in sharding.spec if entry for axis in ((entry,) if isinstance(entry, str) else entry)]
    if any(sharding.mesh.shape[axis] != mesh.shape.get(axis) for axis in split):
        return x
    shards = {shard.device: shard.data for shard in x.addressable_shards}
    if any(device not in shards for device in mesh.devices.flat):
        return x
    target = NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
    return jax.make_array_from_single_device_arrays(x.shape, target, [shards[d] for d in mesh.devices.flat])


__all__ = ["held_on", "rollout_mesh", "rollout_meshes"]

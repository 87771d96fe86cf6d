"""Where GRPO's rollout engine runs when the policy trains tensor-parallel.

    mesh = rollout_mesh(trainer.mesh)          # None: the trainer's mesh.tensor is 1
    weights = jax.tree.map(lambda x: held_on(x, mesh), trained)       # the trainer's own buffers
    engine.update_params(weights)                                     # copied into the engine's shards

With ``mesh.tensor`` = n > 1 the engine is split over the n devices of the training mesh's
tensor row that holds this process's first device of the mesh (index 0 of every other axis in
a one-process run), as a mesh of its own whose other axes have size 1
(``ember.serving.mesh``). Why that row: the engine splits its weights by the same logical rules
as the trainer (heads, key heads, MLP columns and vocabulary over ``tensor``), so under the
default rules every weight the trainer splits only over ``tensor`` already has the engine's
shards on these devices: syncing copies each shard on its own device, with no transfer between
devices and no gather onto one device or the host (:func:`held_on`). A weight the trainer also
splits over another axis (``fsdp``, ``expert``) is gathered over it, device to device in one
process (a ``device_put`` into the engine's shardings), through the host where that axis
spans processes (``ember.core.sharding.addressable_here``). Each process of a multi-process run
samples its share on its own row; a tensor axis across processes is refused by the trainer
(``ember.training.mesh_checks.check_process_rows``) before the engine is built.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ember.core.errors import ConfigError


def rollout_mesh(mesh: Mesh) -> Mesh | None:
    """The engine's mesh for a policy trained on ``mesh`` (see the module docstring): None when
    its ``tensor`` axis has size 1 (the engine is then on one device), else the tensor row
    holding this process's first device of ``mesh``, with ``mesh``'s axis names (size 1 but
    ``tensor``) and device order.

    Raises:
      ConfigError: (keyed ``mesh.tensor``) that row has devices of other processes.
    """
    size = mesh.shape.get("tensor", 1)
    if size == 1:
        return None
    here = jax.process_index()
    first = next(device for device in mesh.devices.flat if device.process_index == here)
    position = np.argwhere(mesh.devices == first)[0]
    axis = mesh.axis_names.index("tensor")
    row = mesh.devices[tuple(slice(None) if i == axis else slice(p, p + 1) for i, p in enumerate(position))]
    if any(device.process_index != here for device in row.flat):
        raise ConfigError(
            f"mesh.tensor={size} spans processes: each process samples its GRPO rollouts on its own devices, "
            f"so the tensor axis must stay within one process's {jax.local_device_count()} devices",
            key="mesh.tensor",
        )
    return Mesh(row, mesh.axis_names, axis_types=mesh.axis_types)


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


__all__ = ["held_on", "rollout_mesh"]

"""Where GRPO's rollout engine runs on a tensor-parallel training mesh (``ember.training.rl_lm.
engine_mesh``); the run itself: tests/training/test_grpo.py (a tensor-parallel policy)."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ember.core.errors import ConfigError
from ember.core.sharding import MeshConfig, make_mesh
from ember.training.rl_lm.engine_mesh import held_on, rollout_mesh


def buffers(array: jax.Array) -> dict:
    """``{device: the address of its shard's buffer}``."""
    return {shard.device: shard.data.unsafe_buffer_pointer() for shard in array.addressable_shards}


def test_the_engine_takes_the_shards_its_tensor_row_already_holds():
    """data=2 x fsdp=2 x tensor=2: the engine's mesh is the tensor row of devices 0 and 1, and a
    weight the trainer splits only over tensor is taken as the very buffers those devices hold
    (nothing moves between devices); one split over fsdp too is left whole for a device_put to
    gather; a mesh of tensor=1 gives no engine mesh (one device, as before)."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    row = rollout_mesh(mesh)
    assert list(row.devices.flat) == list(mesh.devices[0, 0, :, 0]) and dict(row.shape) == {
        "data": 1, "fsdp": 1, "tensor": 2, "expert": 1
    }  # fmt: skip
    values = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    split = jax.device_put(values, NamedSharding(mesh, PartitionSpec(None, "tensor")))
    held = held_on(split, row)
    assert held.sharding == NamedSharding(row, PartitionSpec(None, "tensor"))
    assert buffers(held) == {device: address for device, address in buffers(split).items() if device in held.devices()}
    np.testing.assert_array_equal(held, values)
    both = jax.device_put(values, NamedSharding(mesh, PartitionSpec("fsdp", "tensor")))
    assert held_on(both, row) is both
    assert rollout_mesh(make_mesh(MeshConfig(data=-1))) is None


def test_a_tensor_row_across_processes_is_refused():
    """Each process samples on its own devices: a tensor row with another process's device (the
    trainer refuses such a mesh first, ``ember.training.mesh_checks.check_process_rows``)."""
    here, there = SimpleNamespace(process_index=0), SimpleNamespace(process_index=1)
    mesh = SimpleNamespace(
        shape={"data": 1, "tensor": 2}, devices=np.array([[here, there]], dtype=object), axis_names=("data", "tensor")
    )
    with pytest.raises(ConfigError, match=r"^mesh.tensor=2 spans processes") as error:
        rollout_mesh(mesh)
    assert error.value.key == "mesh.tensor"

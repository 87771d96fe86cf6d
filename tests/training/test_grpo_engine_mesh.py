"""Where GRPO's rollout engine runs on a tensor- or expert-parallel training mesh
(``ember.training.rl_lm.engine_mesh``); the run itself: tests/training/test_grpo.py (an MoE
policy on tensor and expert axes)."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ember.core.errors import ConfigError
from ember.core.sharding import MeshConfig, make_mesh
from ember.models.config import ModelConfig
from ember.training.rl_lm.engine_mesh import held_on, rollout_mesh, rollout_meshes

DENSE = ModelConfig()
MOE = ModelConfig(mlp_pattern=("moe",))


def buffers(array: jax.Array) -> dict:
    """``{device: the address of its shard's buffer}``."""
    return {shard.device: shard.data.unsafe_buffer_pointer() for shard in array.addressable_shards}


def test_the_engine_takes_the_shards_its_tensor_row_already_holds():
    """data=2 x fsdp=2 x tensor=2: the engine's mesh is the tensor row of devices 0 and 1, and a
    weight the trainer splits only over tensor is taken as the very buffers those devices hold
    (nothing moves between devices); one split over fsdp too is left whole for a device_put to
    gather; a mesh of tensor=1 gives no engine mesh (one device, as before)."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    row = rollout_mesh(mesh, DENSE)
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
    assert rollout_mesh(make_mesh(MeshConfig(data=-1)), DENSE) is None


def test_an_moe_policy_s_engine_spans_the_tensor_x_expert_block():
    """data=2 x tensor=2 x expert=2: an MoE policy's engine is the block of devices 0-3 (its experts
    split as the trainer splits them, so a weight split over tensor and expert is taken as the
    buffers there); a dense policy's, the tensor row only (serving refuses an expert axis with no
    experts to split), and none where tensor is 1. With tensor=1 an MoE policy's is its expert row."""
    mesh = make_mesh(MeshConfig(data=2, tensor=2, expert=2))
    block = rollout_mesh(mesh, MOE)
    assert list(block.devices.flat) == list(mesh.devices[0, 0].flat) and dict(block.shape) == {
        "data": 1, "fsdp": 1, "tensor": 2, "expert": 2
    }  # fmt: skip
    values = np.random.default_rng(1).normal(size=(4, 6)).astype(np.float32)
    split = jax.device_put(values, NamedSharding(mesh, PartitionSpec("expert", "tensor")))
    held = held_on(split, block)
    assert buffers(held) == {device: address for device, address in buffers(split).items() if device in held.devices()}
    np.testing.assert_array_equal(held, values)
    assert list(rollout_mesh(mesh, DENSE).devices.flat) == list(mesh.devices[0, 0, :, 0])
    experts_only = make_mesh(MeshConfig(data=4, expert=2))
    assert rollout_mesh(experts_only, DENSE) is None
    assert list(rollout_mesh(experts_only, MOE).devices.flat) == list(experts_only.devices[0, 0, 0])


def test_a_block_across_processes_is_refused():
    """Each process samples on its own devices: a tensor row (or an MoE policy's expert row) with
    another process's device (the trainer refuses a tensor axis across processes first,
    ``ember.training.mesh_checks.check_process_rows``)."""
    here, there = SimpleNamespace(process_index=0), SimpleNamespace(process_index=1)
    for axis in ("tensor", "expert"):
        mesh = SimpleNamespace(
            shape={"data": 1, axis: 2}, devices=np.array([[here, there]], dtype=object), axis_names=("data", axis)
        )
        with pytest.raises(ConfigError, match=rf"^mesh.{axis}=2 spans processes") as error:
            rollout_mesh(mesh, MOE)
        assert error.value.key == f"mesh.{axis}"


def test_replicas_take_the_blocks_of_this_process_s_devices_in_order():
    """grpo.engine_replicas: one engine per tensor x expert block along the other axes (an MoE
    policy on data=2 x tensor=2 x expert=2: devices 0-3 and 4-7), one device each where nothing
    splits the engine; 1 is the single engine's mesh; more than the blocks is a ConfigError."""
    mesh = make_mesh(MeshConfig(data=2, tensor=2, expert=2))
    meshes = rollout_meshes(mesh, MOE, replicas=-1)
    assert [list(block.devices.flat) for block in meshes] == [list(mesh.devices[i, 0].flat) for i in (0, 1)]
    assert rollout_meshes(mesh, MOE, replicas=1) == [rollout_mesh(mesh, MOE)]
    dense = rollout_meshes(mesh, DENSE, replicas=3)  # tensor rows: 4 of them, the first 3
    assert [list(block.devices.flat) for block in dense] == [
        list(mesh.devices[0, 0, :, 0]),
        list(mesh.devices[0, 0, :, 1]),
        list(mesh.devices[1, 0, :, 0]),
    ]
    single = rollout_meshes(make_mesh(MeshConfig(data=8)), DENSE, replicas=-1)
    assert [list(block.devices.flat) for block in single] == [[device] for device in jax.devices()]
    with pytest.raises(ConfigError, match=r"grpo.engine_replicas=3: this process holds 2 block\(s\)") as error:
        rollout_meshes(mesh, MOE, replicas=3)
    assert error.value.key == "grpo.engine_replicas"

"""ember.core.sharding on 8 CPU devices: real placement of every shard."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ember.core.errors import ConfigError
from ember.core.sharding import (
    DEFAULT_RULES,
    LOGICAL_AXES,
    MESH_AXES,
    MeshConfig,
    constrain,
    host_local_to_global,
    logical_rules,
    logical_to_spec,
    make_mesh,
    named_sharding,
    per_shard,
    shard_variables,
    splitting_axes,
    tree_shardings,
    use_sharding,
)
from tests.tolerances import assert_allclose

MESHES = {
    "8x1": MeshConfig(data=8, fsdp=1),
    "4x2": MeshConfig(data=4, fsdp=2),
    "2x2x2": MeshConfig(data=2, fsdp=2, tensor=2),
    "2x2x1x2": MeshConfig(data=2, fsdp=2, tensor=1, expert=2),
}


def expected_slices(mesh, spec, shape):
    """For each device, the slice of the global array it must hold, computed from its mesh
    coordinates (major-to-minor over the mesh axes that shard each dimension)."""
    result = {}
    for coords, device in np.ndenumerate(mesh.devices):
        position = dict(zip(mesh.axis_names, coords))
        slices = []
        for dim, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            parts, index = 1, 0
            for axis in axes:
                index = index * mesh.shape[axis] + position[axis]
                parts *= mesh.shape[axis]
            size = shape[dim] // parts
            slices.append(slice(index * size, (index + 1) * size))
        result[device] = tuple(slices)
    return result


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("logical", [("batch", "embed"), ("embed", "mlp"), ("vocab", "embed"), (None, "heads")])
def test_each_device_holds_the_right_slice(mesh_name, logical, rng):
    mesh = make_mesh(MESHES[mesh_name])
    shape = (16, 8)
    x = jax.random.normal(rng, shape)
    sharding = named_sharding(mesh, logical, shape=shape)
    placed = jax.device_put(x, sharding)
    expected = expected_slices(mesh, sharding.spec, shape)
    assert len(placed.addressable_shards) == 8
    for shard in placed.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[expected[shard.device]])


def test_mesh_shapes_and_minus_one():
    assert make_mesh(MeshConfig(data=-1, tensor=2)).shape == {"data": 4, "fsdp": 1, "tensor": 2, "expert": 1}
    assert make_mesh(MeshConfig(data=1, fsdp=-1)).shape == {"data": 1, "fsdp": 8, "tensor": 1, "expert": 1}
    assert make_mesh(MeshConfig(data=1), devices=jax.devices()[:1]).devices.size == 1
    assert tuple(make_mesh().axis_names) == MESH_AXES


def test_mesh_errors_name_the_keys():
    with pytest.raises(ConfigError, match=r"needs 3 devices but 8 are available") as info:
        make_mesh(MeshConfig(data=3))
    assert info.value.key == "mesh.data"
    with pytest.raises(ConfigError, match=r"does not divide the 8 available devices") as info:
        make_mesh(MeshConfig(data=-1, tensor=3))
    assert info.value.key == "mesh.tensor"  # the size at fault, not the -1 axis (the old code's mesh.data)
    # Each error is keyed by the axis whose size does not fit, whichever axis is -1 or comes first.
    for config, key in [
        (MeshConfig(data=1, fsdp=-1, tensor=2, expert=3), "mesh.expert"),
        (MeshConfig(fsdp=4, tensor=4), "mesh.tensor"),
        (MeshConfig(data=2, tensor=8), "mesh.tensor"),
        (MeshConfig(data=1, expert=2), "mesh.expert"),  # too few devices: the axis set above 1
    ]:
        with pytest.raises(ConfigError, match=r"available") as info:
            make_mesh(config)
        assert info.value.key == key, config
    with pytest.raises(ConfigError, match="at most one mesh axis may be -1"):
        MeshConfig(data=-1, fsdp=-1)
    # Asking for the rest on fsdp alone: data is -1 by default, which the message has to say.
    with pytest.raises(
        ConfigError, match=re.escape("(mesh.data is -1 unless set); give all but one of them a size, e.g. mesh.data=1")
    ) as info:
        MeshConfig(fsdp=-1)
    assert info.value.key == "mesh.fsdp"
    with pytest.raises(ConfigError, match=re.escape("mesh.tensor must be a positive size or -1")) as info:
        MeshConfig(tensor=0)
    assert info.value.key == "mesh.tensor"


def test_rules_and_specs():
    assert {name for name, _ in DEFAULT_RULES} == set(LOGICAL_AXES)
    # A mesh axis is used at most once per array: embed cannot reuse fsdp after batch took it.
    assert logical_to_spec(("batch", "seq", "embed")) == P(("data", "fsdp", "expert"), None, None)
    assert logical_to_spec(("embed", "mlp")) == P("fsdp", "tensor")
    rules = logical_rules({"vocab": [], "seq": "tensor"})
    assert logical_to_spec(("vocab", "seq"), rules) == P(None, "tensor")
    with pytest.raises(ConfigError, match="unknown logical axis 'vocabulary'"):
        logical_rules({"vocabulary": []})
    with pytest.raises(ConfigError, match="names mesh axis 'model'"):
        logical_rules({"vocab": ["model"]})
    # Before, accepted: jit then failed with JAX's DuplicateSpecError traceback.
    with pytest.raises(ConfigError, match=re.escape("names a mesh axis twice: ['data', 'data']")) as info:
        logical_rules({"batch": ["data", "data"]})
    assert info.value.key == "sharding.rules.batch"
    with pytest.raises(ValueError, match="logical axis 'hidden' has no sharding rule"):
        logical_to_spec(("hidden",))


def test_splitting_axes_are_the_rules_mesh_axes_of_size_above_one():
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, expert=4))
    assert splitting_axes(mesh, "batch") == ("data", "expert")  # the rule's order, fsdp=1 left out
    assert splitting_axes(mesh, "mlp") == ()  # tensor=1
    assert splitting_axes(mesh, "batch", logical_rules({"batch": ["expert", "tensor"]})) == ("expert",)
    own = jax.make_mesh((8,), ("fsdp",))  # a mesh of one's own, without Ember's other axes
    assert splitting_axes(own, "batch") == ("fsdp",) and splitting_axes(own, None) == ()


def test_non_dividing_mesh_axes_are_dropped(rng):
    mesh = make_mesh(MESHES["2x2x2"])
    sharding = named_sharding(mesh, ("vocab", "embed"), shape=(51, 8))  # 51 is odd: vocab replicated
    assert sharding.spec == P(None, "fsdp")
    x = jax.random.normal(rng, (51, 8))
    assert_allclose(jax.device_put(x, sharding), x)
    # batch 2 on data x fsdp x expert = 2 x 2 x 1: fsdp no longer divides, so it is dropped.
    assert named_sharding(mesh, ("batch",), shape=(2,)).spec == P(("data", "expert"))


class TinyMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        w1 = self.param(
            "w1", nn.with_logical_partitioning(nn.initializers.normal(), ("embed", "mlp")), (x.shape[-1], 16)
        )
        w2 = self.param(
            "w2", nn.with_logical_partitioning(nn.initializers.normal(), ("mlp", "embed")), (16, x.shape[-1])
        )
        h = constrain(jnp.tanh(x @ w1), ("batch", "mlp"))
        return constrain(h @ w2, ("batch", "embed"))


@pytest.mark.parametrize("mesh_name", ["4x2", "2x2x2"])
def test_sharded_module_matches_single_device(mesh_name, rng):
    mesh = make_mesh(MESHES[mesh_name])
    x = jax.random.normal(rng, (8, 8))
    variables = TinyMLP().init(jax.random.key(0), x)
    expected = TinyMLP().apply(variables, x)
    sharded = shard_variables(variables, mesh)
    assert sharded["params"]["w1"].sharding.spec == named_sharding(mesh, ("embed", "mlp"), shape=(8, 16)).spec
    with use_sharding(mesh):
        out = jax.jit(TinyMLP().apply)(sharded, x)
    assert out.sharding.spec[0] is not None  # batch stays sharded on the output
    assert_allclose(out, expected)


def test_tree_shardings_from_partition_specs():
    mesh = make_mesh(MESHES["2x2x2"])
    variables = jax.eval_shape(lambda: TinyMLP().init(jax.random.key(0), jnp.ones((8, 8))))
    shardings = tree_shardings(mesh, nn.get_partition_spec(variables), shapes=variables)
    assert shardings["params"]["w1"].spec == P("fsdp", "tensor")
    assert shardings["params"]["w2"].spec == P("tensor", "fsdp")


def test_constrain_is_a_noop_without_a_mesh(rng):
    x = jax.random.normal(rng, (4, 4))
    assert constrain(x, ("batch", "embed")) is x


def test_constrain_rejects_wrong_rank(rng):
    mesh = make_mesh(MESHES["8x1"])
    with use_sharding(mesh), pytest.raises(ValueError, match="got 1 logical axes"):
        constrain(jax.random.normal(rng, (4, 4)), ("batch",))


def test_host_local_to_global_single_process(rng):
    mesh = make_mesh(MESHES["4x2"])
    batch = {"tokens": np.asarray(jax.random.randint(rng, (16, 5), 0, 100))}
    global_batch = host_local_to_global(batch, mesh, ("batch", "seq"))
    assert global_batch["tokens"].shape == (16, 5)
    assert global_batch["tokens"].sharding.spec == P(("data", "fsdp", "expert"), None)
    np.testing.assert_array_equal(np.asarray(global_batch["tokens"]), batch["tokens"])


@pytest.mark.parametrize("mesh_name", ["2x2x2", "8x1"])
def test_per_shard_sums_a_split_contraction_and_no_all_reduce_over_a_size_one_axis(mesh_name, rng):
    """``sum_over``: the row-parallel matmul's partial products summed over the tensor axis; on
    a mesh whose tensor axis has size 1 there is nothing to sum, where a psum over it was still an
    all-reduce (singleton replica groups) in the program."""
    x, w = jax.random.normal(rng, (8, 16)), jax.random.normal(jax.random.key(1), (16, 4))
    matmul = jax.jit(
        lambda x, w: per_shard(jnp.dot, [("batch", "mlp"), ("mlp", None)], ("batch", None), sum_over="mlp")(x, w)
    )
    with use_sharding(make_mesh(MESHES[mesh_name])):
        compiled = matmul.lower(x, w).compile()
        assert_allclose(compiled(x, w), x @ w)
    assert ("all-reduce" in compiled.as_text()) == (mesh_name == "2x2x2")

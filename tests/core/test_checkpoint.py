"""ember.core.checkpoint: exact round trips, resharding on restore, crash safety."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ember.core.checkpoint import CheckpointManager, abstract_with_shardings
from ember.core.sharding import MeshConfig, make_mesh, named_sharding

REPO = Path(__file__).resolve().parents[2]


def make_state(key):
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "dense": {"kernel": jax.random.normal(k1, (16, 8)), "bias": jax.random.normal(k2, (8,))},
        "embed": jax.random.normal(k3, (32, 16)).astype(jnp.bfloat16),
    }
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = optimizer.update(grads, opt_state, params)  # non-trivial moments and count
    return {"params": params, "opt_state": opt_state, "rng": jax.random.key(7), "step": jnp.int32(3)}


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_exact_round_trip_of_params_and_optax_state(tmp_path, rng):
    state = make_state(rng)
    with CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(10, state, extra={"data_position": 1234, "note": "first"})
    restored = CheckpointManager(tmp_path / "ckpt").restore(target=state)
    assert restored.step == 10
    assert restored.extra == {"data_position": 1234, "note": "first"}
    assert_trees_equal(restored.state, state)
    # The restored optimizer state is usable: one more update gives identical results.
    optimizer = optax.adamw(1e-3)
    grads = jax.tree.map(jnp.ones_like, state["params"])
    expected, _ = optimizer.update(grads, state["opt_state"], state["params"])
    got, _ = optimizer.update(grads, restored.state["opt_state"], restored.state["params"])
    assert_trees_equal(got, expected)


def test_keep_last_n_latest_and_given_step(tmp_path, rng):
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    states = {}
    for step in (1, 2, 3):
        states[step] = {"w": jax.random.normal(jax.random.fold_in(rng, step), (4,))}
        manager.save(step, states[step])
    manager.wait()
    assert manager.all_steps() == [2, 3] and manager.latest_step() == 3
    assert_trees_equal(manager.restore(target=states[3]).state, states[3])
    assert_trees_equal(manager.restore(2, target=states[2]).state, states[2])
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 1 .* available steps: \[2, 3\]"):
        manager.restore(1)
    with pytest.raises(ValueError, match="step 3 already exists"):
        manager.save(3, states[3])
    manager.close()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        CheckpointManager(tmp_path / "empty").restore()


def test_zero_size_arrays_round_trip_as_zeros_of_the_target_shape(tmp_path, rng):
    """Orbax refuses to write zero-size arrays (GaLore keeps them for unprojected parameters)."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    state = {"w": jax.random.normal(rng, (8, 4)), "placeholder": jax.device_put(jnp.zeros((0, 0)), sharding)}
    with CheckpointManager(tmp_path) as manager:
        manager.save(0, state)
    restored = CheckpointManager(tmp_path).restore(target=state).state
    assert_trees_equal(restored, state)
    assert restored["placeholder"].sharding == sharding


def test_restore_without_target_lands_on_one_device(tmp_path, rng):
    state = {"w": jax.random.normal(rng, (8, 4)), "count": jnp.int32(5)}
    with CheckpointManager(tmp_path) as manager:
        manager.save(0, state)
    restored = CheckpointManager(tmp_path).restore().state
    assert restored["w"].sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert_trees_equal(restored, state)


def test_save_on_4x2_restore_on_2x4_and_single_device(tmp_path, rng):
    mesh_4x2 = make_mesh(MeshConfig(data=4, fsdp=2))
    mesh_2x4 = make_mesh(MeshConfig(data=2, fsdp=4))
    logical = {"kernel": ("embed", "batch"), "table": ("batch", None)}
    values = {"kernel": jax.random.normal(rng, (16, 8)), "table": jax.random.normal(jax.random.fold_in(rng, 1), (8, 6))}

    def shardings(mesh):
        return {k: named_sharding(mesh, logical[k], shape=values[k].shape) for k in values}

    state = jax.device_put(values, shardings(mesh_4x2))
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, state)

    target = abstract_with_shardings(values, shardings(mesh_2x4))
    on_2x4 = CheckpointManager(tmp_path).restore(target=target).state
    for name in values:
        assert on_2x4[name].sharding == target[name].sharding
        np.testing.assert_array_equal(np.asarray(on_2x4[name]), np.asarray(values[name]))

    # The kernel's per-device blocks really changed shape: (8, 2) on 4x2, (4, 4) on 2x4.
    assert state["kernel"].addressable_shards[0].data.shape == (8, 2)
    assert on_2x4["kernel"].addressable_shards[0].data.shape == (4, 4)

    single = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    on_one = (
        CheckpointManager(tmp_path).restore(target=abstract_with_shardings(values, {k: single for k in values})).state
    )
    for name in values:
        assert on_one[name].sharding == single
        np.testing.assert_array_equal(np.asarray(on_one[name]), np.asarray(values[name]))


CHILD = textwrap.dedent(
    """
    import sys, time
    import jax, jax.numpy as jnp
    from ember.core.checkpoint import CheckpointManager
    manager = CheckpointManager(sys.argv[1], async_save=True)
    manager.save(1, {"w": jnp.full((4,), 1.0), "big": jnp.zeros((8,))})
    manager.wait()
    print("SAVED 1", flush=True)
    # Large enough that writing takes far longer than the parent needs to notice and kill.
    big = [jax.random.normal(jax.random.key(i), (2048, 2048)) for i in range(8)]
    manager.save(2, {"w": jnp.full((4,), 2.0), "big": big})
    print("SAVING 2", flush=True)
    time.sleep(120)
    """
)


def test_kill_during_save_keeps_previous_step(tmp_path):
    directory = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS="", JAX_PLATFORMS="cpu")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "SAVED 1"
        assert child.stdout.readline().strip() == "SAVING 2"
        deadline = time.monotonic() + 30
        while not [p for p in directory.iterdir() if p.name.startswith("2")] and time.monotonic() < deadline:
            time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith("2")]
    assert leftovers and all(name != "2" for name in leftovers), f"expected a partial step-2 write, found {leftovers}"

    manager = CheckpointManager(directory)
    assert manager.all_steps() == [1]
    restored = manager.restore(target={"w": jnp.zeros((4,)), "big": jnp.zeros((8,))})
    assert restored.step == 1
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.ones(4))
    # Saving continues normally after the crash.
    manager.save(2, {"w": jnp.full((4,), 3.0), "big": jnp.ones((8,))})
    manager.wait()
    assert manager.all_steps() == [1, 2]
    manager.close()


def test_leftover_temporary_directories_are_gone_when_the_manager_is_open(tmp_path):
    # Orbax removes a killed save's temporary directory in a background thread; a manager opened
    # only to read (or whose restore raised) left that thread running at exit, and it printed a
    # "cannot schedule new futures after shutdown" traceback after `ember eval`'s one-line error.
    leftover = tmp_path / "3.orbax-checkpoint-tmp-1234" / "state"
    leftover.mkdir(parents=True)
    manager = CheckpointManager(tmp_path)
    assert not leftover.parent.exists()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        manager.restore()


def test_restore_part_reads_one_entry_onto_a_target_sharding(tmp_path, rng):
    state = make_state(rng)
    with CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(4, state)
    manager = CheckpointManager(tmp_path / "ckpt")
    params = manager.restore_part("params")
    assert_trees_equal(params, state["params"])
    mesh = make_mesh(MeshConfig(data=8))
    sharding = named_sharding(mesh, ("batch", None))
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) if x.ndim == 2 else x, state["params"]
    )
    placed = manager.restore_part("params", 4, target=target)
    assert placed["embed"].sharding == sharding
    assert_trees_equal(placed, state["params"])
    assert sorted(manager.state_metadata()) == ["opt_state", "params", "rng", "step"]
    with pytest.raises(KeyError, match="has no 'moments' entry"):
        manager.restore_part("moments")

"""``load_model`` on an Ember run directory reads the parameters only (never the optimizer
state) and serves them in either layer layout (``scan_layers`` is a runtime setting): on a
GPU unrolled unless the caller says otherwise."""

import gc
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ember.core.checkpoint import CheckpointManager
from ember.core.config import to_yaml
from ember.core.errors import ConfigError
from ember.core.sharding import MeshConfig
from ember.models import hf
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.quantization import QuantizeConfig, quantize_params
from ember.serving.loading import load_model, sharded_targets
from ember.serving.mesh import serving_mesh
from tests.programs import programs_lowered
from tests.tolerances import assert_allclose

CONFIG = ModelConfig(
    vocab_size=64, d_model=32, num_layers=4, num_heads=4, mlp_dim=64, max_seq_len=16, attention_impl="xla"
)


@pytest.fixture
def run_dir(tmp_path, rng):
    """A run directory as the trainer leaves it: scanned params perturbed away from their
    init, AdamW moments beside them, and config.yaml."""

    # Jitted: op by op, the init, the perturbation and the AdamW update compiled ~100 programs.
    @jax.jit
    def perturbed_init(rng):
        init_key, noise_key = jax.random.split(rng)
        params = nn.meta.unbox(DecoderLM(CONFIG).init(init_key, jnp.zeros((1, 4), jnp.int32))["params"])
        leaves, treedef = jax.tree.flatten(params)
        noise = jax.random.split(noise_key, len(leaves))
        return treedef.unflatten([x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, noise)])

    params = perturbed_init(rng)
    tx = optax.adamw(1e-3)
    _, opt_state = jax.jit(lambda p: tx.update(p, tx.init(p), p))(params)  # non-zero moments
    (tmp_path / "config.yaml").write_text("model:\n" + textwrap.indent(to_yaml(CONFIG), "  "))
    with CheckpointManager(tmp_path / "checkpoints", async_save=False) as manager:
        manager.save(5, {"step": jnp.int32(5), "params": params, "opt_state": opt_state})
    return tmp_path, params


def live_bytes():
    gc.collect()
    return sum(array.nbytes for array in jax.live_arrays())


def test_load_reads_the_params_and_never_the_optimizer_state(run_dir, monkeypatch):
    path, params = run_dir

    def full_restore(*args, **kwargs):
        raise AssertionError("load_model restored the whole train state")

    monkeypatch.setattr(CheckpointManager, "restore", full_restore)
    before = live_bytes()
    loaded = load_model(path)
    param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    assert live_bytes() - before == param_bytes  # the moments (2x the params) were never materialised
    assert jax.tree.structure(loaded.params) == jax.tree.structure(params)
    for got, saved in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))


def test_on_a_mesh_a_run_s_weights_are_read_straight_into_their_shards(run_dir, monkeypatch):
    """``load_model(..., mesh=...)`` reads each checkpointed array into the shards it is served in
    (orbax restores every device's part), rather than whole onto one device first."""
    path, params = run_dir
    restored = []
    restore_part = CheckpointManager.restore_part
    monkeypatch.setattr(
        CheckpointManager, "restore_part", lambda *a, **kw: restored.append(restore_part(*a, **kw)) or restored[-1]
    )
    loaded = load_model(path, mesh=serving_mesh(MeshConfig(data=1, tensor=2)))
    q = restored[0]["layers"]["block_0"]["attn"]["q"]["kernel"]  # [layers, embed, heads, head_dim]
    layers, embed, heads, head_dim = q.shape
    assert [shard.data.shape for shard in q.addressable_shards] == [(layers, embed, heads // 2, head_dim)] * 2
    for got, saved in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))


def test_loading_a_run_leaves_the_save_its_trainer_is_writing(run_dir):
    """``ember generate --checkpoint RUN`` while RUN trains: opening the run's checkpoints removed
    every orbax temporary directory, the trainer's save in progress among them (seen with a real
    asynchronous save: its commit then failed, "Save failed: 7/7 params are missing .zarray",
    and the run crashed). A reader now opens them read-only and leaves them alone."""
    path, params = run_dir
    in_progress = path / "checkpoints" / "6.orbax-checkpoint-tmp-1234" / "state"  # what orbax writes into
    in_progress.mkdir(parents=True)
    loaded = load_model(path)
    assert in_progress.is_dir()
    np.testing.assert_array_equal(np.asarray(jax.tree.leaves(loaded.params)[0]), np.asarray(jax.tree.leaves(params)[0]))
    with pytest.raises(ValueError, match="opened read_only"):
        CheckpointManager(path / "checkpoints", read_only=True).save(7, {"w": jnp.ones(2)})


def test_scanned_checkpoint_serves_unscanned_with_the_same_logits(run_dir, rng):
    path, params = run_dir
    loaded = load_model(path, scan_layers=False)
    assert loaded.config.scan_layers is False and "group_3" in loaded.params and "layers" not in loaded.params
    tokens = jax.random.randint(rng, (2, 12), 0, CONFIG.vocab_size)
    expected, _ = jax.jit(DecoderLM(CONFIG).apply)({"params": params}, tokens)
    got, _ = jax.jit(DecoderLM(loaded.config).apply)({"params": loaded.params}, tokens)
    assert_allclose(got, expected, dtype=np.float32)


def test_a_gpu_loads_the_layers_unrolled_unless_told(run_dir, monkeypatch):
    """A scanned decode step does work on a GPU that an unrolled one does not (XLA copies each
    layer's packed weights for the quantized matmul, transposes stacked float kernels), so
    there ``load_model`` unrolls the layers unless its caller sets ``scan_layers``; elsewhere
    it keeps the saved layout."""
    path, _ = run_dir
    assert load_model(path).config.scan_layers
    with monkeypatch.context() as patch:
        patch.setattr(jax, "default_backend", lambda: "gpu")
        unrolled, kept = load_model(path), load_model(path, scan_layers=True)
    assert unrolled.config.scan_layers is False and "group_3" in unrolled.params and "layers" not in unrolled.params
    assert kept.config.scan_layers and "layers" in kept.params


def test_a_checkpoint_step_for_a_hugging_face_directory_is_an_error(run_dir, tmp_path):
    """A Hugging Face directory holds one set of weights: a step asked of it is refused, not
    ignored (``ember generate --checkpoint HF_DIR --step 5`` served the only weights there)."""
    _, params = run_dir
    hf.save(tmp_path / "hf", CONFIG, params)
    assert load_model(tmp_path / "hf").config.num_layers == CONFIG.num_layers
    with pytest.raises(ConfigError, match=r"Hugging Face model directory.* no checkpoint steps.*step 5"):
        load_model(tmp_path / "hf", step=5)


def test_on_a_mesh_a_hugging_face_model_s_weights_go_straight_into_their_shards(run_dir, tmp_path):
    """``load_model(HF_DIR, mesh=...)`` put every weight whole on the default device (the mesh was
    for Ember checkpoints only), so a model served tensor-parallel because no one device holds it
    could not be loaded. Each tensor now goes from the host into the shards it is served in."""
    _, params = run_dir
    hf.save(tmp_path, CONFIG, params)
    mesh = serving_mesh(MeshConfig(data=1, tensor=2))
    loaded = load_model(tmp_path, mesh=mesh)
    q = loaded.params["layers"]["block_0"]["attn"]["q"]["kernel"]  # [layers, embed, heads, head_dim]
    layers, embed, heads, head_dim = q.shape
    assert [shard.data.shape for shard in q.addressable_shards] == [(layers, embed, heads // 2, head_dim)] * 2
    assert {shard.device for shard in q.addressable_shards} == set(mesh.devices.flat)
    for got, saved in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))


def test_on_the_host_a_model_is_read_without_a_device(run_dir, tmp_path):
    """``load_model(..., host=True)`` (a fine-tuning run's base, which its trainer places on its
    mesh) restored an Ember checkpoint and put a Hugging Face directory whole on the default
    device, to be copied back: a model no one device holds could not be a base. Now NumPy
    arrays are read with no transfer to any device."""
    path, params = run_dir
    hf.save(tmp_path / "hf", CONFIG, params)
    with programs_lowered() as lowered:  # placed by device_put, not converted by jnp.asarray leaf by leaf
        on_device = load_model(tmp_path / "hf")
    assert not lowered
    for got, saved in zip(jax.tree.leaves(on_device.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))
    for source in (path, tmp_path / "hf"):
        with jax.transfer_guard_host_to_device("disallow_explicit"):
            loaded = load_model(source, host=True)
        assert {type(leaf) for leaf in jax.tree.leaves(loaded.params)} == {np.ndarray}, source
        for got, saved in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params)):
            np.testing.assert_array_equal(got, np.asarray(saved))
    with pytest.raises(ValueError, match="not both"):
        load_model(path, host=True, mesh=serving_mesh(MeshConfig(data=1, tensor=2)))


def test_a_precision_with_another_parameter_dtype_loads_the_weights_in_it(run_dir):
    """A run trained with float32 master weights loaded with ``precision="pure_bf16"`` (a
    fine-tuning run's ``base_model.precision``) kept its float32 weights: the run trained (or a
    LoRA run froze) twice the bytes asked for. They are now the config's parameter dtype,
    converted by one program (op by op: one per weight shape, 7 here)."""
    path, params = run_dir
    with programs_lowered() as lowered:
        loaded = load_model(path, precision="pure_bf16")
    assert len(lowered) == 1, lowered
    assert loaded.config.policy.param_dtype == jnp.bfloat16
    for got, saved in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved.astype(jnp.bfloat16)))
    assert {leaf.dtype for leaf in jax.tree.leaves(load_model(path, precision="bf16").params)} == {jnp.dtype("float32")}


def test_a_quantized_checkpoint_s_parts_are_restored_into_the_shards_of_the_weights_they_store():
    """``load_model(..., mesh=...)`` restores ``ember quantize`` output (NF4 here: codes, absmax
    and the absmax blocks' scales and mean) split as its float weights would be: each device reads
    half of q's codes and absmax (their heads) and of down's (their mlp rows); the blocks' scales
    and mean, a few floats per layer, whole. Before, every part was restored whole on each device."""
    tokens = jnp.zeros((1, 4), jnp.int32)
    config = QuantizeConfig(format="nf4", group_size=16)
    saved = jax.eval_shape(
        lambda key: nn.meta.unbox(quantize_params(DecoderLM(CONFIG).init(key, tokens)["params"], config)),
        jax.random.key(0),
    )
    targets = sharded_targets({"params": saved}, CONFIG, serving_mesh(MeshConfig(data=1, tensor=2)))["params"]
    block = targets["layers"]["block_0"]
    for stored, split in ((block["attn"]["q"]["kernel"], 2), (block["mlp"]["down"], 1)):  # [layers, K, heads.. | embed]
        for key, part in stored.items():
            halved = key in ("nf4", "absmax")
            expected = tuple(size // 2 if axis == split and halved else size for axis, size in enumerate(part.shape))
            assert part.sharding.shard_shape(part.shape) == expected, key

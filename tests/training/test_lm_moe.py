"""A mixture-of-experts LM through the LM trainer: the same loss curve on every expert-parallel
mesh (the experts' tokens exchanged all-to-all), and DeepSeek-V3 bias balancing end to end (the
bias learned, logged, checkpointed, resumed exactly and applied by serving)."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.core.checkpoint import CheckpointManager
from ember.core.sharding import make_mesh, use_sharding
from ember.models.decoder import DecoderLM
from ember.models.variables import as_variables
from ember.serving.loading import load_model
from ember.training.lm.trainer import train
from tests.tolerances import assert_allclose
from tests.training.lm_runs import read_metrics, small_config

EXPERTS = 8
MOE = [
    "model.mlp_pattern=[moe]",
    f"model.moe.num_experts={EXPERTS}",
    "model.moe.top_k=2",
    "model.moe.expert_dim=16",
    "train.aux_loss_weights={load_balance: 0.01, router_z: 0.001}",
]
# Ten steps (twenty took 6.5 s more CPU for the four meshes): the loss falls from 5.76 to 3.87 and
# the median parameter leaf moves by 58% of its norm (measured on expert 2), far from the start.
STEPS = 10


def router_bias(state):
    """The scanned layers' bias ``[layers, experts]`` in a restored train state."""
    return state["model_state"]["balance"]["layers"]["block_0"]["moe"]["router_bias"]


@pytest.mark.slow
def test_loss_curve_is_the_same_on_every_expert_parallel_mesh(tmp_path, dataset):
    curves = {}
    for expert in (1, 2, 4, 8):
        config = small_config(
            tmp_path / f"expert{expert}", dataset, *MOE, f"train.steps={STEPS}", f"mesh.data={8 // expert}",
            f"mesh.expert={expert}",
        )  # fmt: skip
        train(config)
        metrics = read_metrics(config.run_dir)
        curves[expert] = np.array([metrics[step]["loss"] for step in range(1, STEPS + 1)])
        assert all(f"expert_load/{e}" in metrics[STEPS] for e in range(EXPERTS))
    assert curves[1][-1] < curves[1][0] - 0.5  # it learns
    for expert, curve in curves.items():
        # Sharding reorders float32 reductions; 10 Adam steps amplify that a little.
        assert_allclose(curve, curves[1], dtype=np.float32, scale=20, err_msg=f"expert={expert}")

    # The model under an expert mesh sends tokens to their experts' devices all-to-all.
    model = DecoderLM(config.model)
    params = CheckpointManager(Path(config.run_dir) / "checkpoints").restore_part("params")
    shapes = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), params)
    with use_sharding(make_mesh(config.mesh)):
        hlo = jax.jit(model.apply).lower({"params": shapes}, jax.ShapeDtypeStruct((8, 16), jnp.int32)).as_text()
    assert "all_to_all" in hlo


@pytest.mark.slow
def test_bias_balancing_is_learned_checkpointed_resumed_and_served(tmp_path, dataset):
    balancing = [*MOE, "model.moe.score=sigmoid", "model.moe.bias_balancing_rate=0.01", "model.scan_layers=true"]
    config = small_config(tmp_path / "whole", dataset, *balancing, "train.steps=6", "mesh.data=8")
    train(config)
    whole = CheckpointManager(Path(config.run_dir) / "checkpoints").restore()
    bias = router_bias(whole.state)
    assert bias.shape == (config.model.num_layers, EXPERTS)  # one bias per scanned layer
    # Six steps of -0.01, 0 or +0.01 each (toward the mean load): multiples of 0.01, at most 0.06.
    assert np.any(bias != 0) and np.abs(bias).max() <= 0.06 + 1e-6
    assert_allclose(np.round(np.asarray(bias) / 0.01) * 0.01, bias, dtype=np.float32)
    metrics = read_metrics(config.run_dir)
    for step in range(1, 7):
        load = [metrics[step][f"expert_load/{e}"] for e in range(EXPERTS)]
        assert_allclose(sum(load), 1.0, dtype=np.float32)
        assert metrics[step]["load_imbalance"] >= max(load) * EXPERTS - 1e-5  # layers' max >= the mean's max

    # Stopped at step 3, then resumed to 6: the same losses and the same bias.
    split = small_config(tmp_path / "split", dataset, *balancing, "train.steps=3", "mesh.data=8")
    train(split)
    train(dataclasses.replace(split, train=dataclasses.replace(split.train, steps=6)), resume=True)
    resumed = CheckpointManager(Path(split.run_dir) / "checkpoints").restore()
    resumed_metrics = read_metrics(split.run_dir)
    assert [resumed_metrics[s]["loss"] for s in range(1, 7)] == [metrics[s]["loss"] for s in range(1, 7)]
    np.testing.assert_array_equal(router_bias(resumed.state), bias)

    # Serving applies the learned bias: the same logits as the model with it, not without it.
    loaded = load_model(config.run_dir)
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, config.model.vocab_size)
    model = DecoderLM(loaded.config)
    served, _ = jax.jit(model.apply)(as_variables(loaded.params), tokens)
    variables = {"params": whole.state["params"], **whole.state["model_state"]}
    with_bias, _ = jax.jit(model.apply)(variables, tokens)
    zero = jax.tree.map(jnp.zeros_like, whole.state["model_state"])
    without_bias, _ = jax.jit(model.apply)({"params": whole.state["params"], **zero}, tokens)
    np.testing.assert_array_equal(served, with_bias)
    assert np.abs(np.asarray(served) - np.asarray(without_bias)).max() > 1e-4

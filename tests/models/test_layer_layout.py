"""Where a DecoderLM's layers live: the per-layer list of either layout and back, on the host
or on a device, and converting saved trees between the layouts."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from ember.models.config import ModelConfig
from ember.models.layer_layout import convert_layer_layout, layers_from_list, layers_to_list, saved_layout
from tests.programs import programs_lowered

CONFIG = ModelConfig(
    vocab_size=64, d_model=64, num_layers=4, num_heads=4, mlp_dim=96, block_pattern=("local", "global")
)
"""Scanned, two blocks per group: block_0 and block_1 each stack 2 layers."""
UNROLLED = dataclasses.replace(CONFIG, scan_layers=False)


def host_layers(q_shape=(3, 2)):
    """Per-layer trees of NumPy arrays: ``q`` of ``q_shape``, ``norm`` of its first dimension."""
    draw = functools.partial(np.random.default_rng(0).standard_normal, dtype=np.float32)
    return [{"attn": {"q": draw(q_shape)}, "norm": draw(q_shape[:1])} for _ in range(CONFIG.num_layers)]


def test_saved_layout_names_the_saved_config_and_converts_to_this_one():
    """One function decides a checkpoint's layer layout and the conversion to the run's (the LM,
    fine-tuning and GRPO resumes and the serving loader use it): nothing for the same layout, else
    the config with the saved ``scan_layers`` and a conversion of params and moments alike."""
    unrolled_config = dataclasses.replace(CONFIG, scan_layers=False)
    draw = functools.partial(np.random.default_rng(0).standard_normal, dtype=np.float32)
    layers = [{"attn": {"q": draw((3, 2))}, "norm": draw(3)} for _ in range(CONFIG.num_layers)]
    embed = draw((5, 3))
    trees = {c.scan_layers: {"embed": embed, **layers_from_list(c, layers)} for c in (CONFIG, unrolled_config)}
    for config, other in ((CONFIG, unrolled_config), (unrolled_config, CONFIG)):
        assert saved_layout(config, trees[config.scan_layers]) is None
        saved_config, convert = saved_layout(config, trees[other.scan_layers])
        assert saved_config == other
        state = (trees[other.scan_layers], {"mu": trees[other.scan_layers]})  # params and a moment mirroring them
        expected = (trees[config.scan_layers], {"mu": trees[config.scan_layers]})
        jax.tree.map(np.testing.assert_array_equal, convert(state), expected)


def test_host_layers_are_stacked_into_numpy_from_an_iterator():
    """Host layers are copied into NumPy stacks as an iterator yields them (``ember.models.hf``
    reads a checkpoint one layer at a time), not stacked on a device; jax layers still are."""
    layers = host_layers()
    stacked = layers_from_list(CONFIG, iter(layers))["layers"]
    for j in range(CONFIG.layer_period):
        expected = jax.tree.map(lambda *leaves: np.stack(leaves), *layers[j :: CONFIG.layer_period])
        jax.tree.map(np.testing.assert_array_equal, stacked[f"block_{j}"], expected)
        assert {type(leaf) for leaf in jax.tree.leaves(stacked[f"block_{j}"])} == {np.ndarray}
    on_device = layers_from_list(CONFIG, jax.device_put(layers))["layers"]
    assert {type(leaf) for leaf in jax.tree.leaves(on_device)} == {type(jax.numpy.zeros(1))}
    jax.tree.map(np.testing.assert_array_equal, on_device, stacked)


def test_layers_that_do_not_stack_are_named():
    layers = host_layers()
    layers[2]["norm"] = np.zeros(4, np.float32)  # block_0's second layer
    with pytest.raises(ValueError, match=r"layer 2 has a float32\[4\] leaf .* have float32\[3\]"):
        layers_from_list(CONFIG, layers)
    with pytest.raises(ValueError, match="expected 4 layer trees, got 3"):
        layers_from_list(CONFIG, iter(host_layers()[:3]))
    with pytest.raises(ValueError, match="expected 4 layer trees, got more"):
        layers_from_list(CONFIG, host_layers() + host_layers()[:1])


def test_scanned_device_layers_come_apart_in_one_program():
    """``layers_to_list`` of a scanned tree of jax arrays (the params and optimizer moments of a
    run resumed or served in the other layout) indexed each leaf of each layer on the device:
    a program per leaf shape and index kind, 4 here. Now one program takes each block apart, and
    one stacks it again (``jnp.stack`` leaf by leaf: a program per leaf shape, 2)."""
    shape = (5, 7)  # leaf shapes no other test of this process moves, so nothing is compiled yet
    scanned = jax.device_put(layers_from_list(CONFIG, host_layers(shape)))
    with programs_lowered() as lowered:
        layers = layers_to_list(CONFIG, scanned)
        jax.block_until_ready(layers)
    assert len(lowered) <= 1, lowered  # block_0 and block_1 have one structure and shapes
    for got, expected in zip(layers, host_layers(shape), strict=True):
        jax.tree.map(np.testing.assert_array_equal, got, expected)
    converted = convert_layer_layout({"mu": scanned}, CONFIG, UNROLLED)["mu"]
    jax.tree.map(np.testing.assert_array_equal, converted, layers_from_list(UNROLLED, host_layers(shape)))
    with programs_lowered() as lowered:  # and back: stacked by one program (jnp.stack per leaf shape: 2)
        again = convert_layer_layout({"mu": converted}, UNROLLED, CONFIG)["mu"]
    assert len(lowered) <= 1, lowered
    jax.tree.map(np.testing.assert_array_equal, again, scanned)

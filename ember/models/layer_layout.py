"""Where a ``DecoderLM``'s layers live in its parameter tree, and moving them between layouts.

Layer ``i`` is block ``i % P`` of group ``i // P`` (``P = config.layer_period``). With
``scan_layers`` the groups are stacked: ``params["layers"]["block_<j>"]`` with a leading
``[groups]`` axis (the last group may be partial: its missing blocks are simply absent from the
later blocks' stacks); otherwise ``params["group_<g>"]["block_<j>"]``. :func:`layers_to_list` /
:func:`layers_from_list` convert either layout to a per-layer list (checkpoint conversion, LoRA
surgery, GPTQ's group-at-a-time pass); :func:`convert_layer_layout` moves params and optimizer
state between the layouts (``scan_layers`` is a runtime setting), and :func:`saved_layout` says
whether and how a saved tree must be moved to a config's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ember.models.config import ModelConfig


def num_groups(config: ModelConfig) -> int:
    """How many groups (periods of the block pattern, the last possibly partial) the layers form."""
    return math.ceil(config.num_layers / config.layer_period)


def group_span(config: ModelConfig, group: int) -> tuple[int, int]:
    """``(first_layer, num_blocks)`` of the ``BlockGroup`` that runs group ``group``: scanned,
    every group runs the module of group 0 (``(0, period)``); unscanned, its own layers."""
    if not 0 <= group < num_groups(config):
        raise ValueError(f"group must be in [0, {num_groups(config)}), got {group}")
    period = config.layer_period
    if config.scan_layers:
        return 0, period
    return group * period, min(period, config.num_layers - group * period)


def layer_location(config: ModelConfig, layer: int) -> tuple[str, int, str]:
    """``(container, group, block)`` of layer ``layer``: ``("layers", g, "block_j")`` when
    scanned (index ``g`` of the leading axis), ``("group_g", -1, "block_j")`` otherwise."""
    if not 0 <= layer < config.num_layers:
        raise ValueError(f"layer must be in [0, {config.num_layers}), got {layer}")
    group, block = divmod(layer, config.layer_period)
    if config.scan_layers:
        return "layers", group, f"block_{block}"
    return f"group_{group}", -1, f"block_{block}"


def layers_to_list(config: ModelConfig, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-layer parameter trees of ``params``, in layer order (either layout). Scanned
    layers of jax arrays are taken apart by one program per block, not by a device op per layer
    and leaf (which compiled one program per leaf shape); host (NumPy) layers are views of their
    stacks."""
    result, rows = [], {}
    for layer in range(config.num_layers):
        container, group, block = layer_location(config, layer)
        tree = params[container][block]
        if group < 0:
            result.append(tree)
            continue
        if block not in rows:
            leaves = jax.tree.leaves(tree)
            on_device = leaves and all(isinstance(leaf, jax.Array) for leaf in leaves)
            rows[block] = (_device_rows if on_device else _rows)(tree, _block_depth(config, layer))
        result.append(rows[block][group])
    return result


def _rows(tree: Any, depth: int) -> list[Any]:
    """``tree``'s leaves indexed ``0 .. depth - 1`` along their leading axis, as ``depth`` trees."""
    return [jax.tree.map(lambda leaf, row=row: leaf[row], tree) for row in range(depth)]


_device_rows = jax.jit(_rows, static_argnums=1)
""":func:`_rows` of jax arrays in one program."""


def _block_depth(config: ModelConfig, first_layer: int) -> int:
    """How many layers the block whose first layer is ``first_layer`` stacks when scanned."""
    return len(range(first_layer, config.num_layers, config.layer_period))


def layers_from_list(config: ModelConfig, layers: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The inverse of :func:`layers_to_list`: the top-level entries holding the layers
    (``{"layers": ...}`` scanned, ``{"group_<g>": ...}`` otherwise).

    ``layers`` may be an iterator. Scanned, layers of host (NumPy) arrays are copied into NumPy
    stacks as they come, so an iterator that builds each layer (``ember.models.hf`` reading a
    checkpoint) holds one layer beside the stacks, never the model twice; layers of jax arrays
    are stacked on their device, by one program per block.
    """
    result = {}
    on_device: dict[str, list[dict[str, Any]]] = {}
    count = 0
    for layer, tree in enumerate(layers):
        if layer >= config.num_layers:
            raise ValueError(f"expected {config.num_layers} layer trees, got more")
        count = layer + 1
        container, group, block = layer_location(config, layer)
        blocks = result.setdefault(container, {})
        if group < 0:
            blocks[block] = tree
        elif block in on_device or (block not in blocks and not _on_host(tree)):
            on_device.setdefault(block, []).append(tree)
        else:
            if block not in blocks:
                depth = _block_depth(config, layer)
                blocks[block] = jax.tree.map(lambda leaf, depth=depth: np.empty((depth, *leaf.shape), leaf.dtype), tree)
            jax.tree.map(functools.partial(_fill_layer, group=group, layer=layer), blocks[block], tree)
    if count != config.num_layers:
        raise ValueError(f"expected {config.num_layers} layer trees, got {count}")
    for block, trees in on_device.items():
        result["layers"][block] = _stacked(trees)
    return result


@jax.jit
def _stacked(trees: list[Any]) -> Any:
    # One program for the block (stacked leaf by leaf, each leaf shape compiled its own).
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _on_host(tree: Any) -> bool:
    return all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(tree))


def _fill_layer(stack: np.ndarray, leaf: np.ndarray, *, group: int, layer: int) -> None:
    """Copies layer ``layer``'s ``leaf`` into row ``group`` of its block's ``stack``."""
    if leaf.shape != stack.shape[1:] or leaf.dtype != stack.dtype:
        raise ValueError(
            f"layer {layer} has a {leaf.dtype}{list(leaf.shape)} leaf where the layers before it in its block have "
            f"{stack.dtype}{list(stack.shape[1:])}: layers stacked into one scan must agree"
        )
    stack[group] = leaf


def _holds_layers(node: Any) -> bool:
    return isinstance(node, dict) and any(key == "layers" or key.startswith("group_") for key in node)


def saved_scan_layers(params: Any) -> bool:
    """Whether a parameter tree (or its checkpoint metadata) has the scanned layer layout."""
    return "layers" in params


def convert_layer_layout(tree: Any, source: ModelConfig, target: ModelConfig) -> Any:
    """``tree`` with every parameter-shaped dict in it (the params, and the optimizer moments
    mirroring them) moved from ``source.scan_layers``'s layer layout to ``target``'s.

    Raises:
      ValueError: a parameter-shaped dict holds only some layers (a trainable mask that picks
        individual layers), which has no stacked equivalent.
    """

    def convert(node):
        if not _holds_layers(node):
            return node
        rest = {key: value for key, value in node.items() if key != "layers" and not key.startswith("group_")}
        try:
            layers = layers_to_list(source, node)
        except (KeyError, IndexError):
            raise ValueError(
                "cannot change scan_layers for a tree that holds only some of the layers (a trainable "
                "mask that selects individual layers); keep scan_layers as the run started"
            ) from None
        return {**rest, **layers_from_list(target, layers)}

    return jax.tree.map(convert, tree, is_leaf=_holds_layers)


def saved_layout(config: ModelConfig, saved_params: Any) -> tuple[ModelConfig, Callable[[Any], Any]] | None:
    """``None`` when ``saved_params`` (a parameter tree or its checkpoint metadata) has the layer
    layout of ``config``; otherwise ``(saved_config, convert)``: ``config`` with the saved
    ``scan_layers``, and ``convert(tree)`` moving a tree (params, the optimizer moments or model
    state mirroring them) from that layout to ``config``'s (:func:`convert_layer_layout`)."""
    saved_scan = saved_scan_layers(saved_params)
    if saved_scan == config.scan_layers:
        return None
    saved_config = dataclasses.replace(config, scan_layers=saved_scan)
    return saved_config, lambda tree: convert_layer_layout(tree, saved_config, config)


__all__ = [
    "convert_layer_layout",
    "group_span",
    "layer_location",
    "layers_from_list",
    "layers_to_list",
    "num_groups",
    "saved_layout",
    "saved_scan_layers",
]

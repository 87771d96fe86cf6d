"""Traceable drawing primitives for ``Environment.render`` (uint8 RGB ``[height, width, 3]``).

Every primitive paints a shape by testing each pixel centre against it, so rendering runs
under ``jit``/``vmap`` like the dynamics. Coordinates are pixels, ``x`` right, ``y`` down.
``save_gif`` writes frames with Pillow.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

WHITE = (255, 255, 255)
BLACK = (0, 0, 0)


def canvas(height: int, width: int, color=WHITE) -> jax.Array:
    """A ``[height, width, 3]`` uint8 image filled with ``color``."""
    return jnp.broadcast_to(jnp.asarray(color, jnp.uint8), (height, width, 3))


def _pixel_centres(image: jax.Array) -> tuple[jax.Array, jax.Array]:
    height, width = image.shape[:2]
    ys, xs = jnp.meshgrid(jnp.arange(height) + 0.5, jnp.arange(width) + 0.5, indexing="ij")
    return xs, ys


def paint(image: jax.Array, mask: jax.Array, color) -> jax.Array:
    """``image`` with ``color`` where ``mask`` ([height, width] bool) is true."""
    return jnp.where(mask[..., None], jnp.asarray(color, jnp.uint8), image)


def fill_rect(image, x0, y0, x1, y1, color) -> jax.Array:
    """Axis-aligned rectangle with corners ``(x0, y0)`` and ``(x1, y1)``."""
    xs, ys = _pixel_centres(image)
    return paint(image, (xs >= x0) & (xs <= x1) & (ys >= y0) & (ys <= y1), color)


def fill_circle(image, cx, cy, radius, color) -> jax.Array:
    xs, ys = _pixel_centres(image)
    return paint(image, (xs - cx) ** 2 + (ys - cy) ** 2 <= radius**2, color)


def draw_segment(image, x0, y0, x1, y1, width, color) -> jax.Array:
    """A thick line from ``(x0, y0)`` to ``(x1, y1)`` (capsule of diameter ``width``)."""
    xs, ys = _pixel_centres(image)
    dx, dy = x1 - x0, y1 - y0
    t = jnp.clip(((xs - x0) * dx + (ys - y0) * dy) / jnp.maximum(dx * dx + dy * dy, 1e-9), 0.0, 1.0)
    distance2 = (xs - (x0 + t * dx)) ** 2 + (ys - (y0 + t * dy)) ** 2
    return paint(image, distance2 <= (width / 2) ** 2, color)


def grid_image(cells: jax.Array, palette: Sequence[Sequence[int]], cell_pixels: int) -> jax.Array:
    """Colours a ``[rows, cols]`` grid of palette indices, each cell ``cell_pixels`` wide."""
    rgb = jnp.asarray(np.asarray(palette, np.uint8))[cells]
    return jnp.repeat(jnp.repeat(rgb, cell_pixels, axis=0), cell_pixels, axis=1)


def layered_grid_image(
    layers: Sequence[tuple[jax.Array, Sequence[int]]], background: Sequence[int], cell_pixels: int
) -> jax.Array:
    """A grid image from ``(mask [rows, cols] bool, colour)`` layers drawn in order (later
    layers on top of earlier ones) over ``background``, each cell ``cell_pixels`` wide."""
    index = jnp.zeros(layers[0][0].shape, jnp.int32)
    for colour_index, (mask, _) in enumerate(layers, start=1):
        index = jnp.where(mask, colour_index, index)
    return grid_image(index, [background, *(colour for _, colour in layers)], cell_pixels)


def save_gif(frames, path: str | Path, fps: int = 30) -> Path:
    """Writes ``frames`` (uint8 ``[time, height, width, 3]`` or a sequence of
    ``[height, width, 3]``) as a looping GIF at ``path``; returns the path."""
    from PIL import Image

    array = np.asarray(frames)
    if array.ndim != 4 or array.shape[-1] != 3 or array.shape[0] == 0:
        raise ValueError(f"save_gif: frames must be [time, height, width, 3] with time >= 1, got shape {array.shape}")
    if array.dtype != np.uint8:
        raise ValueError(f"save_gif: frames must be uint8 RGB, got {array.dtype}")
    if fps <= 0:
        raise ValueError(f"save_gif: fps must be positive, got {fps}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    images = [Image.fromarray(frame) for frame in array]
    # GIF whatever the name ends with: Pillow would pick the format from the suffix (an animated
    # PNG for ".png") or refuse a name without one.
    images[0].save(
        path, format="GIF", save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)), loop=0
    )
    return path


__all__ = ["canvas", "draw_segment", "fill_circle", "fill_rect", "grid_image", "paint", "save_gif"]

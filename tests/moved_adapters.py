"""Adapter leaves moved away from their initial values, as training would move them.

At initialisation LoRA's B is zero and DoRA's magnitude is the base weight's column norm, so
an adapted model equals its base: a test of adapters there compares the base with itself.
Each moved leaf gets normal noise keyed by ``seed`` and the leaf's path, so the draw does not
depend on which other leaves the tree holds. Jittable (``seed`` may be traced).
"""

import zlib

import jax

from ember.core.tree import param_paths, tree_from_paths

ADAPTER_FACTORS = ("_lora_a", "_lora_b", "_lora_magnitude")


def adapter_factor(path: str) -> bool:
    """Whether ``path`` names a LoRA factor (A, B) or a DoRA magnitude."""
    return path.endswith(ADAPTER_FACTORS)


def moved(params, seed, scale: float, moves=adapter_factor):
    """``params`` with every leaf whose path ``moves`` accepts plus ``scale`` times normal noise
    (same shapes and dtypes); the other leaves as they are."""
    flat = {}
    for path, value in param_paths(params).items():
        if moves(path):
            key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(path.encode()))
            value = value + scale * jax.random.normal(key, value.shape, value.dtype)
        flat[path] = value
    return tree_from_paths(flat)

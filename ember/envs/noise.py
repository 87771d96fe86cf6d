"""Random numbers as plain uint32 words, drawn once for a whole batch.

An environment states how many random words one reset and one transition consume
(``Environment.reset_noise_words`` / ``transition_noise_words``). ``Environment.reset`` /
``step`` draw them from a key with ``draw``; a batched environment (``ember.envs.BatchedEnv``)
draws the words of every sub-environment with ONE ``draw_batch`` call of shape
``[batch, words]`` instead of splitting one key per environment (the main CPU cost of a
vmapped gymnax step). The other functions turn words into the values the dynamics need.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def draw(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``shape`` random uint32 words from ``key`` (``jax.random.bits``; vmaps well)."""
    return jax.random.bits(key, shape, jnp.uint32)


def draw_batch(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``shape`` random uint32 words from ``key`` in ONE XLA ``RngBitGenerator`` call
    (threefry, seeded with the key's data): several times faster than ``jax.random.bits``
    for large batches on CPU. Meant for a whole batch at once: under ``vmap`` JAX runs it
    as a loop over the mapped axis (fine for a few seeds, slow for thousands of keys)."""
    words = jax.random.key_data(key).ravel().astype(jnp.uint32)
    seed = jnp.concatenate([words, jnp.zeros(4, jnp.uint32)])[:4]
    _, bits = lax.rng_bit_generator(seed, shape, dtype=jnp.uint32, algorithm=lax.RandomAlgorithm.RNG_THREE_FRY)
    return bits


def uniform(words: jax.Array, low=0.0, high=1.0, dtype=None) -> jax.Array:
    """Uniform floats in ``[low, high)``, one per word (23 random mantissa bits each).

    ``dtype`` defaults to JAX's default float (float64 under ``jax.enable_x64``)."""
    dtype = jnp.zeros(()).dtype if dtype is None else dtype
    # Exponent of 1.0 with random mantissa gives a float in [1, 2); minus 1 is exact.
    unit = lax.bitcast_convert_type((words >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    unit = unit.astype(dtype)
    return low + (high - low) * unit


def randint(words: jax.Array, low, high) -> jax.Array:
    """Integers in ``[low, high)`` (``int32``), one per word. The bias is below
    ``(high - low) / 2**32`` -- irrelevant for the small ranges of environments."""
    span = (jnp.asarray(high) - jnp.asarray(low)).astype(jnp.uint32)
    return (jnp.asarray(low) + (words % span).astype(jnp.int32)).astype(jnp.int32)


def bernoulli(words: jax.Array, p) -> jax.Array:
    """``True`` with probability ``p``, one per word."""
    return uniform(words, dtype=jnp.float32) < p


def to_key(words: jax.Array) -> jax.Array:
    """A threefry PRNG key built from two words, for environments that need many or
    variable-size draws (e.g. procedural level generation)."""
    return jax.random.wrap_key_data(words[..., :2], impl="threefry2x32")


__all__ = ["bernoulli", "draw", "draw_batch", "randint", "to_key", "uniform"]

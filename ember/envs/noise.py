"""Random numbers as plain uint32 words, drawn once for a whole batch.

An environment states how many random words one reset and one transition consume
(``Environment.reset_noise_words`` / ``transition_noise_words``). ``Environment.reset`` /
``step`` draw them from a key with ``draw``, a cheap counter-based hash of the key, so a plain
``jax.vmap`` over per-environment keys stays fast (threefry per key was the main CPU cost of a
vmapped gymnax step); a batched environment (``ember.envs.BatchedEnv``) of many
sub-environments draws all their words with ONE ``draw_batch`` call of shape
``[batch, words]``. The other functions turn words into the values the dynamics need.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ember.envs.spaces import default_float


@functools.partial(jax.jit, static_argnames="shape")
def draw(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``shape`` random uint32 words from ``key``: word ``j`` is a counter-based hash of the
    key's two data words and ``j`` (MurmurHash3's 32-bit finaliser over a Weyl sequence).
    Jitted, ``shape`` (a tuple) static: an eager ``reset``/``step`` outside ``jax.jit`` runs
    it as one compiled program per shape, not op by op.

    A few integer multiplies per word, so a ``jax.vmap`` over thousands of per-environment
    keys (how gymnax users step environments) costs little, where ``jax.random.bits`` runs the
    20 rounds of threefry per key; and, unlike ``lax.rng_bit_generator`` under ``vmap`` (which
    draws every row from the first key), each key's words depend on that key alone. The keys
    are threefry outputs, so the hashed words are as uniform as environment randomness needs
    (initial states, spawns, sticky actions); not meant for cryptography or for long streams
    (use ``to_key`` and ``jax.random`` for those)."""
    data = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
    size = math.prod(shape)
    counters = jnp.arange(size, dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    return _fmix32(data[0] ^ _fmix32(data[-1] + counters)).reshape(shape)


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection of uint32 with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def draw_batch(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``shape`` random uint32 words from ``key`` in ONE XLA ``RngBitGenerator`` call
    (threefry, seeded with the key's data): several times faster than ``jax.random.bits``
    for large batches on CPU. Meant for a whole batch at once. Under ``jax.vmap`` over keys
    (several seeds of one run) it draws key by key in a ``lax.map``, so each row equals a
    separate call with that row's key (JAX's own batching of ``rng_bit_generator`` would
    seed every row from the first key); fine for a few seeds, slow for thousands of keys."""
    words = jax.random.key_data(key).ravel().astype(jnp.uint32)
    seed = jnp.concatenate([words, jnp.zeros(4, jnp.uint32)])[:4]
    return _threefry_bits(tuple(shape))(seed)


@functools.cache
def _threefry_bits(shape: tuple[int, ...]):
    """``seed [4] -> shape`` words from ``RngBitGenerator``, drawn seed by seed under ``vmap``."""

    @jax.custom_batching.custom_vmap
    def bits(seed: jax.Array) -> jax.Array:
        _, out = lax.rng_bit_generator(seed, shape, dtype=jnp.uint32, algorithm=lax.RandomAlgorithm.RNG_THREE_FRY)
        return out

    @bits.def_vmap
    def _bits_per_seed(axis_size, in_batched, seed):
        del axis_size, in_batched  # the only argument is the batched one
        return lax.map(bits, seed), True

    return bits


def uniform(words: jax.Array, low=0.0, high=1.0, dtype=None) -> jax.Array:
    """Uniform floats in ``[low, high)``, one per word (23 random mantissa bits each).

    ``dtype`` defaults to JAX's default float (float64 under ``jax.enable_x64``)."""
    dtype = default_float() if dtype is None else dtype
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

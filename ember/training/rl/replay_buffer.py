"""A uniform replay buffer that lives on device: a circular array per leaf of a transition
pytree, added to and sampled from inside ``jit``.

    buffer = replay_buffer_init(example_transition, capacity=10_000)
    buffer = replay_buffer_add(buffer, transitions)         # leaves [n, ...]
    batch = replay_buffer_sample(buffer, key, batch_size)   # leaves [batch_size, ...]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class ReplayBuffer:
    """``data``: the transition pytree with leaves ``[capacity, ...]``; ``position``: where the
    next item is written; ``size``: how many items are stored (at most ``capacity``)."""

    data: Any
    position: jax.Array
    size: jax.Array

    @property
    def capacity(self) -> int:
        return jax.tree.leaves(self.data)[0].shape[0]


def replay_buffer_init(example: Any, capacity: int) -> ReplayBuffer:
    """An empty buffer for transitions shaped like ``example`` (one transition, no batch axis)."""
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
    data = jax.tree.map(lambda leaf: jnp.zeros((capacity, *jnp.shape(leaf)), jnp.asarray(leaf).dtype), example)
    return ReplayBuffer(data, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def replay_buffer_add(buffer: ReplayBuffer, transitions: Any) -> ReplayBuffer:
    """Writes ``n`` transitions (leaves ``[n, ...]``, ``n <= capacity``) after the newest,
    overwriting the oldest once full."""
    capacity = buffer.capacity
    count = jax.tree.leaves(transitions)[0].shape[0]
    if count > capacity:
        raise ValueError(f"cannot add {count} transitions at once to a buffer of capacity {capacity}")
    indices = (buffer.position + jnp.arange(count)) % capacity
    data = jax.tree.map(lambda stored, new: stored.at[indices].set(new.astype(stored.dtype)), buffer.data, transitions)
    return ReplayBuffer(data, (buffer.position + count) % capacity, jnp.minimum(buffer.size + count, capacity))


def replay_buffer_sample(buffer: ReplayBuffer, key: jax.Array, batch_size: int) -> Any:
    """``batch_size`` transitions drawn uniformly with replacement from the stored ones
    (the buffer must hold at least one)."""
    indices = jax.random.randint(key, (batch_size,), 0, jnp.maximum(buffer.size, 1))
    return jax.tree.map(lambda stored: stored[indices], buffer.data)


__all__ = ["ReplayBuffer", "replay_buffer_add", "replay_buffer_init", "replay_buffer_sample"]

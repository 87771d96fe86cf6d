"""Document boundaries from ``segment_ids`` for the recurrent ops (linear attention, SSD,
short convolution): a state is reset wherever the segment id changes between neighbours.

Boundaries are changes, not id values, so ids may repeat (``[3, 3, 1, 1, 3]`` is three
documents), and the first position never starts a new document: a state passed in with
``initial_state`` belongs to the call's first document.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def document_starts(segment_ids: jax.Array | None, batch: int, seq: int) -> jax.Array:
    """``[batch, seq]`` bool: True where the segment id differs from the previous position's."""
    if segment_ids is None:
        return jnp.zeros((batch, seq), bool)
    return jnp.concatenate([jnp.zeros((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def document_index(segment_ids: jax.Array | None, batch: int, seq: int) -> jax.Array:
    """``[batch, seq]`` int32: how many document starts lie at or before each position (0
    for the first document); positions interact only with equal indices."""
    return jnp.cumsum(document_starts(segment_ids, batch, seq).astype(jnp.int32), axis=1)

"""A training batch with padding (segment id 0, as Ember's packers pad) and the same documents
packed into one row without any, for tests that padding changes nothing for the real tokens."""

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

# Two rows: one document then padding; two documents then padding.
SEGMENTS = np.array([[1] * 7 + [0] * 3, [1] * 4 + [2] * 4 + [0] * 2], np.int32)


@dataclass(frozen=True)
class PaddedAndCompact:
    """``padded``: ``(tokens, positions, segment_ids)`` ``[2, 10]``; ``compact``: the same real
    tokens in order in one row ``[1, 15]``; ``real``: bool ``[2, 10]``, the padded batch's real
    tokens (``padded_tokens[real]`` is ``compact_tokens[0]``)."""

    padded: tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]
    compact: tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]
    real: np.ndarray


def padded_and_compact(vocab_size: int, seed: int = 0) -> PaddedAndCompact:
    generator = np.random.default_rng(seed)
    tokens = generator.integers(1, vocab_size, SEGMENTS.shape).astype(np.int32)
    real = SEGMENTS > 0
    positions = np.zeros_like(SEGMENTS)
    for row in range(SEGMENTS.shape[0]):
        for segment in np.unique(SEGMENTS[row]):
            where = SEGMENTS[row] == segment
            positions[row, where] = np.arange(where.sum())
    # Each document keeps its own id in the single row: row 1's documents become 2 and 3.
    compact_segments = (SEGMENTS + np.array([[0], [1]]))[real]
    compact = (tokens[real][None], positions[real][None], compact_segments[None])
    padded = (tokens, positions, SEGMENTS)
    return PaddedAndCompact(tuple(jnp.asarray(a) for a in padded), tuple(jnp.asarray(a) for a in compact), real)

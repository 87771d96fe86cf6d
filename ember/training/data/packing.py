"""Packing a window of the token stream into one training row, documents kept apart.

The token stream is documents back to back, each ending in the end-of-document id. A row
is ``seq_len + 1`` consecutive stream tokens: inputs are the first ``seq_len``, targets the
last ``seq_len``. Every input token gets the id of the document it belongs to (its segment,
numbered from 1 within the row) and its position within that document, so attention masked
by segment never crosses documents and rotary positions restart at each document. A target
that starts the next document is not predictable from the row's context: its loss is masked.
"""

from __future__ import annotations

import numpy as np


def pack_window(window: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """One packed row from ``window`` ``[seq_len + 1]`` stream tokens.

    Returns:
      ``tokens``, ``targets`` (int32), ``segment_ids`` (int32, from 1), ``positions``
      (int32, from 0 at each document start) and ``loss_mask`` (float32), each ``[seq_len]``.
    """
    window = np.asarray(window)
    if window.ndim != 1 or window.size < 2:
        raise ValueError(f"window must be a 1-D array of at least 2 tokens, got shape {window.shape}")
    tokens = window[:-1].astype(np.int32)
    targets = window[1:].astype(np.int32)
    ends = tokens == eos_id
    # A token belongs to the document that the end-of-document tokens before it have closed.
    segment_ids = 1 + np.concatenate([[0], np.cumsum(ends[:-1])]).astype(np.int32)
    starts = np.concatenate([[True], ends[:-1]])
    start_index = np.maximum.accumulate(np.where(starts, np.arange(tokens.size), 0))
    positions = (np.arange(tokens.size) - start_index).astype(np.int32)
    loss_mask = (~ends).astype(np.float32)
    return {
        "tokens": tokens,
        "targets": targets,
        "segment_ids": segment_ids,
        "positions": positions,
        "loss_mask": loss_mask,
    }


def empty_row(seq_len: int) -> dict[str, np.ndarray]:
    """A row of padding, as :func:`pack_window`'s rows are laid out: every id 0 and no loss,
    for filling the last batch of an evaluation pass."""
    ints = {name: np.zeros(seq_len, np.int32) for name in ("tokens", "targets", "segment_ids", "positions")}
    return {**ints, "loss_mask": np.zeros(seq_len, np.float32)}

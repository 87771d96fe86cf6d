"""A deterministic, resumable batch iterator over a token stream, sharded by process.

The stream is cut into ``(len - 1) // seq_len`` windows of ``seq_len + 1`` tokens (adjacent
windows share one token, so every target is used once per epoch). Each epoch visits the
windows in a permutation seeded by ``(seed, epoch)``. The iterator's whole state is the
number of examples consumed so far, which the trainer saves in its checkpoint: restoring it
reproduces the uninterrupted sequence of batches exactly. With several processes, each one
reads only its own rows of every global batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ember.core.errors import ConfigError, DataError
from ember.core.tokenizer import ByteTokenizer
from ember.training.data.packing import empty_row, pack_window


def check_process_split(global_batch: int, process_count: int, batch_key: str) -> None:
    """Raises ``ConfigError`` (keyed ``batch_key``) when a global batch of ``global_batch`` rows
    does not split into equal shares over ``process_count`` processes (each reads its own)."""
    if global_batch % process_count:
        raise ConfigError(
            f"{batch_key} ({global_batch}) is not divisible by the {process_count} processes: each process reads "
            f"an equal share of every global batch, so {batch_key} must be a multiple of {process_count}",
            key=batch_key,
        )


class PackedBatches:
    """Packed ``[local_batch, seq_len]`` batches from a token stream.

    Args:
      stream: 1-D token ids (typically a ``np.memmap`` from ``TokenDataset``).
      seq_len: tokens per row.
      global_batch: rows per step across all processes.
      seed: the shuffling seed; ``shuffle=False`` visits windows in order (for evaluation).
      process_index, process_count: this process's share of every global batch.
      batch_key: the config key ``global_batch`` comes from, for the error when it does not
        split over the processes.
    """

    def __init__(
        self,
        stream: np.ndarray,
        *,
        seq_len: int,
        global_batch: int,
        seed: int = 0,
        shuffle: bool = True,
        eos_id: int = ByteTokenizer.eos_id,
        process_index: int = 0,
        process_count: int = 1,
        batch_key: str = "train.batch_size",
    ):
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len and global_batch must be positive, got {seq_len} and {global_batch}")
        check_process_split(global_batch, process_count, batch_key)
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} is outside [0, {process_count})")
        self.num_windows = (len(stream) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"the stream holds {len(stream)} tokens, too few for one row of seq_len={seq_len}")
        self.stream, self.seq_len, self.global_batch = stream, seq_len, global_batch
        self.seed, self.shuffle, self.eos_id = seed, shuffle, eos_id
        self.local_batch = global_batch // process_count
        self.row_offset = process_index * self.local_batch
        self.examples_seen = 0
        self._order_epoch, self._order = -1, np.empty(0, np.int64)

    def state(self) -> dict[str, Any]:
        """The iterator position, JSON-serialisable (saved with checkpoints)."""
        return {
            "examples_seen": self.examples_seen,
            "num_windows": self.num_windows,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continues from a saved ``state``; raises ``ConfigError`` if the data or shapes changed."""
        for key in ("seq_len", "global_batch", "seed", "num_windows"):
            if state[key] != getattr(self, key):
                raise ConfigError(f"cannot resume data iterator: saved {key}={state[key]} but now {getattr(self, key)}")
        self.examples_seen = int(state["examples_seen"])

    def next(self) -> dict[str, np.ndarray]:
        """The next batch: ``tokens``, ``targets``, ``segment_ids``, ``positions``, ``loss_mask``,
        each ``[local_batch, seq_len]``."""
        first = self.examples_seen + self.row_offset
        rows = [pack_window(self._window(first + i), self.eos_id) for i in range(self.local_batch)]
        self.examples_seen += self.global_batch
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}

    def epoch(self, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """One pass over the windows in order, at most ``max_batches`` global batches, the last
        one padded with empty rows (no loss): each window counts once, however few there are
        (``next`` wraps around into the next epoch). For evaluation: ``shuffle=False``."""
        count = -(-self.num_windows // self.global_batch)
        for first in range(0, min(count, max_batches or count) * self.global_batch, self.global_batch):
            rows = [
                pack_window(self._window(example), self.eos_id)
                if example < self.num_windows
                else empty_row(self.seq_len)
                for example in range(first + self.row_offset, first + self.row_offset + self.local_batch)
            ]
            yield {key: np.stack([row[key] for row in rows]) for key in rows[0]}

    def _window(self, example: int) -> np.ndarray:
        epoch, index = divmod(example, self.num_windows)
        start = self._window_order(epoch)[index] * self.seq_len
        return np.asarray(self.stream[start : start + self.seq_len + 1])

    def _window_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            else:
                self._order = np.arange(self.num_windows)
            self._order_epoch = epoch
        return self._order

"""Held-out token windows and their next-token loss, as ``ember quantize`` and ``ember eval`` use them.

A token stream is cut into non-overlapping windows of ``seq_len + 1`` tokens,
``[n, seq_len + 1]``: a window's first ``seq_len`` tokens are the model's input and its last
``seq_len`` the targets, so the first token of each window is context only, never predicted.
(The trainer's ``val_loss`` differs: its windows share one token and are packed with segment
ids at end-of-document tokens.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ember.core.config import from_yaml, run_kind
from ember.core.errors import ConfigError, DataError
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.training.lm.config import BUILTIN_DATASETS, LMConfig
from ember.training.task import next_token_loss


def run_dataset(source: str | Path) -> Path | None:
    """The directory of the prepared dataset the Ember LM run in ``source`` trained on (its
    config.yaml's ``data``: a built-in corpus, such as ``arithmetic`` with its settings, or a
    directory); ``None`` for any other model (another kind of run, a Hugging Face directory)."""
    config = Path(source) / "config.yaml"
    if not config.is_file() or run_kind(source) not in (None, "lm"):
        return None
    data = from_yaml(LMConfig, config.read_text()).data
    return BUILTIN_DATASETS.get(data.dataset, lambda _: Path(data.dataset))(data)


def check_seq_len(seq_len: int, config: ModelConfig) -> None:
    """Raises ``ConfigError`` (keyed ``seq_len``) for windows longer than the model's
    ``max_seq_len`` (as ``train.seq_len``: positions the model never saw)."""
    if seq_len > config.max_seq_len:
        raise ConfigError(
            f"seq_len ({seq_len}) exceeds the model's max_seq_len ({config.max_seq_len}); "
            f"give --seq-len {config.max_seq_len} or less",
            key="seq_len",
        )


def cut_windows(ids: np.ndarray, count: int, seq_len: int, source: str) -> np.ndarray:
    """The first ``min(count, len(ids) // (seq_len + 1))`` windows of the stream ``ids``,
    ``[n, seq_len + 1]`` int32. Raises ``DataError`` naming ``source`` when not one fits."""
    available = len(ids) // (seq_len + 1)
    if available < 1:
        raise DataError(
            f"{source} has {len(ids)} tokens, fewer than one window of {seq_len + 1}; "
            "give a longer text with --text, or a smaller --seq-len"
        )
    count = min(count, available)
    return np.asarray(ids[: count * (seq_len + 1)]).reshape(count, seq_len + 1).astype(np.int32)


def device_batches(windows: np.ndarray, batch_size: int) -> Iterator[jax.Array]:
    """``windows`` in batches of ``batch_size`` rows (the last may be smaller), on the device."""
    for start in range(0, len(windows), batch_size):
        yield jax.device_put(windows[start : start + batch_size])  # a copy: jnp.asarray compiles a program per shape


def window_loss(model: DecoderLM, variables: dict[str, Any], windows: jax.Array) -> tuple[jax.Array, ...]:
    """``(logits [b, seq_len, vocab], summed next-token loss, count)`` of ``model`` with
    ``variables`` on ``windows [b, seq_len + 1]``: every window's last ``seq_len`` tokens
    predicted from the tokens before them (float32 sums, ``next_token_loss``)."""
    logits, _ = model.apply(variables, windows[:, :-1])
    loss, count = next_token_loss(logits, windows[:, 1:], jnp.ones(windows[:, 1:].shape))
    return logits, loss, count


__all__ = ["check_seq_len", "cut_windows", "device_batches", "run_dataset", "window_loss"]

"""The loss of a language model on a text: ``ember eval MODEL --text FILE`` (``evaluate_command``).

Definitions (what ``evaluate_tokens`` reports):

- **Text.** A UTF-8 file read as one document, or a ``.jsonl`` file of ``{"text": ...}`` lines,
  one document each. A document is tokenized by the model's own tokenizer as
  ``tokenizer.encode`` does (with the tokenizer's special tokens: a Hugging Face tokenizer's
  BOS); in a JSONL file each document is followed by the end-of-document id, as
  ``ember data prepare`` writes documents, and the documents' tokens are concatenated. Without
  a text, a byte-level model reads the validation split of the prepared dataset of the Ember
  LM run it is or descends from (:func:`lineage_dataset`: a quantized model's source, a
  fine-tuned or linearised run's base; the dataset found as ``ember quantize`` finds it,
  ``eval_windows.run_dataset``), so a run and its quantized, fine-tuned and linearised
  versions are held to the same text; the stdlib corpus for a byte-level model with none.
- **Windows.** The token stream is cut into non-overlapping windows of ``seq_len + 1`` tokens
  from its start (``eval_windows.cut_windows``; at most ``max_windows``; a remainder shorter
  than a window is left out). In each window tokens ``1 .. seq_len`` are predicted from the
  tokens before them in that window; token 0 is context only and never predicted.
- **loss**: the mean next-token cross-entropy over every predicted token, in nats per token;
  **perplexity** ``exp(loss)``; **tokens**: the number of predicted tokens, ``windows * seq_len``.
- **bits_per_byte**: the summed loss of the predicted tokens / ln 2 / the UTF-8 bytes of the
  text those tokens cover. A window's predicted tokens cover the text from the end of its first
  token to the end of its last (per the tokenizer's character offsets; a special token such as
  BOS or end-of-document covers no bytes), so the bytes counted are those the predicted tokens
  spell (each window's first token's bytes are not counted, as its loss is not), and the figure
  is per byte of text whatever the tokenization: comparable between a byte-level and a BPE
  model. For a byte-level model every predicted byte token covers one byte. Tokens that share a
  character (byte-fallback pieces of one character) end where the character does. ``None`` when
  the predicted tokens cover no bytes.

The windows are not the trainer's ``val_loss`` windows (those share a token and are packed with
segment ids, see ``eval_windows``); on the same windows the loss is ``ember quantize``'s
``float_val_loss``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ember.core.config import read_key, run_kind
from ember.core.errors import DataError, PathNotFoundError
from ember.core.jsonl import jsonl_records, readable, utf8_text
from ember.core.tokenizer import BYTE_VOCAB, ByteTokenizer
from ember.models.decoder import DecoderLM
from ember.models.variables import as_variables
from ember.serving.loading import LoadedModel
from ember.training.data import TokenDataset, stdlib_corpus_dir
from ember.training.lm.eval_windows import cut_windows, device_batches, run_dataset, window_loss


@dataclasses.dataclass(frozen=True)
class TokenText:
    """A token stream and where each token ends in the text: ``ids [n]`` and ``byte_ends [n]``,
    the UTF-8 byte offset just past the token's text (non-decreasing; a special token's is the
    one before it), so tokens ``i+1 .. j`` cover ``byte_ends[j] - byte_ends[i]`` bytes."""

    ids: np.ndarray
    byte_ends: np.ndarray
    source: str


@dataclasses.dataclass(frozen=True)
class Documents:
    """The documents of a ``--text`` file; ``ended``: each is followed by the end-of-document id
    (a JSONL file's documents, as ``ember data prepare`` writes them)."""

    texts: list[str]
    ended: bool
    source: str


def read_documents(path: str | Path) -> Documents:
    """The text file (one document) or ``.jsonl`` file of ``{"text": ...}`` lines at ``path``.
    Raises ``PathNotFoundError`` (no such file) or ``DataError`` (not UTF-8, a JSONL line that is
    no ``{"text": string}``, no document)."""
    path = Path(path)
    if not readable(path):  # a file or a pipe
        raise PathNotFoundError(f"--text: no such file: {path}")
    if path.suffix != ".jsonl":
        return Documents([utf8_text(path, "--text: ")], False, str(path))
    texts = list(_jsonl_texts(path))
    if not texts:
        raise DataError(f"--text: {path} holds no JSONL line")
    return Documents(texts, True, str(path))


def tokenized(documents: Documents, tokenizer: Any) -> TokenText:
    """The documents' tokens with ``tokenizer``, concatenated (see the module docstring)."""
    if tokenizer is None:
        raise DataError("the model has no tokenizer (a Hugging Face directory without tokenizer.json) to read --text")
    ids, offsets, total = [], [], 0
    for text in documents.texts:
        piece_ids, piece_ends, piece_bytes = _encoded(tokenizer, text, end_of_document=documents.ended)
        ids.append(piece_ids)
        offsets.append(piece_ends + total)
        total += piece_bytes
    return TokenText(np.concatenate(ids), np.concatenate(offsets), documents.source)


def dataset_split(dataset: str | Path | None, need: int | None) -> TokenText:
    """The first ``need`` tokens (all: ``None``) of the validation split of the prepared byte-level
    ``dataset`` directory (default: the stdlib corpus); each byte token covers one byte."""
    prepared = TokenDataset.open(stdlib_corpus_dir() if dataset is None else dataset)
    ids = np.asarray(prepared.val[:need])
    return TokenText(ids, np.cumsum(ids < BYTE_VOCAB), f"the validation split of {prepared.directory}")


def _jsonl_texts(path: Path) -> Iterable[str]:
    for record, where in jsonl_records(path, "--text: "):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'--text: {where} is not a {{"text": string}} object')
        yield record["text"]


def _encoded(tokenizer: Any, text: str, *, end_of_document: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """``(ids, byte_ends, bytes of text)`` of one document (byte ends from the document's start)."""
    codepoints = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    char_bytes = 1 + (codepoints >= 0x80) + (codepoints >= 0x800) + (codepoints >= 0x10000)
    char_starts = np.concatenate([[0], np.cumsum(char_bytes, dtype=np.int64)])
    if hasattr(tokenizer, "encode_offsets"):  # a Hugging Face tokenizer: character offsets
        ids, offsets = tokenizer.encode_offsets(text, add_special_tokens=True)
        ends = np.maximum.accumulate(char_starts[offsets[:, 1]]) if len(ids) else np.zeros(0, np.int64)
    else:
        ids = tokenizer.encode(text)
        ends = np.cumsum(np.asarray(ids) < BYTE_VOCAB, dtype=np.int64)
    eos = getattr(tokenizer, "eos_id", None)
    if end_of_document and eos is not None:
        ids, ends = np.append(ids, eos), np.append(ends, ends[-1] if len(ends) else 0)
    return np.asarray(ids, np.int64), ends, int(char_starts[-1])


def lineage_dataset(model: str | Path) -> Path | None:
    """The prepared dataset of the Ember LM run that ``model`` is (``run_dataset``) or descends
    from: a quantized model's ``source``, a fine-tuned, GRPO or linearising run's
    ``base_model.path``, followed back to an LM run; ``None`` when the line ends elsewhere (a
    Hugging Face directory, a path that no longer exists)."""
    model = Path(model)
    kind = run_kind(model)
    if kind == "quantized":
        parent = read_key(model / "config.yaml", "source")
    elif kind in ("finetune", "grpo", "linearize"):
        parent = (read_key(model / "config.yaml", "base_model") or {}).get("path")
    else:
        return run_dataset(model)
    return lineage_dataset(parent) if parent is not None and Path(parent).is_dir() else None


def default_text(loaded: LoadedModel, dataset: Path | None, need: int | None) -> TokenText:
    """The text a model is evaluated on when ``--text`` is not given: for a byte-level model the
    validation split of ``dataset`` (:func:`lineage_dataset`, see :func:`dataset_split`)."""
    if not isinstance(loaded.tokenizer, ByteTokenizer):
        raise DataError(
            "the model reads text with a Hugging Face tokenizer and has no validation split of its own "
            "(one is found only for a byte-level Ember LM run); give the text with --text FILE"
        )
    return dataset_split(dataset, need)


def evaluate_tokens(
    loaded: LoadedModel,
    text: TokenText,
    *,
    seq_len: int,
    batch_size: int,
    max_windows: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """The figures of the module docstring for ``loaded`` on ``text``: ``loss``, ``perplexity``,
    ``bits_per_byte``, ``tokens``, ``bytes``, ``windows``, ``seq_len`` and the text's ``source``."""
    from tqdm import tqdm

    count = max_windows if max_windows is not None else len(text.ids)
    windows = cut_windows(text.ids, count, seq_len, text.source)
    if windows.max() >= loaded.config.vocab_size:  # an embedding lookup past the table is no error in JAX
        raise DataError(
            f"{text.source} holds token id {windows.max()}, past the model's vocab_size ({loaded.config.vocab_size}): "
            "its tokenizer has tokens the model has no embedding for"
        )
    ends = text.byte_ends[: windows.size].reshape(windows.shape)
    covered = int(np.sum(ends[:, -1] - ends[:, 0]))
    model, variables = DecoderLM(loaded.config), as_variables(loaded.params)
    sums = jax.jit(lambda variables, batch: window_loss(model, variables, batch)[1:])
    total_loss, total_count = 0.0, 0.0
    batches = tqdm(
        device_batches(windows, batch_size), total=-(-len(windows) // batch_size), unit="batch", disable=not progress
    )
    for batch in batches:
        loss, count = sums(variables, batch)
        total_loss, total_count = total_loss + float(loss), total_count + float(count)
    mean = total_loss / total_count
    return {
        "loss": mean,
        "perplexity": math.exp(mean) if mean < 700 else math.inf,
        "bits_per_byte": total_loss / math.log(2) / covered if covered else None,
        "tokens": int(total_count),
        "bytes": covered,
        "windows": len(windows),
        "seq_len": seq_len,
        "text": text.source,
    }


__all__ = [
    "Documents",
    "TokenText",
    "dataset_split",
    "default_text",
    "evaluate_tokens",
    "lineage_dataset",
    "read_documents",
    "tokenized",
]

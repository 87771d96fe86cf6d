"""Documents -> memory-mapped token files on disk, and reading them back.

A prepared dataset directory holds ``train.bin`` and ``val.bin`` (token ids, each document
followed by the tokenizer's end-of-document id: uint16 for vocabularies of up to 65,536 ids,
uint32 for larger ones such as Llama-3's or Qwen2's) and ``meta.json`` (the preparation
format, tokenizer description, id dtype, token and document counts, and a fingerprint of the
sources). Files are written under a temporary name and renamed, so an interrupted preparation
never leaves a dataset that looks complete.

``TokenDataset.open`` reads a directory whatever format its metadata records, or none (one
prepared before the format was recorded): a user's dataset keeps opening across Ember
versions. Only the built-in corpora's caches are keyed by the format and prepared again when
it changes (``ember.training.data.corpus_cache``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ember.core.errors import ConfigError, DataError, PathNotFoundError
from ember.core.files import PARTIAL_SUFFIX, write_text_atomic
from ember.core.tokenizer import ByteTokenizer, tokenizer_from_description

TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.uint32))
"""The id dtypes of token files, narrowest first; directories without ``token_dtype`` in
their metadata (written before uint32) hold uint16."""
META_FILE = "meta.json"
PREPARATION_FORMAT = 1
"""How Ember turns documents into token files, recorded as ``format`` in ``meta.json``. Bump it
with any change that makes the same documents prepare into other files: the files or their
metadata here, the validation split rule, the byte tokenizer's ids beyond what its
``describe()`` shows, or the documents a built-in corpus generates (``corpus.py``,
``arithmetic.py``); the built-in corpora cached by an older format are then prepared again.
``PREPARED`` in tests/training/test_lm_data.py pins what each format makes of a small
arithmetic corpus, so a change that forgets the bump fails there."""
SPLITS = ("train", "val")


def validation_split(name: str, val_fraction: float) -> bool:
    """Whether the document called ``name`` belongs to the validation split.

    Decided by a hash of the name, so the split is fixed whatever the order or number of
    documents (adding a file never moves another across the split).
    """
    return (zlib.crc32(name.encode("utf-8")) % 10_000) < val_fraction * 10_000


def prepare_token_files(
    documents: Iterable[tuple[str, str]],
    out_dir: str | Path,
    *,
    val_fraction: float = 0.02,
    tokenizer: Any = None,
) -> dict:
    """Tokenizes ``(name, text)`` documents into ``out_dir`` with ``tokenizer`` (``encode``,
    ``describe``, ``vocab_size``; default Ember's byte tokenizer); returns the metadata written.

    Raises:
      ConfigError: ``val_fraction`` is outside [0, 1). DataError: no document has any text, the
        vocabulary does not fit uint32 ids, or the tokenizer has no end-of-document id
        (documents would run together, and training would attend across them).
    """
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}", key="val_fraction")
    tokenizer = tokenizer or ByteTokenizer()
    if getattr(tokenizer, "eos_id", None) is None:
        raise DataError(
            "the tokenizer has no end-of-document id (eos_token), which the token files put after every "
            "document; name one as eos_token in the model directory's tokenizer_config.json"
        )
    dtype = next((d for d in TOKEN_DTYPES if tokenizer.vocab_size <= np.iinfo(d).max + 1), None)
    if dtype is None:
        raise DataError(
            f"token files hold ids of at most {np.iinfo(TOKEN_DTYPES[-1]).bits} bits; this tokenizer has "
            f"{tokenizer.vocab_size} ids"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fingerprint = hashlib.sha256()
    counts = {split: {"tokens": 0, "documents": 0} for split in SPLITS}
    # Names of this call's own: processes of one run preparing a shared cache at once (each
    # process opens the stdlib corpus) each write whole files and rename them into place.
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    temporary = {split: out_dir / f".{split}.bin.{tag}{PARTIAL_SUFFIX}" for split in SPLITS}
    handles = {split: open(path, "wb") for split, path in temporary.items()}
    try:
        for name, text in documents:
            if not text:
                continue
            split = "val" if validation_split(name, val_fraction) else "train"
            ids = tokenizer.encode(text, add_eos=True)
            handles[split].write(ids.astype(dtype).tobytes())
            counts[split]["tokens"] += int(ids.size)
            counts[split]["documents"] += 1
            fingerprint.update(name.encode("utf-8") + b"\0" + hashlib.sha256(ids.tobytes()).digest())
    finally:
        for handle in handles.values():
            handle.close()
    if counts["train"]["tokens"] == 0:
        for path in temporary.values():
            path.unlink(missing_ok=True)
        raise DataError("no text to prepare: every document was empty or went to validation")
    for split, path in temporary.items():
        os.replace(path, out_dir / f"{split}.bin")
    meta = {
        "format": PREPARATION_FORMAT,
        "tokenizer": tokenizer.describe(),
        "token_dtype": dtype.name,
        "splits": counts,
        "fingerprint": fingerprint.hexdigest(),
        "val_fraction": val_fraction,
    }
    write_text_atomic(out_dir / META_FILE, json.dumps(meta, indent=2) + "\n")
    return meta


@dataclasses.dataclass(frozen=True)
class TokenDataset:
    """A prepared dataset: ``train`` and ``val`` token arrays (memory-mapped) and metadata."""

    directory: Path
    train: np.ndarray
    val: np.ndarray
    meta: dict

    @classmethod
    def open(cls, directory: str | Path) -> TokenDataset:
        directory = Path(directory)
        meta_path = directory / META_FILE
        if not meta_path.is_file():
            raise PathNotFoundError(
                f"{directory} is not a prepared dataset (no {META_FILE}); create one with "
                "'ember data prepare TEXT_FILES... --out DIR'"
            )
        try:
            meta = json.loads(meta_path.read_text())
            counts = {split: int(meta["splits"][split]["tokens"]) for split in SPLITS}
            dtype = np.dtype(meta.get("token_dtype", "uint16"))
            if dtype not in TOKEN_DTYPES:
                raise ValueError(f"token_dtype {dtype.name} is not one of uint16, uint32")
        except (ValueError, KeyError, TypeError) as error:  # JSONDecodeError is a ValueError
            raise DataError(
                f"{meta_path} is not the metadata 'ember data prepare' writes ({type(error).__name__}: {error}); "
                "prepare the directory again"
            ) from None
        arrays = {}
        for split in SPLITS:
            expected = counts[split]
            path = directory / f"{split}.bin"
            # The size is checked before mapping: np.memmap refuses an empty file, or one that ends
            # in part of an id, with a bare ValueError.
            tokens, extra = divmod(path.stat().st_size if path.is_file() else 0, dtype.itemsize)
            if (tokens, extra) != (expected, 0):
                held = f"{tokens} tokens" + (f" and {extra} byte(s) of another" if extra else "")
                raise DataError(f"{path} holds {held} but {META_FILE} says {expected}; prepare the directory again")
            arrays[split] = np.memmap(path, dtype=dtype, mode="r") if expected else np.zeros(0, dtype)
        return cls(directory, arrays["train"], arrays["val"], meta)

    @property
    def tokenizer(self) -> ByteTokenizer:
        return tokenizer_from_description(self.meta["tokenizer"])

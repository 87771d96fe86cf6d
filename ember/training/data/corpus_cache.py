"""Built-in corpora, prepared once into Ember's cache and reused, keyed by how they were prepared.

    directory = cached_corpus("python-stdlib-3.11.9", stdlib_documents)

A built-in corpus (``stdlib``, ``arithmetic``) lives in ``<cache>/corpora/<name>-<key>``
(``<cache>``: ``ember.core.cache_dir.ember_cache_dir``). ``name`` says what the corpus holds
(its source and generation arguments); ``key`` is a digest of how Ember prepared it: the
preparation format (``token_files.PREPARATION_FORMAT``), the tokenizer's ``describe()`` (the
byte tokenizer's too, so a change of its vocabulary or end-of-document id prepares again) and
the validation fraction. A directory is reused only when its ``meta.json`` records exactly that
preparation; one that records another (or no) format, another tokenizer, or that has no
readable ``meta.json`` (a preparation interrupted before its last rename) is prepared again.

Another Ember version's preparations have another key, so they stay in their own directories,
untouched: a process of that version may be reading them. A directory is only ever prepared
again at its own key's name, which no process reads while its ``meta.json`` records another
preparation; processes preparing it at once (those of one run) each write the same files and
rename them into place whole. To reclaim the space of stale directories, ``ember data cache``
lists every directory with its size and whether this Ember reads it (``is_current``), and
``ember data cache prune`` deletes the stale ones, leaving any written in the last minutes
(``ember.training.data.cache_scan``).

Only these caches are keyed: a directory a user prepared (``ember data prepare``) opens with
``TokenDataset.open`` whatever format it records, or none.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ember.core.cache_dir import ember_cache_dir
from ember.core.tokenizer import ByteTokenizer
from ember.training.data.token_files import META_FILE, PREPARATION_FORMAT, prepare_token_files

CORPORA_DIR = "corpora"
"""The subdirectory of Ember's cache that holds the prepared built-in corpora."""


def cached_corpus(
    name: str,
    documents: Callable[[], Iterable[tuple[str, str]]],
    *,
    cache_dir: str | Path | None = None,
    tokenizer: Any = None,
    val_fraction: float = 0.02,
) -> Path:
    """The directory of corpus ``name`` prepared from ``documents()`` (``(name, text)`` pairs,
    only called when the corpus must be prepared) with ``tokenizer`` (default: Ember's byte
    tokenizer) and ``val_fraction``, preparing it unless this preparation is already cached."""
    tokenizer = tokenizer or ByteTokenizer()
    recipe = {**_this_format(), "tokenizer": tokenizer.describe(), "val_fraction": val_fraction}
    recipe = json.loads(json.dumps(recipe))  # as meta.json holds it back: a tuple in a description reads as a list
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    directory = ember_cache_dir(cache_dir) / CORPORA_DIR / f"{name}-{key}"
    if not _records(recorded_meta(directory), recipe):
        prepare_token_files(documents(), directory, val_fraction=val_fraction, tokenizer=tokenizer)
    return directory


def recorded_meta(directory: Path) -> dict[str, Any] | None:
    """``directory``'s ``meta.json``, or ``None`` when it has none that reads as a JSON object (a
    preparation interrupted before its last rename)."""
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError):  # JSONDecodeError is a ValueError
        return None
    return meta if isinstance(meta, dict) else None


def is_current(meta: dict[str, Any] | None) -> bool:
    """Whether a cached corpus whose ``meta.json`` reads as ``meta`` (``recorded_meta``) is one this
    Ember reuses, for the tokenizer and validation fraction its key stands for: it records the
    preparation format this version writes. Any other is stale: this Ember never reads it (it
    prepares it again in place, if its key is one this Ember asks for)."""
    return _records(meta, _this_format())


def _this_format() -> dict[str, int]:
    """The part of a recipe that says which Ember prepared it (read at call time: tests move it)."""
    return {"format": PREPARATION_FORMAT}


def _records(meta: dict[str, Any] | None, recipe: dict[str, Any]) -> bool:
    """Whether ``meta`` records each field of ``recipe`` at its value (never when ``meta`` is ``None``)."""
    return meta is not None and {key: meta.get(key) for key in recipe} == recipe


__all__ = ["CORPORA_DIR", "cached_corpus", "is_current", "recorded_meta"]

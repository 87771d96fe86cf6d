"""The default corpus: the Python standard library's own source files on this machine.

It needs no download, is tens of megabytes of real text, and its order is deterministic
(sorted relative paths). It is prepared once into Ember's cache directory (``$EMBER_CACHE``,
default ``~/.cache/ember``), keyed by the Python version and by how it was prepared: the
preparation format and the tokenizer (``ember.training.data.corpus_cache``). A change to the
documents ``stdlib_documents`` yields bumps ``token_files.PREPARATION_FORMAT``.
"""

from __future__ import annotations

import platform
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ember.training.data.corpus_cache import cached_corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents() -> Iterator[tuple[str, str]]:
    """``(relative path, source text)`` for every ``.py`` file of the standard library, sorted."""
    root = stdlib_root()
    paths = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of test fixtures are deliberately not UTF-8
        yield str(path.relative_to(root)), text


def stdlib_corpus_dir(cache_dir: str | Path | None = None, tokenizer: Any = None) -> Path:
    """The prepared stdlib dataset directory, preparing it on first use and whenever the cached
    one was prepared another way; ``tokenizer`` (default: Ember's byte tokenizer) tokenizes it,
    each tokenizer into its own directory."""
    return cached_corpus(
        f"python-stdlib-{platform.python_version()}", stdlib_documents, cache_dir=cache_dir, tokenizer=tokenizer
    )

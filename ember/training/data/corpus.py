"""The default corpus: the Python standard library's own source files on this machine.

It needs no download, is tens of megabytes of real text, and its order is deterministic
(sorted relative paths). It is prepared once into a cache directory
(``$EMBER_CACHE``, default ``~/.cache/ember``), keyed by the Python version.
"""

from __future__ import annotations

import os
import platform
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from ember.training.data.token_files import META_FILE, prepare_token_files


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


def stdlib_corpus_dir(cache_dir: str | Path | None = None) -> Path:
    """The prepared stdlib dataset directory, preparing it on first use."""
    cache = Path(cache_dir or os.environ.get("EMBER_CACHE", Path.home() / ".cache" / "ember"))
    directory = cache / "corpora" / f"python-stdlib-{platform.python_version()}"
    if not (directory / META_FILE).is_file():
        prepare_token_files(stdlib_documents(), directory)
    return directory

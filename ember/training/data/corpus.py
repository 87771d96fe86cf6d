"""The default corpus: the Python standard library's own source files on this machine.

It needs no download, is tens of megabytes of real text, and its order is deterministic
(sorted relative paths). It is prepared once into a cache directory
(``$EMBER_CACHE``, default ``~/.cache/ember``), keyed by the Python version (and by the
tokenizer, when it is not Ember's byte-level one).
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ember.core.cache_dir import ember_cache_dir
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


def stdlib_corpus_dir(cache_dir: str | Path | None = None, tokenizer: Any = None) -> Path:
    """The prepared stdlib dataset directory, preparing it on first use; ``tokenizer`` (default:
    Ember's byte tokenizer) tokenizes it, each tokenizer into its own directory."""
    cache = ember_cache_dir(cache_dir)
    name = f"python-stdlib-{platform.python_version()}"
    if tokenizer is not None and tokenizer.describe()["type"] != "bytes":
        digest = hashlib.sha256(json.dumps(tokenizer.describe(), sort_keys=True).encode()).hexdigest()[:12]
        name = f"{name}-{digest}"
    directory = cache / "corpora" / name
    if not (directory / META_FILE).is_file():
        prepare_token_files(stdlib_documents(), directory, tokenizer=tokenizer)
    return directory

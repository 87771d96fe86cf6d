"""What the built-in corpora's cache holds, and deleting what this Ember no longer reads.

    corpora = scan_corpora()                    # every directory under <cache>/corpora, by name
    pruned, left = prune(corpora)               # delete the stale ones (everything=True: all)

``ember data cache`` lists them and ``ember data cache prune`` deletes (``ember.training.data.cli``).
A directory is *current* when its ``meta.json`` records the preparation format this Ember writes
(``corpus_cache.is_current``, the rule ``cached_corpus`` reuses by); otherwise it is *stale*:
prepared by another Ember (another format, or none recorded), a preparation interrupted before
its ``meta.json`` was written, or a deletion interrupted. No process of this version reads a
stale directory again, except to prepare it anew at its own name. A current directory can also
hold leftover temporary files (``*.partial``) of a process that died while preparing it beside
another; those files are stale, the directory is not.

Concurrency. A preparation opens its ``*.partial`` files first, writes the tokens into them as
it goes and renames each into place whole, ``meta.json`` last (``token_files.prepare_token_files``;
a renamed file keeps the time of its last write). The rule: a directory holding a file modified
less than ``IN_PROGRESS_MINUTES`` ago (or, holding none, itself changed that recently: a
preparation's first instant) may be being prepared, and is left whole, even with ``everything``;
a later prune takes it. Deleting a file does not make a directory recent: the directory's own
time counts only when it is empty.

A directory is deleted by first renaming it to a name no reader looks for (``.<name>.<pid>-<hex>
.deleting``, listed as a deletion interrupted if the process dies before the end), so a process
opening the corpus finds it whole or not at all, and prepares it again in the second case. The
check and the rename are two steps: a preparation that starts in the instant between them fails
on a missing file (the next use prepares the corpus again). Deleting a current corpus that a
running process has open is safe where files stay readable after deletion (POSIX); that process
prepares it again the next time it opens the corpus.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ember.core.cache_dir import ember_cache_dir
from ember.core.files import PARTIAL_SUFFIX
from ember.training.data.corpus_cache import CORPORA_DIR, is_current, recorded_meta

IN_PROGRESS_MINUTES = 10
"""A directory modified less than this many minutes ago may be being prepared: prune leaves it."""
DELETING_SUFFIX = ".deleting"
"""How the name of a directory being deleted ends (renamed first, then removed)."""


@dataclasses.dataclass(frozen=True)
class CachedCorpus:
    """One directory under ``<cache>/corpora`` as ``scan_corpora`` found it.

    Attributes:
      path: the directory.
      size: bytes of the files in it (temporary ones included).
      modified: the newest modification time (seconds since the epoch) of its files; the directory's
        own when it holds none (deleting a file changes the directory's, writing none does not).
      meta: its ``meta.json``, ``None`` when it has none that reads as a JSON object.
      temporary: its temporary files (names ending ``.partial``), by name.
      temporary_size: their bytes.
      stale: why this Ember does not read it (one phrase), ``None`` when it is current.
    """

    path: Path
    size: int
    modified: float
    meta: dict[str, Any] | None
    temporary: tuple[Path, ...]
    temporary_size: int
    stale: str | None

    def in_progress(self, now: float) -> bool:
        """Whether it was modified less than ``IN_PROGRESS_MINUTES`` before ``now`` (``time.time()``
        seconds): a preparation may be writing it."""
        return now - self.modified < IN_PROGRESS_MINUTES * 60

    def to_delete(self, everything: bool = False) -> tuple[Path, ...]:
        """What pruning deletes of it: the directory when it is stale (or ``everything``), else its
        leftover temporary files (none for a current directory without them)."""
        return (self.path,) if self.stale or everything else self.temporary

    def reclaimable(self, everything: bool = False) -> int:
        """Bytes ``to_delete(everything)`` frees."""
        return self.size if self.stale or everything else self.temporary_size


def scan_corpora(cache_dir: str | Path | None = None) -> list[CachedCorpus]:
    """Every directory under ``<cache>/corpora`` (``ember_cache_dir(cache_dir)``), by name; none when
    it does not exist. Files and links there are not Ember's and are not listed."""
    try:
        entries = sorted(os.scandir(ember_cache_dir(cache_dir) / CORPORA_DIR), key=lambda entry: entry.name)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                found.append(inspect_corpus(Path(entry.path)))
        except FileNotFoundError:  # deleted since it was listed (a prune, or a preparation's rename)
            continue
    return found


def inspect_corpus(path: Path) -> CachedCorpus:
    """``path`` as it is now. Files a preparation renames or removes while it is read are skipped."""
    size, temporary_size, temporary, times = 0, 0, [], []
    for root, _, names in os.walk(path):
        for name in names:
            file = Path(root, name)
            try:
                stat = file.lstat()
            except FileNotFoundError:
                continue
            size += stat.st_size
            times.append(stat.st_mtime)
            if name.endswith(PARTIAL_SUFFIX):
                temporary.append(file)
                temporary_size += stat.st_size
    modified = max(times) if times else path.stat().st_mtime
    meta = recorded_meta(path)
    return CachedCorpus(path, size, modified, meta, tuple(sorted(temporary)), temporary_size, _stale(path, meta))


def _stale(path: Path, meta: dict[str, Any] | None) -> str | None:
    """Why this Ember does not read the corpus directory ``path`` with ``meta``, or ``None``."""
    if path.name.endswith(DELETING_SUFFIX):
        return "a deletion interrupted"
    if meta is None:
        return "an interrupted preparation (no readable meta.json)"
    if not is_current(meta):
        recorded = meta.get("format")
        return "another Ember's preparation (" + ("no format" if recorded is None else f"format {recorded}") + ")"
    return None


def prune(
    corpora: Iterable[CachedCorpus], *, everything: bool = False, dry_run: bool = False, now: float | None = None
) -> tuple[list[tuple[CachedCorpus, int]], list[CachedCorpus]]:
    """Deletes what ``to_delete(everything)`` names of each of ``corpora``, each looked at again just
    before (a corpus may have changed since it was scanned), but none modified less than
    ``IN_PROGRESS_MINUTES`` before ``now`` (default: the time of the call).

    Returns ``(pruned, left)``: each corpus something was (``dry_run``: would be) deleted of, with
    the bytes freed, and the corpora left because they may be being prepared.
    """
    now = time.time() if now is None else now
    pruned, left = [], []
    for scanned in corpora:
        try:
            corpus = inspect_corpus(scanned.path)
        except FileNotFoundError:  # deleted since the scan (another prune)
            continue
        if not corpus.to_delete(everything):
            continue
        if corpus.in_progress(now):
            left.append(corpus)
            continue
        if not dry_run and not _delete(corpus.to_delete(everything)):
            continue
        pruned.append((corpus, corpus.reclaimable(everything)))
    return pruned, left


def _delete(paths: tuple[Path, ...]) -> bool:
    """Deletes files, and directories by renaming each out of readers' sight first; ``False`` when
    another process deleted them first."""
    try:
        for path in paths:
            if not path.is_dir() or path.is_symlink():
                path.unlink()
            elif path.name.endswith(DELETING_SUFFIX):  # already out of sight
                shutil.rmtree(path)
            else:
                doomed = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{DELETING_SUFFIX}")
                path.rename(doomed)
                shutil.rmtree(doomed)
    except FileNotFoundError:
        return False
    return True


__all__ = ["DELETING_SUFFIX", "IN_PROGRESS_MINUTES", "CachedCorpus", "inspect_corpus", "prune", "scan_corpora"]

"""Files a crash must not leave half written.

    write_text_atomic(run_dir / "config.yaml", to_yaml(config))

The text goes to a temporary file beside the target, which then replaces it in one rename: a
process killed mid-write leaves the previous file whole (and at worst a stray ``.partial``), so
a run directory's ``config.yaml`` or ``summary.json``, which a resume reads back, is never empty.
"""

from __future__ import annotations

import os
from pathlib import Path

PARTIAL_SUFFIX = ".partial"
"""How the name of a file still being written ends (``.<name>.<writer>.partial`` beside its target):
what a cleaner of a directory Ember writes can tell apart from the files it holds."""


def write_text_atomic(path: str | Path, text: str) -> None:
    """Writes ``text`` to ``path`` (UTF-8), replacing what was there only once all of it is written."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}{PARTIAL_SUFFIX}")  # one per process: no two writers share it
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


__all__ = ["PARTIAL_SUFFIX", "write_text_atomic"]

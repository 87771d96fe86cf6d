"""Files a crash must not leave half written.

    write_text_atomic(run_dir / "config.yaml", to_yaml(config))

The text goes to a temporary file beside the target, which then replaces it in one rename: a
process killed mid-write leaves the previous file whole (and at worst a stray ``.partial``), so
a run directory's ``config.yaml`` or ``summary.json``, which a resume reads back, is never empty.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Writes ``text`` to ``path`` (UTF-8), replacing what was there only once all of it is written."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")  # one per process: no two writers share it
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


__all__ = ["write_text_atomic"]

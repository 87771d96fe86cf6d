"""JSON Lines input: the lines of a file, their records, and the text check its strings need (and
:func:`utf8_text`, the UTF-8 reading it rests on, for other text inputs).

A JSONL file is UTF-8 text (JSON's encoding, RFC 8259; a leading byte-order mark, which some
editors write, is ignored as the RFC allows) of one JSON value per line. Lines end at
``"\\n"`` only: ``str.splitlines`` would also split inside a JSON string at U+2028, U+2029 and
U+0085, which JSON allows unescaped there. JSON's ``"\\ud800"`` escapes decode to lone
surrogates, which are not Unicode text: no tokenizer encodes them (:func:`lone_surrogate`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ember.core.errors import DataError


def readable(path: str | Path) -> bool:
    """Whether ``path`` is something :func:`utf8_text` reads: a file, or a pipe
    (``/dev/stdin``, a shell's ``<(...)``), which ``Path.is_file`` says is not a file."""
    path = Path(path)
    return path.exists() and not path.is_dir()


def jsonl_lines(path: str | Path, label: str = "") -> list[str]:
    """Every line of the JSONL file at ``path`` (line ``n`` at index ``n - 1``; blank ones
    included, for the callers' line numbers).

    Raises:
      DataError: the file is not UTF-8 text (the message starts with ``label``, e.g. ``"--prompts: "``).
    """
    return utf8_text(path, label).split("\n")


def jsonl_records(path: str | Path, label: str = "") -> Iterator[tuple[Any, str]]:
    """``(record, "file:line")`` of every non-blank line of the JSONL file at ``path``, parsed
    (any JSON value: the caller says which it takes).

    Raises:
      DataError: the file is not UTF-8 text, or a line is not JSON (naming the file and line; the
        message starts with ``label``).
    """
    for number, line in enumerate(jsonl_lines(path, label), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{label}{where} is not JSON ({error.msg})") from None
        yield record, where


def utf8_text(path: str | Path, label: str = "") -> str:
    """The text of the UTF-8 file at ``path`` (a leading byte-order mark dropped).

    Raises:
      DataError: the file is not UTF-8 text (the message starts with ``label``).
    """
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise DataError(f"{label}{path} is not UTF-8 text (byte {error.start}: {error.reason})") from None


def lone_surrogate(text: str) -> tuple[int, str] | None:
    """``(index, "U+D800")`` of the first lone surrogate in ``text``, or None for Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start, f"U+{ord(text[error.start]):04X}"
    return None


__all__ = ["jsonl_lines", "jsonl_records", "lone_surrogate", "utf8_text"]

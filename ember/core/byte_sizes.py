"""``format_bytes``: a byte count as people read it (``1536`` -> ``'1.5 KiB'``), for parameter
summaries and the corpora cache listing alike. It imports nothing heavy, so a command that
only lists files (``ember data cache``) starts without JAX."""

from __future__ import annotations


def format_bytes(num_bytes: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


__all__ = ["format_bytes"]

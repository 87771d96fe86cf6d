"""The one-token inputs of the recurrent ops' decode steps (linear attention, SSD, short
convolution).

A step adds a sequence axis to its token and checks it as the whole op's input; its ranks are
checked first, against the step's own layouts, so a token passed with its sequence axis left
in is named as such rather than as a shape the caller never passed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def check_one_token(op: str, arrays: Iterable[tuple[str, Any, str]]) -> None:
    """Raises ``ValueError`` naming the first ``(name, array, layout)`` whose array's rank is
    not its layout's (``layout`` such as ``"[batch, heads, dv]"``; a None array is skipped)."""
    for name, x, layout in arrays:
        if x is not None and x.ndim != len(layout.split(",")):
            raise ValueError(f"{op}: {name} must be {layout} (one token), got shape {x.shape}")


__all__ = ["check_one_token"]

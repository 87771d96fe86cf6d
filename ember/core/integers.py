"""``is_integer``: the one test of "an integer, not a bool" for values users pass (token ids,
kernel tile sizes and launch options, mask widths).

A bool is an int to Python (``True == 1``); a request or config that passes one where a
number belongs has a mistake in it, so every check built on this refuses it. NumPy integers
pass (``numbers.Integral`` includes them).
"""

from __future__ import annotations

import numbers
from typing import Any


def is_integer(value: Any) -> bool:
    """Whether ``value`` is an integer (Python's or NumPy's) and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


__all__ = ["is_integer"]

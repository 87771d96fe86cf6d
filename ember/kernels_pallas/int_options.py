"""Checks of the options kernels take as Python ints: tile sizes, launch options, mask widths.

Each raises ``ValueError`` naming the option, what it may be and what it got. Every check
refuses bools and takes NumPy integers (:func:`ember.core.integers.is_integer`).
"""

from __future__ import annotations

from ember.core.integers import is_integer

TRITON_NUM_WARPS = (1, 2, 4, 8, 16)


def check_non_negative_int(name: str, value) -> None:
    """``value`` must be an int >= 0."""
    if not is_integer(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def check_power_of_two(name: str, value, minimum: int) -> None:
    """``value`` must be a power of two of at least ``minimum``."""
    if not is_integer(value) or value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value!r}")


def check_positive_int(name: str, value, *, none_means: str | None = None) -> None:
    """``value`` must be an int >= 1; ``None`` too where ``none_means`` says what it stands for."""
    if none_means is not None and value is None:
        return
    if not is_integer(value) or value < 1:
        allowed = f"a positive int or None ({none_means})" if none_means is not None else "a positive int"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_num_warps(name: str, value, *, none_means: str | None = None) -> None:
    """``value`` must be one of Triton's warp counts; ``None`` too where ``none_means`` says
    what it stands for."""
    if none_means is not None and value is None:
        return
    if not is_integer(value) or value not in TRITON_NUM_WARPS:
        allowed = ", ".join(map(str, TRITON_NUM_WARPS))
        allowed = f"None ({none_means}) or one of {allowed}" if none_means is not None else f"one of {allowed}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")

"""Observation and action spaces: ``Discrete``, ``Box``, ``MultiDiscrete``, ``Dict``, ``Tuple``.

A space describes values, it holds no state: its bounds are static NumPy values, and
``sample(key)`` / ``contains(x)`` are traceable, so both work under ``jit`` and ``vmap``.
``clip(x)`` maps any value of the right shape into the space; environments call it on
actions, which is how out-of-range actions behave (see ``Environment.step``), after
``check(x, name)`` has refused a value of the wrong shape or dtype (a static check: it costs
nothing under ``jit``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class Space:
    """Base class. ``shape`` and ``dtype`` describe one value (``None`` for composite spaces)."""

    shape: tuple[int, ...] | None = None
    dtype: Any = None

    def sample(self, key: jax.Array) -> Any:
        raise NotImplementedError

    def contains(self, x: Any) -> jax.Array:
        """A scalar bool array: ``x`` has this space's shape and lies inside it."""
        raise NotImplementedError

    def clip(self, x: Any) -> Any:
        """``x`` moved into the space (nearest valid value)."""
        raise NotImplementedError

    def check(self, x: Any, name: str) -> None:
        """Raises ``ValueError`` naming ``name`` when ``x`` has the wrong structure, shape or
        dtype for this space (its values are not looked at: ``clip`` handles those)."""
        raise NotImplementedError


def default_float() -> np.dtype:
    """JAX's default float dtype when called: float32, or float64 under ``jax_enable_x64``.
    Environments that compute in it (classic control, MPE) declare their observation spaces
    with it, so a space's dtype is its observations' dtype in both modes."""
    return jnp.dtype(jnp.result_type(float))


def _is_whole(value: Any) -> bool:
    """An integer (Python, NumPy or an integer scalar array), not a bool or a float."""
    return (
        not isinstance(value, (bool, np.bool_))
        and np.ndim(value) == 0
        and np.issubdtype(np.asarray(value).dtype, np.integer)
    )


def _clip_integers(x: Any, low: np.ndarray, high: np.ndarray) -> jax.Array:
    """``x`` clipped into ``[low, high]`` (NumPy bounds of the space's integer dtype) and cast
    to that dtype. An integer ``x`` is clipped in its own dtype first (to the bounds as far as
    that dtype reaches), so no value wraps: casting first turned -1 into 255 for a uint8 space
    and 128 into -128 for an int8 one before the clip."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.integer):
        info = np.iinfo(x.dtype)
        reach = lambda bound: np.asarray(np.clip(bound.astype(object), info.min, info.max)).astype(x.dtype)  # noqa: E731
        x = jnp.clip(x, reach(low), reach(high))  # now inside the bounds, or at the end of x's range nearest them
    else:
        x = jnp.clip(x, low, high)
    return jnp.clip(x.astype(low.dtype), low, high)


def _check_array(space: Space, x: Any, name: str, *, integer: bool) -> None:
    """``x`` has ``space.shape`` and an integer (``integer``) or real dtype."""
    x = jnp.asarray(x)
    kind = jnp.integer if integer else jnp.number
    if x.shape != space.shape or not jnp.issubdtype(x.dtype, kind) or jnp.issubdtype(x.dtype, jnp.complexfloating):
        wanted = "an integer" if integer else "a real (integer or floating)"
        raise ValueError(
            f"{name} must have shape {space.shape} and {wanted} dtype for {space!r}; got shape {x.shape} and dtype "
            f"{x.dtype}"
        )


class Discrete(Space):
    """Integers ``0 .. n - 1`` (``start`` shifts the range), scalar ``int32``."""

    def __init__(self, n: int, start: int = 0, dtype=jnp.int32):
        if not _is_whole(n) or int(n) < 1 or not _is_whole(start):  # Discrete(2.5) was Discrete(2)
            raise ValueError(f"Discrete: n must be an integer >= 1 and start an integer, got n={n!r}, start={start!r}")
        self.n, self.start = int(n), int(start)
        self.shape, self.dtype = (), jnp.dtype(dtype)

    def sample(self, key):
        return jax.random.randint(key, (), self.start, self.start + self.n, dtype=self.dtype)

    def contains(self, x):
        x = jnp.asarray(x)
        if x.shape != () or not jnp.issubdtype(x.dtype, jnp.integer):
            return jnp.asarray(False)
        return (x >= self.start) & (x < self.start + self.n)

    def clip(self, x):
        return _clip_integers(x, np.asarray(self.start, self.dtype), np.asarray(self.start + self.n - 1, self.dtype))

    def check(self, x, name):
        _check_array(self, x, name, integer=True)

    def __repr__(self):
        return f"Discrete({self.n})" if self.start == 0 else f"Discrete({self.n}, start={self.start})"


class MultiDiscrete(Space):
    """An integer array whose entry ``i`` lies in ``0 .. nvec[i] - 1``."""

    def __init__(self, nvec: Sequence[int] | np.ndarray, dtype=jnp.int32):
        given = np.asarray(nvec)
        if given.size == 0 or not np.issubdtype(given.dtype, np.integer) or (given < 1).any():
            raise ValueError(f"MultiDiscrete: nvec must be non-empty with integer entries >= 1, got {nvec}")
        self.nvec = given.astype(np.int64)
        self.shape, self.dtype = self.nvec.shape, jnp.dtype(dtype)

    def sample(self, key):
        return jax.random.randint(key, self.shape, 0, jnp.asarray(self.nvec, self.dtype), dtype=self.dtype)

    def contains(self, x):
        x = jnp.asarray(x)
        if x.shape != self.shape or not jnp.issubdtype(x.dtype, jnp.integer):
            return jnp.asarray(False)
        return jnp.all((x >= 0) & (x < self.nvec))

    def clip(self, x):
        return _clip_integers(x, np.zeros(self.shape, self.dtype), (self.nvec - 1).astype(self.dtype))

    def check(self, x, name):
        _check_array(self, x, name, integer=True)

    def __repr__(self):
        return f"MultiDiscrete({self.nvec.tolist()})"


class Box(Space):
    """Real arrays inside ``[low, high]`` (bounds broadcast to ``shape``; may be infinite)."""

    def __init__(self, low, high, shape: Sequence[int] | None = None, dtype=jnp.float32):
        self.dtype = jnp.dtype(dtype)
        shape = tuple(shape) if shape is not None else np.broadcast_shapes(np.shape(low), np.shape(high))
        self.shape = shape
        self.low = np.broadcast_to(np.asarray(low, dtype=np.float64), shape)
        self.high = np.broadcast_to(np.asarray(high, dtype=np.float64), shape)
        if np.isnan(self.low).any() or np.isnan(self.high).any() or (self.low > self.high).any():
            # NaN compares False, so it passed the ordering test and clip then returned NaN.
            raise ValueError(f"Box: low must be <= high everywhere (no NaN), got low={low}, high={high}")

    @property
    def bounded(self) -> bool:
        return bool(np.isfinite(self.low).all() and np.isfinite(self.high).all())

    def sample(self, key):
        if jnp.issubdtype(self.dtype, jnp.integer):
            return jax.random.randint(key, self.shape, self.low, self.high + 1, dtype=self.dtype)
        # Gymnasium's convention: uniform where bounded, low + Exp(1) where bounded below only,
        # high - Exp(1) where bounded above only, a standard normal where unbounded.
        bounded_below, bounded_above = np.isfinite(self.low), np.isfinite(self.high)
        low, high = np.where(bounded_below, self.low, 0.0), np.where(bounded_above, self.high, 1.0)
        uniform = jax.random.uniform(key, self.shape, self.dtype, low, high)
        normal = jax.random.normal(key, self.shape, self.dtype)
        exponential = jax.random.exponential(jax.random.fold_in(key, 1), self.shape, self.dtype)
        one_sided = jnp.where(bounded_below, low + exponential, high - exponential)
        sample = jnp.where(
            bounded_below & bounded_above, uniform, jnp.where(bounded_below | bounded_above, one_sided, normal)
        )
        return sample.astype(self.dtype)

    def contains(self, x):
        x = jnp.asarray(x)
        if x.shape != self.shape:
            return jnp.asarray(False)
        if jnp.issubdtype(self.dtype, jnp.integer) and not jnp.issubdtype(x.dtype, jnp.integer):
            return jnp.asarray(False)  # an integer Box holds integers only (as Discrete, and gymnasium)
        low, high = self.low, self.high
        if jnp.issubdtype(self.dtype, jnp.floating):  # the bounds as this dtype holds them (as clip and gymnasium)
            low, high = self.bounds_in_dtype()
        return jnp.all((x >= low) & (x <= high))  # NaN compares False: not contained

    def clip(self, x):
        """Clips to the bounds; NaN entries become the midpoint of their bounds (0 if
        unbounded) so a NaN action is a neutral action, never NaN dynamics."""
        if jnp.issubdtype(self.dtype, jnp.integer):
            return _clip_integers(x, *self.bounds_in_dtype())
        x = jnp.asarray(x, self.dtype)
        middle = np.where(np.isfinite(self.low + self.high), (self.low + self.high) / 2, 0.0)
        x = jnp.where(jnp.isnan(x), middle.astype(self.dtype), x)
        low, high = self.bounds_in_dtype()
        return jnp.clip(x, low, high)

    def bounds_in_dtype(self) -> tuple[np.ndarray, np.ndarray]:
        """``(low, high)`` as NumPy arrays of this Box's dtype; for an integer dtype an infinite
        bound is the dtype's limit (as gymnasium's integer Box)."""
        low, high = self.low, self.high
        if jnp.issubdtype(self.dtype, jnp.integer):
            limits = jnp.iinfo(self.dtype)
            low, high = np.clip(low, limits.min, limits.max), np.clip(high, limits.min, limits.max)
        return low.astype(self.dtype), high.astype(self.dtype)

    def check(self, x, name):
        _check_array(self, x, name, integer=bool(jnp.issubdtype(self.dtype, jnp.integer)))

    def __repr__(self):
        low, high = np.unique(self.low), np.unique(self.high)
        show = lambda v: v[0] if v.size == 1 else "..."  # noqa: E731
        return f"Box({show(low)}, {show(high)}, {self.shape}, {self.dtype})"


class Dict(Space):
    """A dict of named spaces; values are dicts with the same keys."""

    def __init__(self, spaces: Mapping[str, Space]):
        self.spaces = dict(spaces)

    def sample(self, key):
        keys = jax.random.split(key, len(self.spaces))
        return {name: space.sample(k) for (name, space), k in zip(self.spaces.items(), keys)}

    def contains(self, x):
        if not isinstance(x, Mapping) or set(x) != set(self.spaces):
            return jnp.asarray(False)
        return jnp.all(jnp.stack([space.contains(x[name]) for name, space in self.spaces.items()]))

    def clip(self, x):
        return {name: space.clip(x[name]) for name, space in self.spaces.items()}

    def check(self, x, name):
        if not isinstance(x, Mapping) or set(x) != set(self.spaces):
            got = sorted(x) if isinstance(x, Mapping) else type(x).__name__
            raise ValueError(f"{name} must be a dict with keys {sorted(self.spaces)}; got {got}")
        for key, space in self.spaces.items():
            space.check(x[key], f"{name}[{key!r}]")

    def __getitem__(self, name: str) -> Space:
        return self.spaces[name]

    def __repr__(self):
        return f"Dict({self.spaces})"


class Tuple(Space):
    """A tuple of spaces; values are tuples of the same length."""

    def __init__(self, spaces: Sequence[Space]):
        self.spaces = tuple(spaces)

    def sample(self, key):
        keys = jax.random.split(key, len(self.spaces))
        return tuple(space.sample(k) for space, k in zip(self.spaces, keys))

    def contains(self, x):
        if not isinstance(x, (tuple, list)) or len(x) != len(self.spaces):
            return jnp.asarray(False)
        return jnp.all(jnp.stack([space.contains(v) for space, v in zip(self.spaces, x)]))

    def clip(self, x):
        return tuple(space.clip(v) for space, v in zip(self.spaces, x))

    def check(self, x, name):
        if not isinstance(x, (tuple, list)) or len(x) != len(self.spaces):
            raise ValueError(f"{name} must be a tuple of {len(self.spaces)} values; got {type(x).__name__}")
        for index, (space, value) in enumerate(zip(self.spaces, x)):
            space.check(value, f"{name}[{index}]")

    def __getitem__(self, index: int) -> Space:
        return self.spaces[index]

    def __repr__(self):
        return f"Tuple({self.spaces})"


__all__ = ["Box", "Dict", "Discrete", "MultiDiscrete", "Space", "Tuple", "default_float"]

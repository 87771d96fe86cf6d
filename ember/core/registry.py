"""Named registries (models, environments, algorithms, ...) with helpful lookup errors.

ENVS = Registry("environment")

@ENVS.register("CartPole-v1")
def make_cartpole(**overrides): ...

ENVS.get("CartPol-v1")   # UnknownNameError: unknown environment 'CartPol-v1'. Did you mean 'CartPole-v1'? ...
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import Generic, TypeVar

from ember.core.errors import UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from unique names to objects of one kind."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None, *, overwrite: bool = False):
        """Registers ``obj`` under ``name``; without ``obj``, returns a decorator.

        Raises:
          ValueError: if ``name`` is taken (unless ``overwrite``) or is not a non-empty string.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")

        def add(entry: T) -> T:
            if name in self._entries and not overwrite:
                raise ValueError(
                    f"{self.kind} '{name}' is already registered (to {self._entries[name]!r}); "
                    "pass overwrite=True to replace it"
                )
            self._entries[name] = entry
            return entry

        return add if obj is None else add(obj)

    def get(self, name: str) -> T:
        """The object registered as ``name``; ``UnknownNameError`` lists the closest names."""
        try:
            return self._entries[name]
        except KeyError:
            pass
        suggestions = tuple(difflib.get_close_matches(str(name), list(self._entries), n=3, cutoff=0.6))
        hint = f" Did you mean {', '.join(repr(s) for s in suggestions)}?" if suggestions else ""
        known = ", ".join(sorted(self._entries)) or "(none registered)"
        raise UnknownNameError(f"unknown {self.kind} '{name}'.{hint} Registered: {known}", name, suggestions)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._entries.items())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self)} entries)"


__all__ = ["Registry", "UnknownNameError"]

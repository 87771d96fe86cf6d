"""The KV-cache page allocator: a free list over the ids ``0 .. num_pages - 1``.

Freed pages go back on top of the list and are handed out first (their cache lines are
the most likely to still be warm). Double frees and foreign ids raise, so accounting bugs
surface where they happen rather than as corrupted caches later.
"""

from __future__ import annotations


class PageAllocator:
    """Hands out and takes back page ids of one paged KV cache."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` page ids; raises ``MemoryError`` (taking none) when fewer are free."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._free):
            raise MemoryError(f"asked for {count} pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: list[int]) -> None:
        """Returns ``pages`` to the free list."""
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page id {page} is not in [0, {self.num_pages})")
            if self._is_free[page]:
                raise ValueError(f"page {page} freed twice")
        for page in reversed(pages):
            self._is_free[page] = True
            self._free.append(page)


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


__all__ = ["PageAllocator", "pages_needed"]

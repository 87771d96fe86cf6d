"""Automatic prefix caching: full cache pages shared by the requests whose sequences begin alike.

A page is *full* when all ``page_size`` of its positions hold a computed token. Each full page
of a request is known by a key: a digest of every token up to its end and of the adapter the
request runs (an adapter changes the keys and values), chained page by page. Once a full page
is computed, its key names it; a request that arrives later with the same first tokens starts
with those pages in its page table and computes only the rest. At least the request's last
token is always computed (its logits give the next token), so the pages it writes are its own:
a shared page is only read. A request asking for its prompt's log-probabilities shares a page
only where the scores of its rows are kept too (:mod:`ember.serving.page_scores`).

Pages are counted by the requests holding them. A page no request holds keeps its contents
and key while the pool has other free pages (*evictable*, least recently released first, a
sequence's last page before its first), so a prompt that comes back soon finds it;
:meth:`PrefixCache.allocate` takes truly free pages first, then evicts. While a request
computes a full page another waiting request needs next (or, for one scoring its prompt, the
scores of a cached page's rows), that one waits for it (:meth:`PrefixCache.match`) rather than
computing it again: the requests of a group sampled from one prompt (GRPO, ``n`` choices) and
the choices of a scored context prefill it once.

Only models whose every layer keeps its cache in the pages can share them (the softmax
family): a recurrent layer's state at the end of a prefix is not kept. New weights
(``Engine.update_params``) make every cached page stale: :meth:`PrefixCache.forget`.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from ember.serving.page_scores import PageScores
from ember.serving.pages import PageAllocator
from ember.serving.requests import Request


class PrefixCache:
    """Reference-counted pages over a :class:`PageAllocator`, the full computed ones kept by key
    (module docstring). With ``enabled`` False it only counts: no page is ever shared."""

    def __init__(self, allocator: PageAllocator, page_size: int, *, enabled: bool = True):
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self._holders = [0] * allocator.num_pages  # requests holding each page
        self._page_of: dict[bytes, int] = {}  # key -> the computed page holding it
        self._key_of: dict[int, bytes] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest release first
        self._computing: collections.Counter[bytes] = collections.Counter()  # keys some running request computes
        self._tracked: dict[int, _Tracked] = {}  # id(request) -> its keys, what it registered and computes
        self.scores = PageScores(page_size)
        self.hit_tokens = 0
        """Tokens requests found computed here since the engine started (not computed again)."""

    @property
    def num_free(self) -> int:
        """Pages that can be handed out: free ones and evictable cached ones."""
        return self.allocator.num_free + len(self._evictable)

    def allocate(self, count: int) -> list[int]:
        """``count`` pages, free ones first, then the least recently released cached ones (their
        keys dropped); raises ``MemoryError`` (taking none) when fewer can be handed out."""
        if count > self.num_free:
            raise MemoryError(f"asked for {count} pages, {self.num_free} of {self.allocator.num_pages} free")
        short = count - self.allocator.num_free
        for _ in range(max(short, 0)):
            page, _ = self._evictable.popitem(last=False)
            key = self._key_of.pop(page)
            del self._page_of[key]
            self.scores.drop(key)
            self.allocator.free([page])
        pages = self.allocator.allocate(count)
        for page in pages:
            self._holders[page] = 1
        return pages

    def match(self, request: Request) -> list[int] | None:
        """The computed pages the start of ``request``'s sequence may share (:meth:`hold` them to
        use them), leaving at least its last token to compute; for a request asking for its
        prompt's log-probabilities, only as far as the scores of their rows are kept. None when
        the first page it would compute past them is being computed by a running request (for a
        scored request, a cached page whose rows a running request is scoring): it had better
        wait a step or two than compute that page too."""
        if not self.enabled:
            return []
        pages = []
        for index, key in enumerate(self._keys(request, (request.num_tokens - 1) // self.page_size)):
            page = self._page_of.get(key)
            if page is None or not self.scores.covers(key, request, index):
                return None if self._computing[key] > 0 else pages
            pages.append(page)
        return pages

    def evictable_among(self, pages: list[int]) -> int:
        """How many of ``pages`` no request holds (holding them takes them out of :attr:`num_free`)."""
        return sum(page in self._evictable for page in pages)

    def hold(self, pages: list[int]) -> None:
        """Takes ``pages`` of :meth:`match` for a request that starts with them."""
        for page in pages:
            if self._holders[page] == 0:
                del self._evictable[page]
            self._holders[page] += 1
        self.hit_tokens += len(pages) * self.page_size

    def admitted(self, request: Request) -> None:
        """Gives ``request``, starting after the pages it :meth:`hold`s, the kept scores of their
        prompt rows where it asks for them, and marks the full pages it will compute (from its
        ``num_computed`` on) as being computed, so that requests behind it wait for them."""
        if not self.enabled:
            return
        tracked = self._tracked[id(request)] = _Tracked()
        keys = self._keys(request, request.num_tokens // self.page_size)  # kept in tracked.keys
        first = request.num_computed // self.page_size
        if request.params.prompt_logprobs:
            for index, key in enumerate(keys[:first]):
                self.scores.read(key, request, index)
        tracked.computing = list(enumerate(keys[first:], start=first))
        tracked.scored_from = len(request.prompt_logprobs)  # rows scored before this run aren't kept
        self._computing.update(key for _, key in tracked.computing)

    def computed(self, request: Request) -> None:
        """Keeps ``request``'s pages that are now full and computed by their keys (a key some
        other page holds already stays with that one), and the scores it recorded of their rows."""
        if not self.enabled:
            return
        tracked = self._tracked.get(id(request))
        if tracked is None:  # released
            return
        full = request.num_computed // self.page_size
        keys = self._keys(request, full)
        for index in range(tracked.registered, full):
            key, page = keys[index], request.pages[index]
            if key not in self._page_of and page not in self._key_of:
                self._page_of[key], self._key_of[page] = page, key
            if key in self._page_of and index * self.page_size >= tracked.scored_from:
                self.scores.keep(key, request, index)
        tracked.registered = max(tracked.registered, full)
        # A page is there once anyone computed it; the scores of its rows once this request has.
        scoring = request.params.prompt_logprobs
        done = [(i, key) for i, key in tracked.computing if key in self._page_of and (i < full or not scoring)]
        if done:
            self._uncount([key for _, key in done])
            tracked.computing = [entry for entry in tracked.computing if entry not in done]

    def release(self, request: Request) -> None:
        """Lets go of ``request``'s pages (finished, aborted or preempted): a page no request holds
        goes back to the pool, or, keyed, becomes evictable."""
        tracked = self._tracked.pop(id(request), None)
        if tracked is not None:
            self._uncount([key for _, key in tracked.computing])
        # Last page first: a page's key chains its parents', so an evicted parent leaves its
        # children unreachable; released deepest first, they are evicted before it.
        for page in reversed(request.pages):
            self._holders[page] -= 1
            if self._holders[page] > 0:
                continue
            if page in self._key_of:
                self._evictable[page] = None
            else:
                self.allocator.free([page])

    def forget(self) -> None:
        """Drops every key (the weights changed: cached pages hold stale keys and values); the
        pages requests hold stay theirs, the evictable ones go back to the pool."""
        self.allocator.free(list(self._evictable))
        self._evictable.clear()
        self._page_of.clear()
        self._key_of.clear()
        self._computing.clear()
        self.scores.clear()
        for tracked in self._tracked.values():
            tracked.registered = 1 << 62  # its pages were computed under the old weights
            tracked.computing = []

    def _uncount(self, keys: list[bytes]) -> None:
        """Takes ``keys`` off the keys being computed (dropping those nobody computes any more)."""
        for key in keys:
            self._computing[key] -= 1
            if self._computing[key] <= 0:
                del self._computing[key]

    def _keys(self, request: Request, count: int) -> list[bytes]:
        """The keys of ``request``'s first ``count`` full pages: a running request's kept and
        extended as its sequence grows, a waiting one's computed afresh (nothing kept for it)."""
        tracked = self._tracked.get(id(request))
        keys = tracked.keys if tracked is not None else []
        if len(keys) < count:
            tokens = np.asarray(request.tokens[len(keys) * self.page_size : count * self.page_size], np.int64)
            previous = keys[-1] if keys else (request.params.adapter or "").encode()
            for page in tokens.reshape(-1, self.page_size):
                previous = hashlib.blake2b(previous + page.tobytes(), digest_size=16).digest()
                keys.append(previous)
        return keys[:count]


class _Tracked:
    """What a prefix cache knows of one running request: its pages' keys so far, how many of its
    pages it has registered, the keys it is computing and the first prompt row it scores."""

    def __init__(self):
        self.keys: list[bytes] = []
        self.registered = 0
        self.computing: list[tuple[int, bytes]] = []  # (page index, key)
        self.scored_from = 0


__all__ = ["PrefixCache"]

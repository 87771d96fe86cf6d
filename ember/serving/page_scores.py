"""The prompt scores of cached pages, kept by the page's key, so that a request asking for its
prompt's log-probabilities (``SamplingParams.prompt_logprobs``: ``echo``, lm-evaluation-harness's
log-likelihood requests, whose choices share a context) starts after cached pages too.

Row ``p`` of a sequence scores token ``p + 1``. A page's key fixes every token in it, so the
scores of its rows but the last are the page's own; its last row scores the first token of the
next page, which sequences sharing the page may not share: that row's log-probability is kept
per next token. Each row's most likely alternatives do not depend on the next token: they are
kept as wide as the request that computed them asked (``top_logprobs``), and serve requests
asking for as many or fewer.

Only scores a request computed itself are kept (not those it read from here, nor those of an
earlier run before a preemption, which may be the old weights'); :class:`PrefixCache
<ember.serving.prefix_cache.PrefixCache>` drops a page's scores with its key.
"""

from __future__ import annotations

import dataclasses

from ember.serving.requests import Alternatives, Request


@dataclasses.dataclass
class _Scores:
    """One page's scores: its rows' log-probabilities but the last row's (``page_size - 1``), the
    last row's per next token, and each row's alternatives (``width`` of them; None at 0)."""

    inner: list[float]
    last: dict[int, float]
    alternatives: list[Alternatives] | None
    width: int


class PageScores:
    """Prompt scores by page key (module docstring) for pages of ``page_size`` tokens."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._scores: dict[bytes, _Scores] = {}

    def keep(self, key: bytes, request: Request, index: int) -> None:
        """Keeps the scores ``request`` recorded for the rows of its page ``index`` (key ``key``),
        if it recorded every one (its last row scored a prompt token). A page kept already gains
        the last row's next token and, when ``request`` asked for more, wider alternatives."""
        first, size = index * self.page_size, self.page_size
        logprobs, width = request.prompt_logprobs, request.params.top_logprobs
        if len(logprobs) < first + size:
            return
        kept = self._scores.get(key)
        if kept is None:
            kept = self._scores[key] = _Scores(logprobs[first : first + size - 1], {}, None, 0)
        kept.last.setdefault(request.prompt[first + size], logprobs[first + size - 1])
        if width > kept.width:
            # Copies: the request's own lists go out in its result, for its caller to keep.
            kept.alternatives = [list(row) for row in request.prompt_top_logprobs[first : first + size]]
            kept.width = width

    def covers(self, key: bytes, request: Request, index: int) -> bool:
        """Whether the scores kept for page ``index`` of ``request`` (key ``key``) hold every
        prompt row of it that ``request`` still needs, as many alternatives wide as it asks."""
        rows = self._needed(request, index)
        if not rows:
            return True
        kept = self._scores.get(key)
        if kept is None or kept.width < request.params.top_logprobs:
            return False
        return rows[-1] % self.page_size < self.page_size - 1 or request.prompt[rows[-1] + 1] in kept.last

    def read(self, key: bytes, request: Request, index: int) -> None:
        """Appends the kept scores of the rows of page ``index`` that ``request`` still needs to
        its ``prompt_logprobs`` (and ``prompt_top_logprobs``): it starts after the page."""
        kept, width = self._scores.get(key), request.params.top_logprobs
        for row in self._needed(request, index):
            within = row % self.page_size
            inner = within < self.page_size - 1
            request.prompt_logprobs.append(kept.inner[within] if inner else kept.last[request.prompt[row + 1]])
            if width:
                request.prompt_top_logprobs.append(kept.alternatives[within][:width])

    def drop(self, key: bytes) -> None:
        """Forgets a page's scores (its key was evicted)."""
        self._scores.pop(key, None)

    def clear(self) -> None:
        """Forgets every page's scores (new weights)."""
        self._scores.clear()

    def _needed(self, request: Request, index: int) -> range:
        """The rows of page ``index`` whose scores ``request`` asks for and has not recorded."""
        if not request.params.prompt_logprobs:
            return range(0)
        first = index * self.page_size
        return range(max(first, len(request.prompt_logprobs)), min(first + self.page_size, len(request.prompt) - 1))


__all__ = ["PageScores"]

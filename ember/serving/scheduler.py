"""The host-side scheduler: which tokens of which requests the next device step processes.

Each iteration fills a token budget in Sarathi-Serve's stall-free order:

1. running requests that are decoding (one token each), so no decode ever waits behind a
   prompt;
2. running requests part-way through their prefill (the continuing chunks);
3. new requests from the waiting queue, first come first served, while a slot, pages and
   budget remain (none in an iteration that had to preempt). With prefix caching
   (:mod:`ember.serving.prefix_cache`) a new request starts after the pages of its prefix that are
   cached, and one whose next page another request is computing is passed over until it is.

A request's chunk is at most ``chunk_size`` tokens (the engine sets it to the budget). Pages come
from a :class:`~ember.serving.pages.PageAllocator` as a request's sequence grows and all go
back when it finishes. When a running request needs a page and none is free, the most
recently admitted running request not yet scheduled this iteration is preempted by
recompute (pages freed, back to the waiting queue in arrival order, to be prefilled again
with what it generated so far, from the pages of it still cached); if there is none, the
request itself is.
"""

from __future__ import annotations

import bisect
import dataclasses
import numbers
from collections.abc import Iterable

from ember.core.errors import ConfigError
from ember.serving.pages import PageAllocator, pages_needed
from ember.serving.prefix_cache import PrefixCache
from ember.serving.requests import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Alternatives, Request, TokenEvent


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Sizes the scheduler works within.

    ``num_slots``: requests running at once; ``token_budget``:
    tokens per iteration over all slots; ``chunk_size``: tokens per request per iteration;
    ``page_size``/``num_pages``: the paged cache; ``max_context``: the longest sequence a
    request may reach (prompt + generated); ``eos_ids``: the end-of-sequence tokens (any of
    them ends a request; none: ``()``); ``prefix_caching``: share the pages of sequences that
    begin alike (only for a model whose every layer keeps its cache in the pages).
    """

    num_slots: int
    token_budget: int
    chunk_size: int
    page_size: int
    num_pages: int
    max_context: int
    eos_ids: tuple[int, ...] = ()
    prefix_caching: bool = False

    def __post_init__(self):
        for name in ("num_slots", "token_budget", "chunk_size", "page_size", "num_pages", "max_context"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}", key=name)
        if self.num_pages < pages_needed(self.max_context, self.page_size):
            raise ConfigError(
                f"num_pages ({self.num_pages}) must hold at least one sequence of max_context "
                f"({self.max_context}) tokens = {pages_needed(self.max_context, self.page_size)} pages",
                key="num_pages",
            )


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``request.tokens[start : start + len(tokens)]`` to run in row ``request.slot``."""

    request: Request
    start: int
    tokens: list[int]

    @property
    def samples(self) -> bool:
        """Whether the chunk ends at the sequence's last token (its sampled token is kept)."""
        return self.start + len(self.tokens) == self.request.num_tokens


def eos_ids_of(value: int | Iterable[int] | None) -> tuple[int, ...]:
    """End-of-sequence ids as ``SchedulerConfig.eos_ids`` holds them, from none (None), one id
    or several (a Hugging Face ``config.json``'s ``eos_token_id`` is either)."""
    if value is None:
        return ()
    return (int(value),) if isinstance(value, numbers.Integral) else tuple(int(v) for v in value)


class Scheduler:
    """FCFS continuous-batching scheduler with chunked prefill and recompute preemption."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.pages = PrefixCache(PageAllocator(config.num_pages), config.page_size, enabled=config.prefix_caching)
        self.waiting: list[Request] = []  # sorted by request_id (arrival order)
        self.running: list[Request] = []  # admission order
        self._free_slots = list(range(config.num_slots - 1, -1, -1))
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_slots(self) -> int:
        """Slots no running request holds."""
        return len(self._free_slots)

    def add(self, request: Request) -> None:
        """Queues ``request`` (validated by the caller: non-empty prompt within the context)."""
        bisect.insort(self.waiting, request, key=lambda r: r.request_id)

    def schedule(self, token_budget: int | None = None) -> list[ScheduledChunk]:
        """The chunks of the next iteration (at most ``token_budget`` tokens, default the
        configured one); allocates their pages and slots, preempting when pages run out."""
        budget = self.config.token_budget if token_budget is None else token_budget
        if budget < 1:
            raise ValueError(f"token_budget must be positive, got {budget}")
        chunks: list[ScheduledChunk] = []
        preemptions_before = self.num_preemptions
        # One token left to feed is a decode (or a prefill's last token: the same work).
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        for request in decoding + prefilling:
            if budget == 0:
                break
            if request not in self.running:  # preempted as a victim earlier in this loop
                continue
            count = self._reserve_running(request, min(request.num_tokens - request.num_computed, budget), chunks)
            if count:
                chunks.append(self._chunk(request, count))
                budget -= count
        # After a preemption the pool is short: admitting now would only thrash.
        admit = self.num_preemptions == preemptions_before
        index, page_size = 0, self.config.page_size
        while admit and budget and index < len(self.waiting) and self._free_slots:
            request = self.waiting[index]
            shared = self.pages.match(request)
            if shared is None:  # its next page is on its way: share it then
                index += 1
                continue
            start = len(shared) * page_size
            room = (self.pages.num_free - self.pages.evictable_among(shared)) * page_size
            count = min(request.num_tokens - start, budget, self.config.chunk_size, room)
            if count < 1:
                break
            self.waiting.pop(index)
            self.pages.hold(shared)
            request.slot = self._free_slots.pop()
            self.running.append(request)
            request.num_computed = start
            request.pages = shared + self.pages.allocate(pages_needed(start + count, page_size) - len(shared))
            self.pages.admitted(request)
            chunks.append(self._chunk(request, count))
            budget -= count
        return chunks

    def commit(
        self,
        chunks: list[ScheduledChunk],
        tokens: list[int],
        logprobs: list[float],
        alternatives: list[Alternatives | None] | None = None,
    ) -> list[TokenEvent]:
        """Records a step's results: ``tokens[i]``/``logprobs[i]`` (and ``alternatives[i]``, where
        given) were sampled after ``chunks[i]``. A request with ``max_tokens`` 0 finishes at its
        prompt's end instead. Returns one event per request that got a token or finished."""
        events = []
        alternatives = [None] * len(chunks) if alternatives is None else alternatives
        for chunk, token, logprob, top in zip(chunks, tokens, logprobs, alternatives, strict=True):
            request = chunk.request
            request.num_computed = chunk.start + len(chunk.tokens)
            self.pages.computed(request)
            if not chunk.samples:
                continue
            if request.params.max_tokens == 0:  # a prompt scored alone
                events.append(self._finish(request, FINISH_LENGTH, token=None, logprob=None))
            else:
                events.append(self._append(request, int(token), float(logprob), top))
        return events

    def _chunk(self, request: Request, count: int) -> ScheduledChunk:
        start = request.num_computed
        return ScheduledChunk(request, start, request.tokens[start : start + count])

    def _reserve_running(self, request: Request, count: int, chunks: list[ScheduledChunk]) -> int:
        """Allocates pages for up to ``count`` (capped at ``chunk_size``) more tokens of a
        running request, preempting others (or itself) if none fit. Returns the tokens to run."""
        count = min(count, self.config.chunk_size)
        page_size = self.config.page_size
        scheduled = {id(chunk.request) for chunk in chunks}
        while True:
            room = (len(request.pages) + self.pages.num_free) * page_size - request.num_computed
            if room >= 1:
                count = min(count, room)
                missing = pages_needed(request.num_computed + count, page_size) - len(request.pages)
                request.pages += self.pages.allocate(max(missing, 0))
                return count
            victims = [r for r in self.running if r is not request and id(r) not in scheduled]
            if not victims:
                self.preempt(request)
                return 0
            self.preempt(victims[-1])

    def abort(self, request: Request) -> None:
        """Drops an unfinished ``request``: out of the waiting queue, or its pages and slot freed
        if it runs; it finishes with reason ``"abort"``. A finished request is left as it is."""
        if request.finished:
            return
        if request in self.running:
            self._release(request)
        else:
            self.waiting.remove(request)
        request.finish_reason = FINISH_ABORT

    def finish(self, request: Request, reason: str) -> None:
        """Ends ``request`` with ``reason`` (its pages and slot freed if it still runs): the
        engine's end on a stop string, found in the text of what the scheduler committed."""
        if not request.finished:
            self._release(request)
        request.finish_reason = reason

    def preempt(self, request: Request) -> None:
        """Frees ``request``'s pages and slot and requeues it to be recomputed."""
        self._release(request)
        request.num_computed = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=lambda r: r.request_id)

    def _append(self, request: Request, token: int, logprob: float, top: Alternatives | None) -> TokenEvent:
        params = request.params
        if token in self.config.eos_ids and not params.ignore_eos:
            request.eos_token = token
            return self._finish(request, FINISH_STOP, token=None, logprob=None)
        request.output.append(token)
        request.logprobs.append(logprob)
        if top is not None:
            request.top_logprobs.append(top)
        for sequence in request.stop_sequences:
            if tuple(request.output[-len(sequence) :]) == sequence:
                request.keep_output(len(request.output) - len(sequence))
                return self._finish(request, FINISH_STOP, token=token, logprob=logprob, top=top)
        # The next step would feed the new token at position num_tokens - 1.
        if len(request.output) >= params.max_tokens or request.num_tokens > self.config.max_context:
            return self._finish(request, FINISH_LENGTH, token=token, logprob=logprob, top=top)
        return TokenEvent(request.request_id, token, logprob, top_logprobs=top)

    def _finish(
        self,
        request: Request,
        reason: str,
        *,
        token: int | None,
        logprob: float | None,
        top: Alternatives | None = None,
    ) -> TokenEvent:
        request.finish_reason = reason
        self._release(request)
        return TokenEvent(request.request_id, token, logprob, finish_reason=reason, top_logprobs=top)

    def _release(self, request: Request) -> None:
        self.pages.release(request)
        request.pages = []
        self.running.remove(request)
        self._free_slots.append(request.slot)
        request.slot = None


__all__ = ["ScheduledChunk", "Scheduler", "SchedulerConfig", "eos_ids_of"]

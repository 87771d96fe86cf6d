"""Requests from any thread, served on one or more engines, each stepped by a thread of its own.

    with EngineWorkers(engines) as workers:
        updates = queue.Queue()
        workers.submit("Once upon", SamplingParams(max_tokens=32), updates, tag="first")
        while (update := updates.get()).result is None:
            print(update.event.token)         # one Update per generated token, the result on the last

An engine is not thread-safe, so only its worker's thread calls it: the worker steps its
engine while anything runs there and, between steps, takes requests from one shared queue
(first come first served) as far as the engine can start them at its next step
(:attr:`Engine.room <ember.serving.engine.Engine.room>`), and no more than its share of those
waiting (in proportion to its room among the rooms the workers last reported: a burst of
requests is spread over the idle engines, not given to the first to look). An engine whose
requests finish early takes more; the work balances itself, whatever it turns out to be. Each request's
updates go to the queue its submitter gave, tagged with the submitter's ``tag``.

Unseeded requests are seeded by submission order (``first_seed`` plus the submissions before),
never by the engine that serves them, so where a request runs never changes its tokens.

A worker whose engine raises (a device failure, say) gives each of its requests an error result
(and aborts them in the engine) and stops; the others go on, and once none is left the waiting
requests fail too. The failures are kept in :attr:`EngineWorkers.failures`.
:meth:`EngineWorkers.close` aborts what is left and joins the threads: each engine finishes the
step it is in and is left with nothing queued.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import queue
import threading
from collections.abc import Sequence
from typing import Any

from ember.serving.engine import Engine, Prompt
from ember.serving.requests import (
    FINISH_ABORT,
    FINISH_ERROR,
    GenerationResult,
    Request,
    SamplingParams,
    TokenEvent,
)


@dataclasses.dataclass(frozen=True)
class Update:
    """What a submitted request did: ``event`` (a step's token, with ``finish_reason`` on the
    last) and, once it ended, its ``result`` (also for an abort or an engine failure, which come
    without an event). ``tag`` is the submitter's."""

    tag: Any
    event: TokenEvent | None = None
    result: GenerationResult | None = None


class Ticket:
    """A submitted request: its :class:`Request`, where its updates go, and (once a worker took
    it) the worker's index and the request's id in that worker's engine."""

    def __init__(self, request: Request, updates: queue.Queue, tag: Any):
        self.request, self.updates, self.tag = request, updates, tag
        self.worker: int | None = None
        self.request_id: int | None = None
        self.ended = False

    def end(self, result: GenerationResult, event: TokenEvent | None = None) -> None:
        self.ended = True
        self.updates.put(Update(self.tag, event, result))


class EngineWorkers:
    """One thread per engine, serving one shared queue of requests (module docstring)."""

    def __init__(self, engines: Sequence[Engine], *, first_seed: int = 0):
        """Args:
        engines: engines of one model (the same tokenizer, vocabulary and adapters); the first
          checks every request.
        first_seed: the seed of the first unseeded request; each submission counts one.
        """
        if not engines:
            raise ValueError("EngineWorkers needs at least one engine")
        self.engines = list(engines)
        self.failures: list[BaseException] = []
        self.submitted = 0
        self._next_seed = first_seed
        self._lock = threading.Condition()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._aborts: list[set[Ticket]] = [set() for _ in self.engines]
        self._alive = [True] * len(self.engines)
        self._rooms = [engine.room for engine in self.engines]  # each worker's Engine.room as last reported
        self._closed = False
        self._threads = [
            threading.Thread(target=self._serve, args=(index,), name=f"ember-engine-{index}", daemon=True)
            for index in range(len(self.engines))
        ]
        for thread in self._threads:
            thread.start()

    def __enter__(self) -> EngineWorkers:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @property
    def alive(self) -> int:
        """Workers whose engine has not failed."""
        return sum(self._alive)

    @property
    def num_unassigned(self) -> int:
        """Requests submitted that no worker has taken yet."""
        return len(self._waiting)

    def submit(self, prompt: Prompt, params: SamplingParams | None, updates: queue.Queue, tag: Any = None) -> Ticket:
        """Queues a request; its :class:`Update` s go to ``updates``. Raises ``ValueError`` for a
        bad prompt or parameters (nothing queued) and ``RuntimeError`` once closed or when every
        engine failed."""
        return self.submit_prepared([self.engines[0].prepare(prompt, params)], updates, [tag])[0]

    def submit_prepared(self, requests: Sequence[Request], updates: queue.Queue, tags: Sequence[Any]) -> list[Ticket]:
        """Queues requests checked by ``Engine.prepare`` all at once (so a worker looking sees them
        all and takes only its share); ``tags[i]`` tags ``requests[i]``'s updates. Raises
        ``RuntimeError`` once closed or when every engine failed (nothing queued)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("these engine workers are closed")
            if not self.alive:
                raise RuntimeError(f"every engine failed; the first: {self.failures[0]!r}")
            tickets = []
            for request, tag in zip(requests, tags, strict=True):
                request.params = request.params.seeded(self._next_seed)
                self._next_seed += 1
                tickets.append(Ticket(request, updates, tag))
            self.submitted += len(tickets)
            self._waiting.extend(tickets)
            self._lock.notify_all()
        return tickets

    def abort(self, ticket: Ticket) -> None:
        """Stops a submitted request, waiting or running, with an ``"abort"`` result (unless it
        ended meanwhile: then nothing more comes)."""
        with self._lock:
            if ticket.ended:
                return
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                ticket.end(_ended(ticket, FINISH_ABORT))
            elif ticket.worker is not None:
                self._aborts[ticket.worker].add(ticket)
                self._lock.notify_all()

    def close(self) -> None:
        """Aborts every request left (waiting ones at once, running ones after their engine's
        current step) and waits for the threads."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._lock.notify_all()
        for ticket in waiting:
            ticket.end(_ended(ticket, FINISH_ABORT))
        for thread in self._threads:
            thread.join()

    def _serve(self, index: int) -> None:
        engine = self.engines[index]
        running: dict[int, Ticket] = {}  # engine request id -> ticket
        taken: list[Ticket] = []
        try:
            while True:
                with self._lock:
                    self._rooms[index] = engine.room
                    while not (
                        self._closed or self._aborts[index] or engine.has_unfinished or (self._waiting and engine.room)
                    ):
                        self._lock.wait()
                    if self._closed:
                        break
                    aborts, self._aborts[index] = self._aborts[index], set()
                    taken = [self._waiting.popleft() for _ in range(self._share(index))]
                    self._rooms[index] -= len(taken)
                    for ticket in taken:
                        ticket.worker = index
                for ticket in aborts:
                    if running.pop(ticket.request_id, None) is not None:
                        engine.abort(ticket.request_id)
                        ticket.end(_ended(ticket, FINISH_ABORT))
                for ticket in taken:
                    ticket.request_id = engine.enqueue(ticket.request)
                    running[ticket.request_id] = ticket
                for event in engine.step() if engine.has_unfinished else ():
                    ticket = running[event.request_id]
                    if event.finish_reason is None:
                        ticket.updates.put(Update(ticket.tag, event))
                    else:
                        del running[event.request_id]
                        ticket.end(engine.result(event.request_id), event)
        except BaseException as error:  # the engine's state is unknown: this worker stops
            self._fail(index, error, running, [ticket for ticket in taken if ticket.request_id is None])
            return
        for request_id, ticket in running.items():  # closed
            engine.abort(request_id)
            ticket.end(_ended(ticket, FINISH_ABORT))

    def _share(self, index: int) -> int:
        """How many waiting requests worker ``index`` takes (under the lock): its part of them in
        proportion to its room among the rooms the workers last reported, at least one while it
        has room, never more than its room. So requests arriving together are spread over the
        idle engines rather than filling the first to look."""
        room, waiting, rooms = self._rooms[index], len(self._waiting), sum(self._rooms)
        return min(room, waiting, math.ceil(waiting * room / rooms)) if room else 0

    def _fail(self, index: int, error: BaseException, running: dict[int, Ticket], unqueued: list[Ticket]) -> None:
        """Ends the requests of a worker whose engine raised ``error`` (those ``running`` and
        those it took but had not queued yet) with error results; the waiting ones too when no
        worker is left."""
        message = f"engine {index} failed: {type(error).__name__}: {error}"
        for request_id in running:  # the host's bookkeeping, so nothing stays queued there
            self.engines[index].abort(request_id)
        with self._lock:
            self.failures.append(error)
            self._alive[index] = False
            self._rooms[index] = 0
            stranded = []
            if not self.alive:  # nobody will take the waiting requests
                stranded, self._waiting = list(self._waiting), collections.deque()
        for ticket in [*running.values(), *unqueued, *stranded]:
            ticket.end(_ended(ticket, FINISH_ERROR, error=message))


def _ended(ticket: Ticket, reason: str, error: str | None = None) -> GenerationResult:
    """The result of a request that did not finish by itself: what it generated so far."""
    request = ticket.request
    return GenerationResult(
        -1 if ticket.request_id is None else ticket.request_id, list(request.output), reason, error=error
    )


__all__ = ["EngineWorkers", "Ticket", "Update"]

"""``ember serve``'s Prometheus metrics, served at ``GET /metrics`` in the text format a Prometheus
server scrapes (``prometheus_client``). Every metric has the label ``model_name`` (the served
base model's name; requests to its adapters count under it).

Per request, observed by the HTTP handler as its updates arrive (:class:`CallTracker`):

- ``ember_time_to_first_token_seconds`` (histogram): submission to the first generated token;
- ``ember_e2e_request_latency_seconds`` (histogram): submission to the result;
- ``ember_time_per_output_token_seconds`` (histogram): after the first token, the mean time per
  token of each request that generated more than one;
- ``ember_prompt_tokens_total``, ``ember_generation_tokens_total`` (counters; generated tokens as
  they come, an aborted request's too);
- ``ember_requests_finished_total`` (counter, label ``finished_reason``: ``stop``, ``length``,
  ``abort`` (a client that went away, the server closing), ``error`` (an engine failed)).

Read from the engines at each scrape (:class:`EngineCollector`):

- ``ember_num_requests_running``, ``ember_num_requests_waiting`` (gauges; waiting: queued in an
  engine, or not yet taken by one);
- ``ember_kv_cache_usage_perc`` (gauge): the fraction of the engines' cache pages in use, 0 to 1
  (a page kept only by the prefix cache counts as free);
- ``ember_prefix_cache_hit_tokens_total`` (counter): tokens found cached, not computed (a prompt's
  and, for a preempted request started again, the tokens it had generated);
- ``ember_num_preemptions_total`` (counter);
- ``ember_engines_alive`` (gauge): engines that have not failed.

One request of an API call with ``n`` choices is one choice: each counts on its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ember.serving.requests import FINISH_ABORT
from ember.serving.workers import EngineWorkers, Ticket, Update

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
"""Seconds: a first token or a whole request, from a tiny model's step to a long generation's."""
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Seconds per output token: a fast decode step to a batch far beyond the device."""


class ServerMetrics:
    """The metrics of one server (their own registry: several servers in a process, as tests run
    them, count apart) over its ``workers``."""

    def __init__(self, workers: EngineWorkers, model_name: str):
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}
        self.time_to_first_token = Histogram(
            "ember_time_to_first_token_seconds",
            "Seconds from a request's submission to its first generated token.",
            buckets=LATENCY_BUCKETS,
            **label,
        ).labels(model_name)
        self.latency = Histogram(
            "ember_e2e_request_latency_seconds",
            "Seconds from a request's submission to its result.",
            buckets=LATENCY_BUCKETS,
            **label,
        ).labels(model_name)
        self.time_per_output_token = Histogram(
            "ember_time_per_output_token_seconds",
            "A request's mean seconds per generated token after its first (requests of more than one token).",
            buckets=TOKEN_BUCKETS,
            **label,
        ).labels(model_name)
        self.prompt_tokens = Counter("ember_prompt_tokens", "Prompt tokens of the requests submitted.", **label).labels(
            model_name
        )
        self.generation_tokens = Counter("ember_generation_tokens", "Tokens generated.", **label).labels(model_name)
        self._finished = Counter(
            "ember_requests_finished",
            "Requests ended, by reason: stop, length, abort (the client went away, the server closed), error.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name
        self.registry.register(EngineCollector(workers, model_name))

    def track(self, tickets: list[Ticket]) -> CallTracker:
        """A tracker of the requests of one API call, just submitted as ``tickets`` (tagged by
        their index)."""
        self.prompt_tokens.inc(sum(len(ticket.request.prompt) for ticket in tickets))
        return CallTracker(self, len(tickets))

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The body of ``GET /metrics`` and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class CallTracker:
    """Times the requests of one API call from their submission: :meth:`seen` with each of their
    updates, :meth:`close` once the call is answered (or its client went away)."""

    def __init__(self, metrics: ServerMetrics, count: int):
        self._metrics = metrics
        self._start = time.monotonic()
        self._first: list[float | None] = [None] * count
        self._ended = [False] * count

    def seen(self, update: Update) -> None:
        index, now = update.tag, time.monotonic()
        if self._ended[index]:
            return
        if update.event is not None and update.event.token is not None:
            self._metrics.generation_tokens.inc()
            if self._first[index] is None:
                self._first[index] = now
                self._metrics.time_to_first_token.observe(now - self._start)
        result = update.result
        if result is None:
            return
        self._ended[index] = True
        self._metrics.latency.observe(now - self._start)
        self._metrics.finished(result.finish_reason)
        first = self._first[index]
        if first is not None and len(result.tokens) > 1:
            self._metrics.time_per_output_token.observe((now - first) / (len(result.tokens) - 1))

    def close(self) -> None:
        """Counts the requests whose result the call did not wait for (its client went away, an
        error answered it) as aborted: the server aborts them."""
        for index, ended in enumerate(self._ended):
            if not ended:
                self._ended[index] = True
                self._metrics.finished(FINISH_ABORT)


class EngineCollector:
    """The gauges read from the engines at each scrape (module docstring). Their schedulers'
    queues and page pools are read without a lock: each figure is a length, read whole, and a
    scrape between two of a step's changes is off by that step at most."""

    def __init__(self, workers: EngineWorkers, model_name: str):
        self._workers = workers
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        engines = self._workers.engines
        schedulers = [engine.scheduler for engine in engines]
        total_pages = sum(engine.program.num_pages for engine in engines)
        free_pages = sum(scheduler.pages.num_free for scheduler in schedulers)
        gauges = {
            "ember_num_requests_running": ("Requests an engine is running.", sum(len(s.running) for s in schedulers)),
            "ember_num_requests_waiting": (
                "Requests waiting: queued in an engine, or not yet taken by one.",
                sum(len(s.waiting) for s in schedulers) + self._workers.num_unassigned,
            ),
            "ember_kv_cache_usage_perc": (
                "The fraction of the engines' cache pages in use (0 to 1).",
                1.0 - free_pages / total_pages,
            ),
            "ember_engines_alive": ("Engines that have not failed.", self._workers.alive),
        }
        for name, (documentation, value) in gauges.items():
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric(self._labels, value)
            yield gauge
        preemptions = CounterMetricFamily(
            "ember_num_preemptions", "Requests preempted (their cache freed, to be recomputed).", labels=["model_name"]
        )
        preemptions.add_metric(self._labels, sum(s.num_preemptions for s in schedulers))
        yield preemptions
        hits = CounterMetricFamily(
            "ember_prefix_cache_hit_tokens",
            "Tokens found in the prefix cache (their keys and values shared, not computed): prompts', and a preempted"
            " request's generated ones when it starts again.",
            labels=["model_name"],
        )
        hits.add_metric(self._labels, sum(s.pages.hit_tokens for s in schedulers))
        yield hits


__all__ = ["CallTracker", "EngineCollector", "ServerMetrics"]

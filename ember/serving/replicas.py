"""Data-parallel serving: one model served by several engines at once, each on its own devices.

    meshes = replica_meshes(MeshConfig(data=4, tensor=2))       # 4 engines of 2 devices each
    replicas = Replicas.from_model(config, params, meshes, tokenizer=tokenizer, num_slots=8)
    results = replicas.generate(prompts, SamplingParams(max_tokens=64))      # in prompt order

Batch inference on more devices than one model needs: ``mesh.data`` replicas of the engine, each
split over its own ``tensor`` x ``expert`` devices (:func:`ember.serving.mesh.replica_meshes`).
:meth:`Replicas.generate` spreads the requests over the engines, balanced by the work each asks
for (its prompt's length plus ``max_tokens``; the largest first, each to the engine with the
least so far), and runs each engine's share with ``Engine.generate`` in a thread of its own: the
devices compute at once while the host's scheduling of each step takes turns. A request's tokens
are those any one engine gives it (sampling is seeded per request, never per engine or slot).
Results come back in prompt order, and each is reported to ``on_result`` as soon as it is known,
from whichever thread finished it (the calls, and the progress bar's, one at a time).

A bad prompt is an error result, as on one engine. An exception in any engine's thread (or in
``on_result``), or an interrupt of the caller, stops every engine at its next token, their
unfinished requests aborted, and is raised once they all stopped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from types import NoneType
from typing import Any

from jax.sharding import Mesh

from ember.serving.engine import Engine, Prompt, params_per_prompt
from ember.serving.requests import GenerationResult, SamplingParams


class Replicas:
    """Several engines of one model, serving one batch of requests together (module docstring)."""

    def __init__(self, engines: Sequence[Engine]):
        if not engines:
            raise ValueError("Replicas needs at least one engine")
        self.engines = list(engines)

    @classmethod
    def from_model(cls, config: Any, params: Any, meshes: Sequence[Mesh], **engine_options: Any) -> Replicas:
        """An engine of ``DecoderLM(config)`` with ``params`` (host arrays: each replica places
        its own copy) on each of ``meshes``; ``engine_options`` go to every ``Engine.from_model``
        (``tokenizer``, ``num_slots``, ``token_budget``, ...)."""
        return cls.build(lambda mesh: Engine.from_model(config, params, mesh=mesh, **engine_options), meshes)

    @classmethod
    def build(cls, engine_of: Callable[[Any], Engine], replicas: Sequence[Any]) -> Replicas:
        """The engines ``engine_of(replica)`` of ``replicas`` (what each is built from: its mesh,
        say), compiled in threads of their own, at once."""
        with ThreadPoolExecutor(len(replicas)) as pool:
            return cls(list(pool.map(engine_of, replicas)))

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """``Engine.encode_prompt`` (every replica encodes alike)."""
        return self.engines[0].encode_prompt(prompt)

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: Any = None,
        on_result: Callable[[int, GenerationResult], None] | None = None,
    ) -> list[GenerationResult]:
        """``Engine.generate`` over the replicas: results in prompt order; ``progress`` (a
        tqdm-like bar) advanced by one per generated token and ``on_result(index, result)``
        called as each prompt's result is known, index into ``prompts``. A bad prompt gets an
        error result, as on one engine; results' ``request_id`` are each engine's own."""
        params_list = params_per_prompt(prompts, params)
        shares = balanced_shares([_work(prompt, p) for prompt, p in zip(prompts, params_list)], len(self.engines))
        results: list[GenerationResult | None] = [None] * len(prompts)
        lock, stop = threading.Lock(), threading.Event()

        def serve(engine: Engine, share: list[int]) -> None:
            def reported(index: int, result: GenerationResult) -> None:
                with lock:
                    results[share[index]] = result
                    if on_result is not None:
                        on_result(share[index], result)

            bar = _StoppableProgress(progress, lock, stop)
            try:
                engine.generate([prompts[i] for i in share], [params_list[i] for i in share], progress=bar,
                                on_result=reported)  # fmt: skip
            except BaseException:
                stop.set()  # now: the other engines stop at their next token
                raise

        with ThreadPoolExecutor(len(self.engines)) as pool:  # leaving it waits for every thread
            futures = [pool.submit(serve, e, share) for e, share in zip(self.engines, shares) if share]
            try:
                wait(futures)
            except BaseException:  # an interrupt of the caller: every engine stops
                stop.set()
                raise
        failures = [f.exception() for f in futures if not isinstance(f.exception(), (_Stopped, NoneType))]
        if failures:
            raise failures[0]
        return results  # type: ignore[return-value]


def balanced_shares(work: Sequence[float], count: int) -> list[list[int]]:
    """``count`` lists of indices into ``work`` (each share in index order) whose sums of work
    are near equal: the largest first, each to the share with the least so far."""
    shares: list[list[int]] = [[] for _ in range(count)]
    loads = [0.0] * count
    for index in sorted(range(len(work)), key=lambda i: -work[i]):
        least = min(range(count), key=loads.__getitem__)
        shares[least].append(index)
        loads[least] += work[index]
    return [sorted(share) for share in shares]


def _work(prompt: Prompt, params: SamplingParams | None) -> float:
    """What a request asks of an engine, roughly: its prompt's length (characters or tokens) and
    the tokens it may generate."""
    return len(prompt) + (params or SamplingParams()).max_tokens


class _Stopped(Exception):
    """Raised in an engine's thread to stop it because another failed (or the caller was interrupted)."""


class _StoppableProgress:
    """An engine's progress bar: advances the shared one (``bar``, under ``lock``) and raises
    ``_Stopped`` once ``stop`` is set, which ends that engine's ``generate`` at its next token."""

    def __init__(self, bar: Any, lock: threading.Lock, stop: threading.Event):
        self._bar, self._lock, self._stop = bar, lock, stop

    def update(self, count: int = 1) -> None:
        if self._stop.is_set():
            raise _Stopped
        if self._bar is not None:
            with self._lock:
                self._bar.update(count)


__all__ = ["Replicas", "balanced_shares"]

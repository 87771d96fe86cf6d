"""Data-parallel serving: one model served by several engines at once, each on its own devices.

    meshes = replica_meshes(MeshConfig(data=4, tensor=2))       # 4 engines of 2 devices each
    replicas = Replicas.from_model(config, params, meshes, tokenizer=tokenizer, num_slots=8)
    results = replicas.generate(prompts, SamplingParams(max_tokens=64))      # in prompt order

Batch inference on more devices than one model needs: ``mesh.data`` replicas of the engine, each
split over its own ``tensor`` x ``expert`` devices (:func:`ember.serving.mesh.replica_meshes`).
:meth:`Replicas.generate` queues the requests for :class:`~ember.serving.workers.EngineWorkers`: each
engine, stepped in a thread of its own, takes the next request whenever it can start one, so an
engine whose requests end early (on EOS, say) takes more and none waits idle while requests
queue; the devices compute at once while the host's scheduling of each step takes turns. A
request's tokens are those any one engine gives it (sampling is seeded per request, unseeded
ones by their order in the calls to ``generate``, never per engine or slot). Results come back
in prompt order, and each is reported to ``on_result`` as soon as it is known, in the caller's
thread.

A bad prompt is an error result, as on one engine. An engine failing, an exception in
``on_result`` or an interrupt of the caller stops every engine at its next token, their
unfinished requests aborted, and is raised once they all stopped.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jax.sharding import Mesh

from ember.serving.engine import Engine, Prompt, params_per_prompt
from ember.serving.requests import FINISH_ERROR, GenerationResult, SamplingParams
from ember.serving.workers import EngineWorkers, Update


class Replicas:
    """Several engines of one model, serving one batch of requests together (module docstring)."""

    def __init__(self, engines: Sequence[Engine]):
        if not engines:
            raise ValueError("Replicas needs at least one engine")
        self.engines = list(engines)
        self._submitted = 0  # requests given to the engines so far: the next unseeded one's seed

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

    @property
    def tokenizer(self) -> Any:
        """The engines' tokenizer (every replica's is the same), or None."""
        return self.engines[0].tokenizer

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
        called as each prompt's result is known (a bad prompt's first), index into ``prompts``,
        both in the caller's thread. A bad prompt gets an error result, as on one engine;
        results' ``request_id`` are each engine's own."""
        params_list = params_per_prompt(prompts, params)
        results: list[GenerationResult | None] = [None] * len(prompts)
        updates: queue.Queue[Update] = queue.Queue()
        prepared, tags = [], []
        for index, (prompt, p) in enumerate(zip(prompts, params_list)):
            try:
                prepared.append(self.engines[0].prepare(prompt, p))
                tags.append(index)
            except ValueError as error:
                results[index] = GenerationResult(-1, [], FINISH_ERROR, error=str(error))
        with EngineWorkers(self.engines, first_seed=self._submitted) as workers:  # leaving it stops every engine
            workers.submit_prepared(prepared, updates, tags)  # at once: each engine takes its share
            self._submitted += workers.submitted
            if on_result is not None:
                for index, result in enumerate(results):
                    if result is not None:
                        on_result(index, result)
            finished = 0
            while finished < workers.submitted:
                update = updates.get()
                if progress is not None and update.event is not None and update.event.token is not None:
                    progress.update(1)
                if update.result is None:
                    continue
                if workers.failures:  # an engine failed: its error, once every engine stopped
                    raise workers.failures[0]
                finished += 1
                results[update.tag] = update.result
                if on_result is not None:
                    on_result(update.tag, update.result)
        return results  # type: ignore[return-value]


__all__ = ["Replicas"]

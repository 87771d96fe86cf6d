"""``Engine``: continuous batching over a compiled :class:`~ember.serving.program.DeviceProgram`.

    engine = Engine.from_model(config, params, tokenizer=ByteTokenizer(), num_slots=8)
    results = engine.generate(["Once upon", "The"], SamplingParams(max_tokens=32))
    for event in engine.stream(["Hello"], SamplingParams(max_tokens=8)): ...

Each :meth:`Engine.step` asks the scheduler for a token budget's worth of chunks (decodes
and prefill chunks), packs them back to back into the smallest compiled token bucket that
holds them (one flat budget, each slot's chunk a run of it), runs the compiled step on them
(cache pages donated) and fetches the sampled tokens in one explicit ``device_get``. The
step's inputs go to the device as host arrays, which the compiled step's own dispatch
transfers where it was compiled to take them: a ``jax.device_put`` of the same ten small
arrays took 200 us of Python each step (the tiny model's decode step 1.5 -> 1.2 ms on CPU).
Nothing else crosses between host and device, so a step runs under
``jax.transfer_guard("disallow")`` (it allows its inputs' transfer). A step that holds a request
asking for prompt log-probabilities or alternatives (``SamplingParams.prompt_logprobs``,
``top_logprobs``) runs the program's scoring step instead, which also fetches every row's scores.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from ember.core.integers import is_integer
from ember.core.jsonl import lone_surrogate
from ember.serving.program import DeviceProgram, batch_arrays
from ember.serving.requests import (
    FINISH_ERROR,
    FINISH_STOP,
    GenerationResult,
    Request,
    SamplingParams,
    TokenEvent,
)
from ember.serving.sampling import fill_settings, settings_array
from ember.serving.scheduler import Scheduler, SchedulerConfig, eos_ids_of
from ember.serving.scores import record_scores, wants_scores


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer (``ByteTokenizer``, ``HFTokenizer``):
    ``add_special_tokens=False`` encodes a piece of text without the BOS a prompt starts with."""

    eos_id: int | None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> Sequence[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


Prompt = str | Sequence[int]


class Engine:
    """Serves requests on one device program; see the module docstring."""

    def __init__(
        self,
        program: DeviceProgram,
        *,
        token_budget: int | None = None,
        tokenizer: Tokenizer | None = None,
        eos_id: int | Sequence[int] | None = None,
        prefix_caching: bool = True,
    ):
        """Args:
        program: the compiled steps and their cache.
        token_budget: tokens per step over all slots (decodes first, then prefill
          chunks); default and most the program's largest token bucket.
        tokenizer: turns text prompts and stop strings into tokens and outputs into text.
        eos_id: the end-of-sequence token, or several (any of them ends a request, as
          Llama-3-Instruct's three do); default the tokenizer's, else none. The engine holds
          them as ``eos_ids``.
        prefix_caching: requests whose sequences begin alike share the cache pages of that
          beginning (:mod:`ember.serving.prefix_cache`), where the program allows it (a model
          whose every layer keeps its cache in the pages); False: every request computes all.
        """
        self.program = program
        self.tokenizer = tokenizer
        token_budget = program.token_budget if token_budget is None else token_budget
        if not 1 <= token_budget <= program.token_budget:
            raise ValueError(
                f"token_budget must be in [1, {program.token_budget}] (the largest compiled bucket), got {token_budget}"
            )
        self.eos_ids = eos_ids_of(eos_id if eos_id is not None else getattr(tokenizer, "eos_id", None))
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_slots=program.num_slots,
                token_budget=token_budget,
                chunk_size=token_budget,
                page_size=program.page_size,
                num_pages=program.num_pages,
                max_context=program.max_context,
                eos_ids=self.eos_ids,
                prefix_caching=prefix_caching and program.shares_prefixes,
            )
        )
        self._requests: dict[int, Request] = {}
        self._queues: dict[int, collections.deque[TokenEvent]] = {}  # request id -> its run_until_done's events
        self._next_id = 0
        self.tokens_generated = 0

    @classmethod
    def from_model(
        cls,
        config: Any,
        params: Any,
        *,
        tokenizer: Tokenizer | None = None,
        eos_id: int | Sequence[int] | None = None,
        prefix_caching: bool = True,
        **program_options: Any,
    ) -> Engine:
        """An engine for ``DecoderLM(config)`` with ``params``; ``program_options`` go to
        :func:`ember.serving.model_program.build_program` (``num_slots``, ``token_budget``,
        ``token_buckets``, ``max_context``, ``num_pages``, ``kv_dtype``, ``adapters``: name ->
        adapter leaves, served at once; a request picks one with ``SamplingParams.adapter``;
        ``mesh``: a ``jax.sharding.Mesh`` to split the model over, tensor-parallel)."""
        from ember.serving.model_program import build_program  # keeps artifact serving free of model code

        program = build_program(config, params, **program_options)
        return cls(program, tokenizer=tokenizer, eos_id=eos_id, prefix_caching=prefix_caching)

    def update_params(self, params: Any) -> None:
        """Serves ``params`` from the next step on (the whole weight tree or a nested-dict part
        of it, e.g. the leaves a training step updated): copied device to device, same shapes
        and dtypes, so the compiled steps run them without recompiling. Requests in flight
        continue on the new weights; their cached keys and values stay as computed.
        Raises ``ValueError`` for a weight the engine does not serve or a shape/dtype change.
        The prefix cache forgets the pages computed with the old weights."""
        self.program.load_params(params)
        self.scheduler.pages.forget()

    # Requests -----------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of ``prompt``; raises ``ValueError`` describing what is wrong with it."""
        return prompt_tokens(prompt, self.tokenizer, self.program.vocab_size, self.program.max_context)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Queues a request and returns its id; raises ``ValueError`` for a bad prompt."""
        return self.enqueue(self.prepare(prompt, params))

    def abort(self, request_id: int) -> None:
        """Stops a request, waiting or running (its pages and slot are freed), and forgets it
        with what it generated; an id the engine no longer knows is ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request)

    def prepare(self, prompt: Prompt, params: SamplingParams | None) -> Request:
        """The request of ``prompt``, checked but not queued (its id is set by :meth:`enqueue`),
        which any engine of the same model and adapters may serve; raises ``ValueError`` for
        what is wrong with it."""
        params = SamplingParams() if params is None else params
        if params.adapter is not None and params.adapter not in self.program.adapter_names:
            known = ", ".join(self.program.adapter_names) or (
                "none (adapters are given when the engine is built: Engine.from_model(..., adapters=...), or "
                "ember generate --adapter NAME=DIR with a run or model directory)"
            )
            raise ValueError(f"unknown adapter {params.adapter!r}; this engine's adapters: {known}")
        if (params.prompt_logprobs or params.top_logprobs) and self.program.scoring_steps is None:
            raise ValueError(
                "prompt_logprobs and top_logprobs need the model's scoring steps, which this engine's program "
                "(an exported one) has not; serve the model itself (a run or Hugging Face directory)"
            )
        tokens = self.encode_prompt(prompt)
        stops = params.stop_token_ids
        # Stop strings are matched in the output's text (_end_on_stop_strings) and also as their
        # encodings here: decoding drops special tokens, so a stop string that names one
        # ("<|im_end|>") is never found in the text, only as its token.
        if params.stop:
            if self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; use stop_token_ids")
            encoded = (
                self.tokenizer.encode(_unicode_text(s, "a stop string"), add_special_tokens=False) for s in params.stop
            )
            stops = stops + tuple(tuple(int(t) for t in ids) for ids in encoded)
        return Request(-1, tokens, params, stop_sequences=stops)

    def enqueue(self, request: Request) -> int:
        """Queues a request of :meth:`prepare` (an unseeded one seeded with its id); returns its id."""
        request.request_id = self._next_id
        self._next_id += 1
        request.params = request.params.seeded(request.request_id)
        self._requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def room(self) -> int:
        """How many more requests the next step could start: its free slots, or 0 while any
        request waits (for a slot, or for pages)."""
        return 0 if self.scheduler.waiting else self.scheduler.num_free_slots

    def result(self, request_id: int) -> GenerationResult:
        """The result of a finished request (which the engine then forgets)."""
        request = self._requests[request_id]
        if not request.finished:
            raise ValueError(f"request {request_id} has not finished")
        del self._requests[request_id]
        params = request.params
        prompt_logprobs, prompt_top_logprobs = request.asked_prompt_scores()
        return GenerationResult(
            request_id=request_id,
            tokens=list(request.output),
            finish_reason=request.finish_reason,
            text=self.tokenizer.decode(request.output) if self.tokenizer is not None else None,
            logprobs=list(request.logprobs) if params.logprobs else None,
            eos_token=request.eos_token,
            top_logprobs=list(request.top_logprobs) if params.logprobs and params.top_logprobs else None,
            prompt_logprobs=prompt_logprobs,
            prompt_top_logprobs=prompt_top_logprobs,
        )

    # Running ------------------------------------------------------------------------------

    def step(self, token_budget: int | None = None) -> list[TokenEvent]:
        """Runs one iteration; returns the token events it produced."""
        if token_budget is not None and token_budget > self.program.token_budget:
            raise ValueError(
                f"token_budget {token_budget} exceeds the largest compiled bucket {self.program.token_budget}"
            )
        chunks = self.scheduler.schedule(token_budget)
        if not chunks:
            return []
        program = self.program
        used = sum(len(chunk.tokens) for chunk in chunks)
        bucket = next(size for size in program.token_buckets if size >= used)
        scoring = any(wants_scores(chunk) for chunk in chunks)
        batch = batch_arrays(
            program.num_slots, bucket, program.pages_per_seq, adapters=bool(program.adapter_names), targets=scoring
        )
        settings = settings_array(program.num_slots)
        offset = 0
        for chunk in chunks:
            request, slot, count = chunk.request, chunk.request.slot, len(chunk.tokens)
            batch["tokens"][offset : offset + count] = chunk.tokens
            if scoring:  # each row is scored for the token after it
                following = request.tokens[chunk.start + 1 : chunk.start + count + 1]
                batch["targets"][offset : offset + len(following)] = following
            batch["query_starts"][slot] = offset
            batch["query_lens"][slot] = count
            batch["kv_lens"][slot] = chunk.start + count
            batch["page_table"][slot, : len(request.pages)] = request.pages
            fill_settings(settings, slot, request.params, sample_index=len(request.output))
            if request.params.adapter is not None:
                batch["adapters"][slot] = program.adapter_names.index(request.params.adapter)
            offset += count
        step = program.scoring_steps[bucket] if scoring else program.steps[bucket]
        # The batch and settings go as host arrays, made afresh each step: on CPU, JAX may read
        # them in place until the step has run (the device_get below waits for it).
        with jax.transfer_guard_host_to_device("allow"):
            program.kv, tokens, logprobs, *scores = step(program.params, program.kv, batch, settings)
        tokens, logprobs, scores = jax.device_get((tokens, logprobs, scores))
        alternatives = record_scores(chunks, scores[0]) if scoring else None
        slots = [chunk.request.slot for chunk in chunks]
        events = self.scheduler.commit(chunks, tokens[slots].tolist(), logprobs[slots].tolist(), alternatives)
        self._end_on_stop_strings(events)
        for event in events:
            if event.request_id in self._queues:
                self._queues[event.request_id].append(event)
        self.tokens_generated += sum(event.token is not None for event in events)
        return events

    def _end_on_stop_strings(self, events: list[TokenEvent]) -> None:
        """Ends each request whose output's text now holds one of its stop strings, however
        its tokens split that text (a BPE model writes " world" as one token, which the
        encoding of the stop string "world" does not match): its output keeps the tokens
        before the one where the stop string starts, and its event finishes with "stop"."""
        for event in events:
            request = self._requests[event.request_id]
            if event.token is None or event.finish_reason == FINISH_STOP or not request.params.stop:
                continue
            kept = _before_stop_string(self.tokenizer, request.output, request.params.stop)
            if kept is not None:
                request.keep_output(kept)
                self.scheduler.finish(request, FINISH_STOP)
                event.finish_reason = FINISH_STOP

    def run_until_done(self, request_ids: Iterable[int]) -> Iterator[TokenEvent]:
        """Steps until every request of ``request_ids`` finished, yielding their events
        (other queued requests run too; their events are not yielded). A request aborted
        meanwhile (:meth:`abort`, e.g. by the consumer of these events) is no longer waited for.
        Several of these may be consumed in turns (two streams): the events of a step one of
        them runs reach the one waiting for them."""
        pending = {i for i in request_ids if not self._requests[i].finished}
        queue: collections.deque[TokenEvent] = collections.deque()
        for request_id in pending:
            self._queues[request_id] = queue
        try:
            while pending:
                if not queue:
                    self.step()  # fills the queues of the requests it ran
                while queue:
                    event = queue.popleft()
                    yield event
                    if event.finish_reason is not None:
                        pending.discard(event.request_id)
                pending.intersection_update(self._requests)  # abort() forgets a request: nothing more comes
        finally:
            for request_id in request_ids:
                if self._queues.get(request_id) is queue:
                    del self._queues[request_id]

    def stream(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[TokenEvent]:
        """Token events of ``prompts`` as they are generated (request ids count up from the
        first prompt's). Every request is checked before any is queued (``ValueError``: none
        runs). Tokens are streamed as sampled: the tail of a stop sequence appears in the
        stream although the final result leaves it out. Closing the stream early aborts its
        unfinished requests."""
        params_list = params_per_prompt(prompts, params)
        requests = [self.prepare(prompt, p) for prompt, p in zip(prompts, params_list)]
        ids = [self.enqueue(request) for request in requests]
        try:
            yield from self.run_until_done(ids)
        finally:
            for request_id in ids:
                self.abort(request_id)  # forgets the finished ones too

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: Any = None,
        on_result: Callable[[int, GenerationResult], None] | None = None,
    ) -> list[GenerationResult]:
        """Generates for every prompt; results in prompt order. A bad prompt gets a result
        with ``finish_reason="error"``, ``error`` set and ``request_id`` -1 (it never became
        a request); the others run normally. Every request is checked before any is queued;
        an exception (an interrupt) aborts the requests still unfinished.
        ``progress``: an optional tqdm-like bar, advanced by one per generated token.
        ``on_result(index, result)``: called with each prompt's result as soon as it is known
        (a bad prompt's first, the others as they finish), so a caller can keep what is done."""
        params_list = params_per_prompt(prompts, params)
        prepared: list[Request | str] = []
        for prompt, p in zip(prompts, params_list):
            try:
                prepared.append(self.prepare(prompt, p))
            except ValueError as error:
                prepared.append(str(error))
        results: list[GenerationResult | None] = [
            None if isinstance(r, Request) else GenerationResult(-1, [], FINISH_ERROR, error=r) for r in prepared
        ]
        if on_result is not None:
            for index, result in enumerate(results):
                if result is not None:
                    on_result(index, result)
        index_of = {self.enqueue(r): i for i, r in enumerate(prepared) if isinstance(r, Request)}

        def finished(request_id: int) -> None:
            index = index_of[request_id]
            results[index] = self.result(request_id)
            if on_result is not None:
                on_result(index, results[index])

        try:
            for event in self.run_until_done(index_of):
                if progress is not None and event.token is not None:
                    progress.update(1)
                if event.finish_reason is not None:
                    finished(event.request_id)
            return results
        finally:
            for request_id in index_of:
                self.abort(request_id)  # those an exception left unfinished (result() forgot the rest)


def _unicode_text(text: str, what: str) -> str:
    """``text``, or ``ValueError`` naming ``what`` when it is not Unicode text a tokenizer can
    encode: a lone surrogate (JSON's ``"\\ud800"`` decodes to one) fails the byte tokenizer with
    a codec error and a Hugging Face one with a ``TypeError``."""
    surrogate = lone_surrogate(text)
    if surrogate:
        index, code_point = surrogate
        raise ValueError(f"{what} is not valid Unicode text: it holds a lone surrogate {code_point} at index {index}")
    return text


def prompt_tokens(
    prompt: Prompt, tokenizer: Tokenizer | None, vocab_size: int, max_context: int | None = None
) -> list[int]:
    """Token ids of ``prompt`` (text, encoded by ``tokenizer``, or token ids) as a model of
    ``vocab_size`` ids and ``max_context`` positions takes them (None: the caller bounds the
    length); raises ``ValueError`` describing what is wrong with it (not Unicode text, empty, an
    id out of range, too long)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids (prompt_tokens) instead")
        tokens = [int(t) for t in tokenizer.encode(_unicode_text(prompt, "the prompt"))]
    elif isinstance(prompt, Sequence | np.ndarray):
        if not all(is_integer(t) for t in prompt):
            raise ValueError("prompt tokens must be integers")
        tokens = [int(t) for t in prompt]
    else:
        raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
    if not tokens:
        raise ValueError("the prompt is empty")
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token {tokens[bad]} at index {bad} is out of range [0, {vocab_size})")
    if max_context is not None and len(tokens) > max_context:
        raise ValueError(f"the prompt has {len(tokens)} tokens, more than the context of {max_context}")
    return tokens


def _before_stop_string(tokenizer: Tokenizer, output: list[int], stops: Sequence[str]) -> int | None:
    """How many of ``output``'s tokens precede the first of ``stops`` in its text, or None if
    its text holds none. Called after every token, so only the newest tokens are decoded: a
    stop string of ``n`` UTF-8 bytes lies within the last ``n`` tokens (each decodes to a byte
    or more), and two more keep a leading space that a tokenizer drops from a first token."""
    tail = output[-(max(len(s.encode("utf-8")) for s in stops) + 2) :]
    text = tokenizer.decode(tail)
    found = [index for index in (text.find(s) for s in stops) if index >= 0]
    if not found:
        return None
    kept = next(j for j in range(len(tail), -1, -1) if len(tokenizer.decode(tail[:j])) <= min(found))
    return len(output) - len(tail) + kept


def params_per_prompt(prompts: Sequence[Prompt], params: Any) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt (``None`` entries: the defaults) from what ``generate`` and
    ``stream`` take: one for all, a list of them, or ``None``; ``ValueError`` for anything else."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of prompts (text or token lists), got a single string")
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * len(prompts)
    if isinstance(params, Mapping) or not isinstance(params, Iterable):  # a dict's keys are no SamplingParams
        raise ValueError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
    wrong = next((p for p in params if p is not None and not isinstance(p, SamplingParams)), None)
    if wrong is not None:
        raise ValueError(f"params must be SamplingParams (or None for the defaults), got a {type(wrong).__name__}")
    return params


__all__ = ["Engine", "Prompt", "Tokenizer", "params_per_prompt", "prompt_tokens"]

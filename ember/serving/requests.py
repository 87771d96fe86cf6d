"""What a caller asks of the engine and what it gets back: ``SamplingParams``, the host-side
``Request`` the scheduler moves through its states, and the JSON-serialisable
``GenerationResult`` / ``TokenEvent``.

A request's sequence is ``prompt + output``; ``num_computed`` of its tokens have their keys
and values in the paged cache. Preemption by recompute sets ``num_computed`` back to 0 and
keeps ``output``, so the recomputed prefix is the prompt plus what was generated so far.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ember.core.integers import is_integer

FINISH_STOP = "stop"
"""Finished on an end-of-sequence token or a stop sequence (neither is part of the output)."""
FINISH_LENGTH = "length"
"""Finished on ``max_tokens`` or on the context limit."""
FINISH_ERROR = "error"
"""Rejected before running (see ``GenerationResult.error``)."""
FINISH_ABORT = "abort"
"""Stopped by its caller before it finished (``Engine.abort``, a stream closed early)."""

MAX_SEED = 2**31 - 1
MAX_TOP_LOGPROBS = 20
"""The most alternatives ``SamplingParams.top_logprobs`` may ask for per token (OpenAI's limit)."""

Alternatives = list[tuple[int, float]]
"""A token's most likely alternatives: ``(token, log-probability)`` pairs, most likely first."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    ``temperature`` 0 is greedy (``top_k``/``top_p``/``seed`` then play no part); ``top_k``
    0 keeps every token; ``top_p`` 1 keeps every token. Top-k is applied first, then top-p
    on the renormalised top-k distribution. The ``i``-th generated token of a request is
    drawn with ``fold_in(PRNGKey(seed), i)``, so a seed gives the same tokens whatever else
    is in the batch. ``seed`` None (the default) is the request's id in its engine (its
    submission's number when :class:`~ember.serving.workers.EngineWorkers` spread requests over
    several), so repeated prompts sample differently and a fresh engine given the same requests
    in the same order samples the same tokens again. ``stop`` holds text stop sequences: a request
    ends when the text of its output holds one, however the tokens split it (the output
    keeps the tokens before the one where it starts); ``stop_token_ids`` holds stop
    sequences as token ids.
    ``logprobs`` asks for the model's log-probability of each generated token (of the
    unmodified distribution, before temperature/top-k/top-p); ``prompt_logprobs`` for that of
    each prompt token after the first, given the tokens before it (scoring a text: with it,
    ``max_tokens`` may be 0, and the request ends once its prompt is read); ``top_logprobs``
    for as many most likely alternatives of each (up to :data:`MAX_TOP_LOGPROBS`), with their
    log-probabilities. Both need the model's steps (an engine of an exported program has only
    the sampled tokens'). ``adapter`` names one of the
    engine's adapters to generate with (None: the base model). A field of the wrong value or
    type (a bool for a number, a string for a number) raises ``ValueError`` saying what it allows.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    logprobs: bool = False
    prompt_logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    adapter: str | None = None

    def __post_init__(self):
        for name in ("logprobs", "prompt_logprobs", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {_shown(getattr(self, name))}")
        if self.prompt_logprobs:
            _check("max_tokens", self.max_tokens, numbers.Integral, lambda v: v >= 0, "an integer >= 0")
        else:
            _check("max_tokens", self.max_tokens, numbers.Integral, lambda v: v >= 1, "a positive integer")
        _check(
            "temperature",
            self.temperature,
            numbers.Real,
            lambda v: math.isfinite(v) and v >= 0,
            "a finite number >= 0 (0 = greedy)",
        )
        _check("top_k", self.top_k, numbers.Integral, lambda v: v >= 0, "an integer >= 0 (0 = off)")
        _check("top_p", self.top_p, numbers.Real, lambda v: 0 < v <= 1, "a number in (0, 1]")
        if self.seed is not None:
            _check("seed", self.seed, numbers.Integral, lambda v: 0 <= v <= MAX_SEED, f"an integer in [0, {MAX_SEED}]")
        _check(
            "top_logprobs",
            self.top_logprobs,
            numbers.Integral,
            lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
            f"an integer in [0, {MAX_TOP_LOGPROBS}]",
        )
        if self.top_logprobs and not (self.logprobs or self.prompt_logprobs):
            raise ValueError(
                f"top_logprobs={self.top_logprobs} gives alternatives to the log-probabilities that logprobs "
                "(generated tokens) or prompt_logprobs (prompt tokens) asks for; set one of them"
            )
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not _is_list(stop) or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {_shown(self.stop)}")
        object.__setattr__(self, "stop", tuple(stop))
        sequences = self.stop_token_ids
        if not _is_list(sequences) or not all(_is_token_sequence(sequence) for sequence in sequences):
            raise ValueError(
                "stop_token_ids must be a list of non-empty lists of token ids (integers >= 0), "
                f"got {_shown(sequences)}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(tuple(int(t) for t in sequence) for sequence in sequences))
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(f"adapter must be an adapter's name, got {_shown(self.adapter)}")

    def seeded(self, number: int) -> SamplingParams:
        """These params, or, when ``seed`` is None, them with ``seed`` ``number`` (wrapped into
        ``[0, MAX_SEED]``): an unseeded request's seed is its number in order of arrival."""
        return self if self.seed is not None else dataclasses.replace(self, seed=number % (MAX_SEED + 1))

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> SamplingParams:
        """From a JSON object's sampling fields; unknown names raise ``ValueError``."""
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"unknown sampling field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
        return cls(**fields)


def _check(name: str, value: Any, kind: type, valid: Callable[[Any], bool], allowed: str) -> None:
    """Raises ``ValueError`` unless ``value`` is a ``kind`` number (never a bool) that is ``valid``."""
    if isinstance(value, bool) or not isinstance(value, kind) or not valid(value):
        raise ValueError(f"{name} must be {allowed}, got {_shown(value)}")


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence | np.ndarray) and not isinstance(value, str)


def _is_token_sequence(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of token ids (integers >= 0, not bools)."""
    return _is_list(value) and len(value) > 0 and all(is_integer(t) and t >= 0 for t in value)


def _shown(value: Any) -> str:
    """``value`` for an error message, with its type (``'0.5' (str)``, ``True (bool)``)."""
    return f"{value!r} ({type(value).__name__})"


@dataclasses.dataclass(eq=False)  # compared by identity: the scheduler's queues hold these
class Request:
    """One request's host-side state (owned and mutated by the scheduler)."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[Alternatives] = dataclasses.field(default_factory=list)
    """Each output token's alternatives, when ``params.top_logprobs`` asks for them."""
    prompt_logprobs: list[float] = dataclasses.field(default_factory=list)
    """``prompt[1:]``'s log-probabilities so far, when ``params.prompt_logprobs`` asks for them."""
    prompt_top_logprobs: list[Alternatives] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None
    eos_token: int | None = None
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        """The whole sequence: prompt then generated tokens."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def asked_prompt_scores(self) -> tuple[list[float] | None, list[Alternatives] | None]:
        """Copies of ``prompt[1:]``'s log-probabilities and alternatives, each None where the
        params do not ask for it."""
        params = self.params
        logprobs = list(self.prompt_logprobs) if params.prompt_logprobs else None
        alternatives = list(self.prompt_top_logprobs) if params.prompt_logprobs and params.top_logprobs else None
        return logprobs, alternatives

    def keep_output(self, count: int) -> None:
        """Drops the output after its first ``count`` tokens (with their log-probabilities)."""
        del self.output[count:], self.logprobs[count:], self.top_logprobs[count:]


@dataclasses.dataclass
class TokenEvent:
    """One step of one request in a stream: the new token (None when the request finished
    without one, e.g. on EOS) and, on the last event, the finish reason."""

    request_id: int
    token: int | None
    logprob: float | None = None
    finish_reason: str | None = None
    top_logprobs: Alternatives | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerationResult:
    """A finished request: generated ``tokens`` (without EOS or a matched stop sequence),
    ``text`` when the engine knows a tokenizer, ``finish_reason``, ``eos_token`` (the
    end-of-sequence id it stopped on, if it did) and, on request, per-token ``logprobs``, their
    ``top_logprobs`` alternatives, and ``prompt_logprobs`` (of ``prompt[1:]``) with their
    ``prompt_top_logprobs``; or ``error`` (with ``finish_reason`` ``"error"``)."""

    request_id: int
    tokens: list[int]
    finish_reason: str
    text: str | None = None
    logprobs: list[float] | None = None
    error: str | None = None
    eos_token: int | None = None
    top_logprobs: list[Alternatives] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[Alternatives] | None = None

    def to_json(self) -> dict[str, Any]:
        """A dict of JSON types, without the fields that do not apply."""
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


__all__ = [
    "FINISH_ABORT",
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "MAX_TOP_LOGPROBS",
    "Alternatives",
    "GenerationResult",
    "Request",
    "SamplingParams",
    "TokenEvent",
]

"""What a scoring step (``ember.serving.program``) gives the requests that asked for it: the
log-probabilities of their prompt tokens and the most likely alternatives of their tokens
(``SamplingParams.prompt_logprobs``, ``top_logprobs``), read from the step's per-row scores."""

from __future__ import annotations

import numpy as np

from ember.serving.requests import Alternatives
from ember.serving.scheduler import ScheduledChunk


def wants_scores(chunk: ScheduledChunk) -> bool:
    """Whether ``chunk`` needs the scoring step: it samples a token whose alternatives its request
    asks for, or runs prompt tokens whose log-probabilities it asks for and has not got."""
    request, params = chunk.request, chunk.request.params
    if params.logprobs and params.top_logprobs and chunk.samples:
        return True
    first = max(chunk.start, len(request.prompt_logprobs))
    return params.prompt_logprobs and first < min(chunk.start + len(chunk.tokens), len(request.prompt) - 1)


def record_scores(chunks: list[ScheduledChunk], scores: dict[str, np.ndarray]) -> list[Alternatives | None]:
    """Appends each chunk's new prompt scores to its request (a row at position ``p`` scores
    ``prompt[p + 1]``; rows a recompute after preemption runs again are not appended twice) and
    returns, per chunk, the alternatives of its sampled token (None where not asked for)."""
    sampled: list[Alternatives | None] = []
    offset = 0
    for chunk in chunks:
        request, params, count = chunk.request, chunk.request.params, len(chunk.tokens)
        top = params.top_logprobs
        if params.prompt_logprobs:
            for position in range(
                max(chunk.start, len(request.prompt_logprobs)), min(chunk.start + count, len(request.prompt) - 1)
            ):
                row = offset + position - chunk.start
                request.prompt_logprobs.append(float(scores["target_logprobs"][row]))
                if top:
                    request.prompt_top_logprobs.append(_alternatives(scores, row, top))
        asked = params.logprobs and top and chunk.samples
        sampled.append(_alternatives(scores, offset + count - 1, top) if asked else None)
        offset += count
    return sampled


def _alternatives(scores: dict[str, np.ndarray], row: int, top: int) -> Alternatives:
    """The ``top`` most likely tokens of budget row ``row`` with their log-probabilities."""
    return list(zip(scores["top_tokens"][row, :top].tolist(), scores["top_logprobs"][row, :top].tolist()))


__all__ = ["record_scores", "wants_scores"]

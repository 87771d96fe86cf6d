"""The JSONL contract of ``ember generate``.

Input: one JSON object per line with exactly one of ``prompt`` (text), ``prompt_tokens`` (token
ids) or ``messages`` (a conversation, ``[{"role": "system" | "user" | "assistant", "content":
"..."}, ...]``, prompted as a chat model fine-tuned on it expects: the engine's tokenizer's chat
template, else Ember's plain one, then the assistant turn's header, by
:func:`ember.core.chat.chat_prompt_tokens`), an optional ``id`` and optional sampling fields
(``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``adapter``, ...:
:class:`~ember.serving.requests.SamplingParams`);
a line without a ``seed`` samples with ``--seed`` plus its line number less one, so repeated
prompts give different samples and a rerun the same ones.
Blank lines are skipped. Output: one object per request, in input order, with ``id`` (the
input's, else its 1-based line number), ``tokens``, ``text`` when a tokenizer is known and
``finish_reason`` (and the log-probabilities the line asked for: ``logprobs``, ``top_logprobs``
as ``[token, logprob]`` pairs, ``prompt_logprobs`` of its prompt's tokens after the first,
``prompt_top_logprobs``; a line with ``prompt_logprobs`` and ``max_tokens`` 0 scores a text)
— or ``id`` and ``error``; each written as soon as it and every line before
it are done (:class:`InOrderRecords`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any, TextIO

from ember.core.chat import chat_prompt_tokens, check_messages
from ember.core.integers import is_integer
from ember.serving.requests import MAX_SEED, GenerationResult, SamplingParams


@dataclasses.dataclass
class InputLine:
    """One parsed request line: a prompt and its params, or the error that rejects it (without
    the line number, which :func:`output_record` puts before it). A conversation is checked
    ``messages`` and no ``prompt`` until :func:`with_chat_prompts` gives it its tokens."""

    line_number: int
    request_id: Any
    prompt: str | list[int] | None = None
    params: SamplingParams | None = None
    error: str | None = None
    messages: list[dict[str, str]] | None = None


def parse_lines(lines: Iterable[str], defaults: dict[str, Any] | None = None) -> list[InputLine]:
    """Parses JSONL ``lines``; ``defaults`` are sampling fields a line may override. A default
    ``seed`` is a base: line ``n`` without its own samples with ``seed + n - 1``, so repeated
    prompts sample differently and the same file gives the same tokens again."""
    parsed = []
    for number, text in enumerate(lines, start=1):
        if text.strip():
            parsed.append(parse_line(number, text, defaults or {}))
    return parsed


def parse_line(number: int, text: str, defaults: dict[str, Any]) -> InputLine:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        return InputLine(number, number, error=f"malformed JSON ({error.msg} at column {error.colno})")
    if not isinstance(record, dict):
        return InputLine(number, number, error=f"expected a JSON object, got {type(record).__name__}")
    request_id = record.pop("id", number)
    prompt, tokens, messages = (record.pop(key, None) for key in ("prompt", "prompt_tokens", "messages"))
    try:
        if sum(form is not None for form in (prompt, tokens, messages)) != 1:
            raise ValueError(
                "give exactly one of 'prompt' (text), 'prompt_tokens' (a list of token ids) or 'messages' "
                '(a conversation: [{"role": "system" | "user" | "assistant", "content": "..."}, ...])'
            )
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"'prompt' must be a string, got {type(prompt).__name__}")
        if tokens is not None and (not isinstance(tokens, list) or not all(is_integer(t) for t in tokens)):
            raise ValueError("'prompt_tokens' must be a list of integers")
        if messages is not None:
            messages = check_messages(messages)
        if "seed" in defaults:
            defaults = {**defaults, "seed": (defaults["seed"] + number - 1) % (MAX_SEED + 1)}
        params = SamplingParams.from_dict({**defaults, **record})
    except (TypeError, ValueError) as error:
        return InputLine(number, request_id, error=str(error))
    return InputLine(number, request_id, prompt if prompt is not None else tokens, params, messages=messages)


def with_chat_prompts(lines: list[InputLine], tokenizer: Any) -> list[InputLine]:
    """``lines`` with each valid conversation's ``prompt`` its chat prompt's token ids
    (:func:`ember.core.chat.chat_prompt_tokens` with ``tokenizer``, None when the model has
    none), or its ``error`` saying why there is none (no tokenizer, a failing chat template)."""
    rendered = []
    for line in lines:
        if line.messages is not None and line.error is None:
            try:
                line = dataclasses.replace(line, prompt=chat_prompt_tokens(line.messages, tokenizer))
            except ValueError as error:
                line = dataclasses.replace(line, error=str(error))
        rendered.append(line)
    return rendered


def output_record(line: InputLine, result: GenerationResult | None) -> dict[str, Any]:
    """The output object of ``line`` (``result`` is None when the line was rejected)."""
    error = line.error if line.error is not None else result.error
    if error is not None:
        return {"id": line.request_id, "error": f"line {line.line_number}: {error}"}
    record = {"id": line.request_id, "tokens": result.tokens}
    if result.text is not None:
        record["text"] = result.text
    record["finish_reason"] = result.finish_reason
    for name in ("logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs"):
        if getattr(result, name) is not None:
            record[name] = getattr(result, name)
    return record


class InOrderRecords:
    """Writes the output records of ``lines`` to ``stream`` in input order, each as soon as it
    and every line before it are done (flushed), so an interrupted batch leaves the records
    it finished: :meth:`done` takes a valid line's result, rejected lines need nothing."""

    def __init__(self, lines: list[InputLine], stream: TextIO):
        self._lines = lines
        self._stream = stream
        self._records: dict[int, dict[str, Any]] = {
            i: output_record(line, None) for i, line in enumerate(lines) if line.error is not None
        }
        self._next = 0
        self._write_ready()

    def done(self, index: int, result: GenerationResult) -> None:
        """``result`` of ``lines[index]``."""
        self._records[index] = output_record(self._lines[index], result)
        self._write_ready()

    def _write_ready(self) -> None:
        while self._next in self._records:
            self._stream.write(json.dumps(self._records.pop(self._next)) + "\n")
            self._next += 1
        self._stream.flush()


__all__ = ["InOrderRecords", "InputLine", "output_record", "parse_line", "parse_lines", "with_chat_prompts"]

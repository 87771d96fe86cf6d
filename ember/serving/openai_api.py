"""The OpenAI API's completions and chat completions, as ``ember serve`` speaks them.

:func:`parse_call` turns a request body into an :class:`ApiCall` (a prompt and its
``SamplingParams`` per choice) or an :class:`ApiError` naming the field at fault; the other
functions write the response bodies and the stream's chunks. The fields:

- both: ``model`` (the served model's name, or an adapter's: its requests generate with it;
  default the base model), ``max_tokens``, ``temperature`` (default 1, as OpenAI's), ``top_p``,
  ``n`` (choices per prompt), ``stop`` (a string or a list), ``seed`` (choice ``i`` of a prompt
  samples with ``seed + i``), ``stream`` with ``stream_options.include_usage``, ``user``
  (ignored); ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` only at their
  neutral values. Ember's own, as vLLM names them: ``top_k``, ``ignore_eos``, ``stop_token_ids``.
- ``/v1/completions``: ``prompt`` (a string, a list of token ids, or a list of either: one
  prompt each), ``max_tokens`` default 16; ``logprobs`` ``k`` gives each sampled token's
  log-probability and its ``k`` most likely alternatives (up to 20); ``echo`` puts the prompt
  before the completion, with the log-probability of each prompt token after the first when
  ``logprobs`` is given, and allows ``max_tokens`` 0: a prompt scored, nothing generated
  (what lm-evaluation-harness's log-likelihood tasks ask of ``local-completions``).
- ``/v1/chat/completions``: ``messages`` (``system``/``user``/``assistant`` turns whose
  ``content`` is a string or a list of text parts), rendered as the model was fine-tuned on
  them (:func:`ember.core.chat.chat_prompt_tokens`); ``max_tokens`` or
  ``max_completion_tokens``, default what the context leaves; ``logprobs`` true gives each
  sampled token's log-probability, with its ``top_logprobs`` most likely alternatives.

Any other field is refused, naming it, rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ember.serving.engine import Prompt
from ember.serving.requests import MAX_SEED, MAX_TOP_LOGPROBS, Alternatives, GenerationResult, SamplingParams

COMMON_FIELDS = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options", "user",
     "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "ignore_eos", "stop_token_ids"}
)  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
MAX_CHOICES = 128


class ApiError(Exception):
    """A request the server refuses: the HTTP ``status``, a ``message`` saying what is wrong and
    what is allowed, and the request's field at fault (``param``)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclasses.dataclass(frozen=True)
class Models:
    """The names requests may give as ``model``: the base model's and its adapters'."""

    base: str
    adapters: tuple[str, ...] = ()

    def adapter(self, name: Any) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); ``ApiError`` 404 for
        a name not served."""
        if name is None or name == self.base:
            return None
        if isinstance(name, str) and name in self.adapters:
            return name
        served = ", ".join([self.base, *self.adapters])
        raise ApiError(404, f"the model {name!r} is not served here; served: {served}", "model", "not_found_error")

    def listing(self) -> dict[str, Any]:
        """The body of ``GET /v1/models``."""
        created = int(time.time())
        entries = [{"id": self.base, "object": "model", "created": created, "owned_by": "ember", "parent": None}]
        entries += [
            {"id": name, "object": "model", "created": created, "owned_by": "ember", "parent": self.base}
            for name in self.adapters
        ]
        return {"object": "list", "data": entries}


@dataclasses.dataclass(frozen=True)
class ApiCall:
    """One API request: ``prompts[i]`` and ``params[i]`` are choice ``i``'s (``n`` choices per
    prompt, prompt by prompt)."""

    chat: bool
    model: str
    prompts: list[Prompt]
    params: list[SamplingParams]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    """Alternatives per token when the call asks for log-probabilities (None: it does not)."""
    echo: bool = False
    """A completion's text (and log-probabilities) begin with its prompt's."""
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id


def parse_call(body: bytes, *, chat: bool, models: Models, tokenizer: Any, max_context: int) -> ApiCall:
    """The call a request ``body`` asks for (``chat``: to ``/v1/chat/completions``).
    ``tokenizer`` renders a conversation; ``max_context`` is a chat's default ``max_tokens``.
    Raises ``ApiError`` for what is wrong with it."""
    try:
        fields = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not JSON: {error}") from None
    if not isinstance(fields, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(fields).__name__}")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise ApiError(
            400, f"unsupported field(s) {', '.join(unknown)}; supported: {', '.join(sorted(allowed))}", unknown[0]
        )
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("logit_bias", {})):
        if fields.get(name) not in (None, neutral):
            raise ApiError(400, f"{name} is not supported: give {json.dumps(neutral)} or leave it out", name)
    model = fields.get("model")
    adapter = models.adapter(model)
    n = _choices(fields)
    stream = _flag(fields, "stream")
    options = fields.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise ApiError(400, 'stream_options must be {"include_usage": true|false}', "stream_options")
    include_usage = bool(options and _flag(options, "include_usage"))
    echo = False
    if chat:
        prompts = [_chat_prompt(fields.get("messages"), tokenizer)]
        top = _alternatives(fields, "top_logprobs")
        if not _flag(fields, "logprobs") and top:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = top if _flag(fields, "logprobs") else None
        if fields.get("max_tokens") is not None and fields.get("max_completion_tokens") is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        max_tokens = fields.get("max_completion_tokens", fields.get("max_tokens"))
        max_tokens = max_context if max_tokens is None else max_tokens
    else:
        prompts = _completion_prompts(fields.get("prompt"))
        if fields.get("best_of") not in (None, n):
            raise ApiError(400, "best_of must equal n (each choice is returned)", "best_of")
        logprobs = None if fields.get("logprobs") is None else _alternatives(fields, "logprobs")
        echo = _flag(fields, "echo")
        max_tokens = _given(fields, "max_tokens", 16)
        if max_tokens == 0 and not echo:
            raise ApiError(
                400, "max_tokens must be a positive integer (0 only with echo: a prompt scored)", "max_tokens"
            )
    seed = fields.get("seed")
    if seed is not None:
        _sampling_params({"seed": seed})
    params = []
    for _ in prompts:
        for choice in range(n):
            sampling = dict(
                max_tokens=max_tokens,
                temperature=_given(fields, "temperature", 1.0),
                top_p=_given(fields, "top_p", 1.0),
                top_k=_given(fields, "top_k", 0),
                seed=None if seed is None else (seed + choice) % (MAX_SEED + 1),
                stop=fields.get("stop") or (),
                stop_token_ids=_given(fields, "stop_token_ids", ()),
                ignore_eos=_given(fields, "ignore_eos", False),
                logprobs=logprobs is not None,
                top_logprobs=logprobs or 0,
                # A prompt alone (max_tokens 0) is read as a scored one: the engine's one way to end there.
                prompt_logprobs=echo and (logprobs is not None or max_tokens == 0),
                adapter=adapter,
            )
            params.append(_sampling_params(sampling))
    return ApiCall(
        chat=chat,
        model=models.base if model is None else model,
        prompts=[prompt for prompt in prompts for _ in range(n)],
        params=params,
        n=n,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        echo=echo,
    )


def _given(fields: dict[str, Any], name: str, default: Any) -> Any:
    """A field's value; its default when it is left out or null (as OpenAI reads a null)."""
    value = fields.get(name)
    return default if value is None else value


def _choices(fields: dict[str, Any]) -> int:
    n = _given(fields, "n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", "n")
    return n


def _alternatives(fields: dict[str, Any], name: str) -> int:
    """The number of alternatives per token a field asks for (0 when null or left out)."""
    value = _given(fields, name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400, f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token), got {value!r}", name
        )
    return value


def _flag(fields: dict[str, Any], name: str) -> bool:
    value = fields.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {value!r}", name)
    return value


def _sampling_params(sampling: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**sampling)
    except (TypeError, ValueError) as error:
        name = str(error).split(" ", 1)[0]
        raise ApiError(400, str(error), name if name in sampling else None) from None


def _completion_prompts(prompt: Any) -> list[Prompt]:
    """A completion's prompts: a string, a list of token ids, or a non-empty list of either."""
    if isinstance(prompt, str) or _is_token_list(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        return list(prompt)
    raise ApiError(
        400,
        "prompt must be a string, a list of token ids, or a non-empty list of strings or of token-id lists",
        "prompt",
    )


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _chat_prompt(messages: Any, tokenizer: Any) -> list[int]:
    """The prompt tokens of a chat's ``messages`` (:func:`ember.core.chat.chat_prompt_tokens`,
    which checks the conversation), a turn's content given as ``{"type": "text", "text": ...}``
    parts joined into its string first."""
    from ember.core.chat import chat_prompt_tokens

    try:
        return chat_prompt_tokens(_joined_text_parts(messages), tokenizer)
    except ValueError as error:  # a chat template's failure too (DataError)
        raise ApiError(400, f"messages: {error}", "messages") from None


def _joined_text_parts(messages: Any) -> Any:
    """``messages`` with each content given as a list of text parts joined into one string;
    anything else as it is, for ``check_messages`` to judge. Raises ``ValueError`` for a part that
    is not text (an image, say)."""
    if not isinstance(messages, list):
        return messages
    turns = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise ValueError(
                    f'messages[{index}].content: only text parts ({{"type": "text", "text": ...}}) are served'
                )
            message = {**message, "content": "".join(part["text"] for part in content)}
        turns.append(message)
    return turns


# Responses ------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_body(
    call: ApiCall, results: Sequence[GenerationResult], prompt_ids: Sequence[list[int]], tokenizer: Any
) -> dict[str, Any]:
    """The body of a call's whole response: one choice per result, in order (``prompt_ids``: each
    choice's prompt tokens)."""
    choices = []
    for index, (result, ids) in enumerate(zip(results, prompt_ids, strict=True)):
        text = result.text if result.text is not None else ""
        choice: dict[str, Any] = {"index": index, "finish_reason": result.finish_reason}
        if call.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = (echo_text(call, index, ids, tokenizer) if call.echo else "") + text
        tokens, values, alternatives = list(result.tokens), result.logprobs, result.top_logprobs
        if call.echo:
            tokens = ids + tokens
            values = prompt_scores(ids, result.prompt_logprobs) + (values or [])
            alternatives = prompt_scores(ids, result.prompt_top_logprobs) + (
                alternatives or [None] * len(result.tokens)
            )
        choice["logprobs"] = None if call.logprobs is None else _logprobs(call, tokens, values, alternatives, tokenizer)
        choices.append(choice)
    return {
        "id": call.response_id,
        "object": "chat.completion" if call.chat else "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": choices,
        "usage": usage(sum(len(ids) for ids in prompt_ids[:: call.n]), sum(len(r.tokens) for r in results)),
    }


def echo_text(call: ApiCall, index: int, ids: list[int], tokenizer: Any) -> str:
    """The prompt a completion's choice ``index`` echoes: the text it was given as, or the
    decoding of its token ids ``ids``."""
    prompt = call.prompts[index]
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids)


def prompt_scores(ids: list[int], scores: list[Any] | None) -> list[Any]:
    """A prompt's log-probabilities (or alternatives) per token, as echoed: None for its first
    token (nothing precedes it) and for all where none were asked for."""
    return [None, *scores] if scores is not None else [None] * len(ids)


def chunk_body(
    call: ApiCall,
    index: int,
    text: str | None,
    *,
    finish_reason: str | None = None,
    tokens: Sequence[int] = (),
    logprobs: Sequence[float | None] = (),
    alternatives: Sequence[Alternatives | None] = (),
    tokenizer: Any = None,
    text_offset: int = 0,
) -> dict[str, Any]:
    """One stream chunk of choice ``index``: a piece of its text (``None``: a chat's first chunk,
    which gives the role), its finish reason on the last; the tokens since the last chunk (an
    echoed prompt's, then those sampled) with their log-probabilities and alternatives when the
    call asked for them, a completion's ``text_offset`` going on from ``text_offset`` (the length
    of the texts of the tokens streamed before)."""
    choice: dict[str, Any] = {"index": index}
    if call.chat:
        choice["delta"] = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
    else:
        choice["text"] = text or ""
    asked = call.logprobs is not None and tokens
    choice["logprobs"] = _logprobs(call, tokens, logprobs, alternatives, tokenizer, text_offset) if asked else None
    choice["finish_reason"] = finish_reason
    return _chunk(call, [choice])


def usage_chunk(call: ApiCall, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The last chunk of a stream asked with ``include_usage``: no choices, the usage."""
    return {**_chunk(call, []), "usage": usage(prompt_tokens, completion_tokens)}


def _chunk(call: ApiCall, choices: list[dict[str, Any]]) -> dict[str, Any]:
    chunk = {
        "id": call.response_id,
        "object": "chat.completion.chunk" if call.chat else "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": choices,
    }
    if call.include_usage:
        chunk["usage"] = None
    return chunk


def _logprobs(
    call: ApiCall,
    tokens: Sequence[int],
    logprobs: Sequence[float | None] | None,
    alternatives: Sequence[Alternatives | None] | None,
    tokenizer: Any,
    text_offset: int = 0,
) -> Any:
    """The log-probabilities of ``tokens`` (None: an echoed prompt's first token's) and their
    alternatives (None where there are none) in the API's form, each token's text its own
    decoding (its id, without a tokenizer), a completion's first at ``text_offset``."""
    piece = lambda token: tokenizer.decode([token]) if tokenizer is not None else str(token)  # noqa: E731
    pieces = [piece(t) for t in tokens]
    values = list(logprobs or [])
    others = list(alternatives or [None] * len(pieces))
    if call.chat:
        return {
            "content": [
                {**_chat_entry(text, value), "top_logprobs": [_chat_entry(piece(t), lp) for t, lp in top or ()]}
                for text, value, top in zip(pieces, values, others)
            ]
        }
    offsets = list(itertools.accumulate((len(text) for text in pieces), initial=text_offset))[:-1]
    top = [None if a is None else _by_text(a, piece) for a in others]
    return {
        "tokens": pieces,
        "token_logprobs": values,
        "top_logprobs": top if call.logprobs else None,
        "text_offset": offsets,
    }


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    """A token of a chat's log-probabilities (or one of its alternatives): its text, bytes and log-probability."""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _by_text(alternatives: Alternatives, piece: Any) -> dict[str, float]:
    """A completion's alternatives: log-probabilities by the text of their tokens, most likely
    first (of two that decode alike, the likelier one's)."""
    by_text: dict[str, float] = {}
    for token, logprob in alternatives:
        by_text.setdefault(piece(token), logprob)
    return by_text


__all__ = [
    "ApiCall",
    "ApiError",
    "Models",
    "chunk_body",
    "echo_text",
    "parse_call",
    "prompt_scores",
    "response_body",
    "usage",
    "usage_chunk",
]

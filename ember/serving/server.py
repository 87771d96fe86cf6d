"""``ember serve``'s HTTP server: the OpenAI API over continuous batching.

    server = Server(engines, Models("tiny", adapters=("sql",)), port=8000)
    server.serve_forever()        # or in a thread: threading.Thread(target=server.serve_forever).start()
    server.close()

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``
(:mod:`ember.serving.openai_api`), ``GET /v1/models`` (the model and its adapters),
``GET /health`` and ``GET /metrics`` (Prometheus: :mod:`ember.serving.metrics`). Each HTTP
request is handled in a thread of its own and hands its prompts to
:class:`~ember.serving.workers.EngineWorkers`: a request arriving while others run joins their
batch at the next step (continuous batching) and, with several engines (``--mesh data=D``), goes
to whichever can start it first.

``"stream": true`` sends server-sent events as tokens are sampled (text held back only while it
may still turn out to begin a stop string or to end inside a character), then ``data: [DONE]``.
A client that goes away has its requests aborted, their slots and pages freed: mid-stream at the
next event, waiting for a whole response within a quarter of a second.
A refused request gets the API's error body: 400 naming the field (404 for an unknown model or
path); a request whose engine failed 500; once every engine failed, 503.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import queue
import select
import socket
import sys
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from ember.core.errors import ConfigError
from ember.serving.engine import Engine
from ember.serving.metrics import CallTracker, ServerMetrics
from ember.serving.openai_api import (
    ApiCall,
    ApiError,
    Models,
    chunk_body,
    echo_text,
    parse_call,
    prompt_scores,
    response_body,
    usage_chunk,
)
from ember.serving.requests import FINISH_ABORT, FINISH_ERROR, Alternatives, GenerationResult, Request
from ember.serving.text_deltas import TextDeltas
from ember.serving.workers import EngineWorkers, Ticket, Update

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_BODY_BYTES = 16 * 2**20
CLIENT_CHECK_SECONDS = 0.25
NOT_FOUND = "not_found_error"
log = logging.getLogger(__name__)


class Server:
    """The OpenAI API served on ``engines`` (one model's, with the same adapters) at ``host:port``
    (port 0: any free one; :attr:`url` tells which)."""

    def __init__(
        self,
        engines: Sequence[Engine],
        models: Models,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
    ):
        """``api_key``: when given, every ``/v1`` request must carry ``Authorization: Bearer
        <api_key>`` (401 otherwise), as OpenAI clients send their key; ``/health`` and
        ``/metrics`` stay open (as a monitoring system scrapes them)."""
        engine = engines[0]
        if engine.tokenizer is None:
            raise ConfigError("ember serve needs the model's tokenizer (text in, text out); this engine has none")
        if set(models.adapters) != set(engine.program.adapter_names):
            raise ValueError(f"models.adapters {models.adapters} are not the engine's {engine.program.adapter_names}")
        self.models = models
        self.api_key = api_key
        self.tokenizer = engine.tokenizer
        self.max_context = engine.program.max_context
        self.workers = EngineWorkers(engines)
        self.metrics = ServerMetrics(self.workers, models.base)
        self._http = _HTTPServer((host, port), _Handler)
        self._http.app = self  # type: ignore[attr-defined]
        self._serving = False

    @property
    def url(self) -> str:
        """``http://host:port`` of the server (the API under ``/v1``)."""
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        """Serves until :meth:`close` (from another thread) or an interrupt."""
        self._serving = True
        try:
            self._http.serve_forever(poll_interval=0.1)
        finally:
            self._serving = False

    def close(self) -> None:
        """Stops taking connections, aborts the requests in flight (their streams end with an
        error event) and stops the engines' threads."""
        if self._serving:
            self._http.shutdown()
        self._http.server_close()
        self.workers.close()


class _HTTPServer(ThreadingHTTPServer):
    """A thread per connection; a client that went away mid-request is logged, not printed as an
    exception with its traceback (socketserver's default for any error a handler leaves)."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError):  # reset, broken pipe: nothing left to answer
            log.info("%s went away: %s", client_address[0], error)
        else:
            log.exception("error answering %s", client_address[0])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "ember"
    _client_check_at = 0.0  # when _next_update looks at the connection next

    @property
    def app(self) -> Server:
        return self.server.app  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path.startswith("/v1/") and not self._authorized():
            return
        if path == "/v1/models":
            self._json(200, self.app.models.listing())
        elif path == "/health":
            alive = self.app.workers.alive
            self._json(200 if alive else 503, {"status": "ok" if alive else "every engine failed"})
        elif path == "/metrics":
            self._send(200, *self.app.metrics.exposition())
        else:
            message = f"no route GET {path}; GET serves /v1/models, /health and /metrics"
            self._error(ApiError(404, message, kind=NOT_FOUND))

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if not self._authorized():
            return
        try:
            if path not in (COMPLETIONS, CHAT):
                raise ApiError(404, f"no route POST {path}; POST serves {COMPLETIONS} and {CHAT}", kind=NOT_FOUND)
            app = self.app
            call = parse_call(
                self._body(), chat=path == CHAT, models=app.models, tokenizer=app.tokenizer, max_context=app.max_context
            )
            self._complete(call)
        except ApiError as error:
            self._error(error)
        except (BrokenPipeError, ConnectionResetError):  # the client went away: its requests were aborted
            self.close_connection = True

    def _authorized(self) -> bool:
        """Whether the request carries the server's API key (always, without one); else answers 401."""
        key = self.app.api_key
        if key is None or hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {key}"):
            return True
        self.close_connection = True  # its body is not read
        self._error(
            ApiError(401, "a valid API key is required: Authorization: Bearer <key>", kind="authentication_error")
        )
        return False

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise ApiError(411, "a request body with its Content-Length is required")
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True  # the body is not read
            raise ApiError(413, f"the request body is {length} bytes; at most {MAX_BODY_BYTES} are read")
        return self.rfile.read(int(length))

    def _complete(self, call: ApiCall) -> None:
        workers = self.app.workers
        updates: queue.Queue[Update] = queue.Queue()
        tickets: list[Ticket] = []
        tracker: CallTracker | None = None
        try:
            engine = workers.engines[0]
            try:
                prepared = [engine.prepare(prompt, params) for prompt, params in zip(call.prompts, call.params)]
            except ValueError as error:
                raise ApiError(400, str(error), "messages" if call.chat else "prompt") from None
            try:  # at once: the engines share them
                tickets = workers.submit_prepared(prepared, updates, range(len(prepared)))
            except RuntimeError as error:  # every engine failed
                raise ApiError(503, str(error), kind="service_unavailable_error") from None
            tracker = self.app.metrics.track(tickets)
            if call.stream:
                self._stream(call, updates, tickets, tracker)
            else:
                results: list[GenerationResult] = [None] * len(tickets)  # type: ignore[list-item]
                for _ in tickets:
                    while (update := self._next_update(updates, tracker)).result is None:
                        pass
                    _check_ended(update.result)
                    results[update.tag] = update.result
                prompts = [ticket.request.prompt for ticket in tickets]
                self._json(200, response_body(call, results, prompts, self.app.tokenizer))
        finally:
            for ticket in tickets:  # those still running when the client went away (or an error)
                workers.abort(ticket)
            if tracker is not None:
                tracker.close()

    def _next_update(self, updates: queue.Queue[Update], tracker: CallTracker) -> Update:
        """The next update; every :data:`CLIENT_CHECK_SECONDS` meanwhile, a look at whether the
        client went away (nothing is written to it until the response is whole): then
        ``ConnectionResetError``, whose handling aborts the requests."""
        while True:
            now = time.monotonic()
            if now >= self._client_check_at:
                self._client_check_at = now + CLIENT_CHECK_SECONDS
                if _closed_by_peer(self.connection):
                    raise ConnectionResetError("the client closed the connection")
            try:
                update = updates.get(timeout=CLIENT_CHECK_SECONDS)
            except queue.Empty:
                continue
            tracker.seen(update)
            return update

    def _stream(self, call: ApiCall, updates: queue.Queue[Update], tickets: list[Ticket], tracker: CallTracker) -> None:
        tokenizer = self.app.tokenizer
        prompt_tokens = sum(len(ticket.request.prompt) for ticket in tickets[:: call.n])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream's end is the connection's
        self.end_headers()
        self.close_connection = True
        deltas = [TextDeltas(tokenizer, params.stop) for params in call.params]
        if call.chat:
            self._events([chunk_body(call, index, None) for index in range(len(deltas))])
        open_choices, completion_tokens = len(deltas), 0
        echoed: set[int] = set()
        offsets = [0] * len(deltas)  # each choice's text_offset: its token texts streamed so far
        while open_choices:
            # Everything that arrived since the last write goes out in one: a client falling behind
            # the engine gets fewer, larger chunks rather than holding its worker back.
            pending: dict[int, _Chunk] = {}
            for update in _drain(updates):
                tracker.seen(update)
                index, event, result = update.tag, update.event, update.result
                chunk = pending.setdefault(index, _Chunk())
                if call.echo and index not in echoed:  # its first update: its prompt is read and scored
                    echoed.add(index)
                    self._echo(call, index, tickets[index].request, chunk)
                if call.logprobs is not None and event is not None and event.token is not None:
                    chunk.tokens.append(event.token)
                    chunk.logprobs.append(event.logprob)
                    chunk.alternatives.append(event.top_logprobs)
                if result is None:
                    chunk.text += deltas[index].add(event.token)
                    continue
                try:
                    _check_ended(result)
                except ApiError as error:
                    self._events([error.body()])
                    return
                open_choices -= 1
                completion_tokens += len(result.tokens)
                # The last event's token may belong to a stop sequence: the final text says what is kept.
                chunk.text += deltas[index].finish(result.text)
                chunk.finish_reason = result.finish_reason
            bodies = []
            for index, c in pending.items():
                if not (c.text or c.tokens or c.finish_reason):
                    continue
                bodies.append(chunk_body(call, index, c.text, finish_reason=c.finish_reason, tokens=c.tokens,
                                         logprobs=c.logprobs, alternatives=c.alternatives, tokenizer=tokenizer,
                                         text_offset=offsets[index]))  # fmt: skip
                logprobs = bodies[-1]["choices"][0]["logprobs"]
                if logprobs is not None and not call.chat:
                    offsets[index] += sum(len(text) for text in logprobs["tokens"])
            self._events(bodies)
        final = [usage_chunk(call, prompt_tokens, completion_tokens)] if call.include_usage else []
        self._events(final, done=True)

    def _echo(self, call: ApiCall, index: int, request: Request, chunk: _Chunk) -> None:
        """Puts choice ``index``'s prompt at the start of ``chunk``: its text and, when asked for,
        its tokens' log-probabilities and alternatives (read from ``request``, whose prompt the
        engine has scored by the time the first update comes)."""
        chunk.text += echo_text(call, index, request.prompt, self.app.tokenizer)
        if call.logprobs is not None:
            logprobs, alternatives = request.asked_prompt_scores()
            chunk.tokens += request.prompt
            chunk.logprobs += prompt_scores(request.prompt, logprobs)
            chunk.alternatives += prompt_scores(request.prompt, alternatives)

    def _events(self, chunks: list[dict[str, Any]], *, done: bool = False) -> None:
        """Sends ``chunks`` as server-sent events in one write (then ``[DONE]`` if ``done``)."""
        data = b"".join(b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n" for c in chunks)
        self.wfile.write(data + (b"data: [DONE]\n\n" if done else b""))
        self.wfile.flush()

    def _json(self, status: int, data: dict[str, Any]) -> None:
        self._send(status, json.dumps(data, ensure_ascii=False).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, error: ApiError) -> None:
        self._json(error.status, error.body())


@dataclasses.dataclass
class _Chunk:
    """What one stream chunk of a choice carries: its new text, and the tokens and
    log-probabilities (when asked for) and finish reason since the last chunk."""

    text: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float | None] = dataclasses.field(default_factory=list)
    alternatives: list[Alternatives | None] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


def _closed_by_peer(connection: socket.socket) -> bool:
    """Whether the client closed (or reset) ``connection``: it reads as ready with nothing to read.
    A client that sent more (a pipelined request) is not taken for gone."""
    readable, _, _ = select.select([connection], [], [], 0)
    if not readable:
        return False
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def _drain(updates: queue.Queue[Update]) -> list[Update]:
    """The next update (waiting for it) and every one already queued behind it."""
    drained = [updates.get()]
    while True:
        try:
            drained.append(updates.get_nowait())
        except queue.Empty:
            return drained


def _check_ended(result: GenerationResult) -> None:
    """Raises the ``ApiError`` of a result that did not come from generating: its engine failed
    (500) or the server is closing (503)."""
    if result.finish_reason == FINISH_ERROR:
        raise ApiError(500, result.error or "the engine failed", kind="server_error")
    if result.finish_reason == FINISH_ABORT:
        raise ApiError(503, "the server is shutting down", kind="service_unavailable_error")


__all__ = ["CHAT", "COMPLETIONS", "Server"]

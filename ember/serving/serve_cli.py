"""``ember serve``: a model (and its adapters) behind the OpenAI API, over HTTP.

    ember serve --checkpoint RUN_OR_HF_DIR                      # http://127.0.0.1:8000/v1
    ember serve --checkpoint HF_DIR --adapter sql=out/sql --mesh data=2,tensor=4 --port 9000
    EMBER_API_KEY=... ember serve --checkpoint RUN_DIR --host 0.0.0.0   # others may connect: give a key
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "Once upon a time", "max_tokens": 32}'

Any OpenAI client works against it (``OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")``):
completions and chat completions, streamed or not; ``model`` is ``--served-model-name`` (default
the checkpoint directory's name) or an adapter's name (:mod:`ember.serving.openai_api`).
``GET /health`` answers a load balancer, ``GET /metrics`` a Prometheus scraper
(:mod:`ember.serving.metrics`). The model
options are ``ember generate``'s (:func:`ember.serving.cli.add_model_arguments`); requests arriving
together are batched continuously (:mod:`ember.serving.server`). Ctrl-C or SIGTERM (a service
manager's stop) stops it: the requests in flight are aborted and it exits with code 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from ember.core.errors import ConfigError
from ember.serving.cli import add_model_arguments, build_engine, check_model_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free one)")
    parser.add_argument(
        "--served-model-name", default=None, help="the base model's name in requests (default: the directory's name)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("EMBER_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 requests (default: $EMBER_API_KEY, which other users "
        "cannot read in the process list as they can a command line; none: open)",
    )
    parser.add_argument("--quiet", action="store_true", help="no line per HTTP request on standard error")


def run(args: argparse.Namespace) -> int:
    from ember.serving.openai_api import Models
    from ember.serving.server import Server

    check_model_options(args)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}", key="--port")
    name = args.served_model_name or Path(args.checkpoint or args.artifact).resolve().name
    engine = build_engine(args)
    engines = getattr(engine, "engines", [engine])  # Replicas hold several
    try:
        models = Models(name, tuple(engines[0].program.adapter_names))
        server = Server(engines, models, host=args.host, port=args.port, api_key=args.api_key or None)
    except OSError as error:  # the port is taken, say
        reason = error.strerror or error
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {reason}", key="--port") from None
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    print(
        f"ember serve: {name} at {server.url}/v1, {len(engines)} engine(s); Ctrl-C stops", file=sys.stderr, flush=True
    )
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM's handler: stops the server as Ctrl-C does."""
    raise KeyboardInterrupt


__all__ = ["add_arguments", "run"]

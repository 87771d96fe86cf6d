"""The ``ember`` command: a thin dispatcher over subcommands.

Each subcommand lives in the package that owns it and is imported only when run, so
``ember --version`` and ``ember --help`` do not import JAX. A subcommand module defines
``add_arguments(parser)`` and ``run(args) -> int``.

Options may stand anywhere among a command's positional arguments (``ember train CONFIG
k=v --resume k=v``). Every failure a user can cause raises an ``EmberError``; it is printed
here as one line, ``ember COMMAND: what is wrong``, with exit code 2 and no traceback (as
are argparse's own usage errors, and the ``OSError`` of a path the system refuses: an output
path that is a file, a directory without write permission, a full disk).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

import ember

USAGE_ERROR = 2  # the exit code of argparse's own usage errors, and of every EmberError

# name -> (module defining add_arguments/run, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": (
        "ember.kernels_pallas.info_command",
        "show JAX version, backend, devices, Pallas lowerings and which kernels each backend has",
    ),
    "envs": ("ember.envs.cli", "list RL environments, or record a random-policy episode as a GIF"),
    "train": (
        "ember.training.launcher",
        "train from a YAML config: ember train CONFIG.yaml [key=value ...] [--resume]",
    ),
    "plot": ("ember.training.plot", "draw a run's metrics (loss, returns, ...) against the step into a PNG"),
    "eval": (
        "ember.training.eval_command",
        "a language model's loss on a text (ember eval MODEL [--text FILE]), or an RL policy's return "
        "(ember eval RL_RUN_DIR --episodes N [--gif out.gif])",
    ),
    "data": (
        "ember.training.data.cli",
        "prepare text files as memory-mapped token files for LM training; list or prune the corpora cache",
    ),
    "generate": (
        "ember.serving.cli",
        "batch inference: ember generate --checkpoint PATH --prompts in.jsonl --out out.jsonl",
    ),
    "serve": (
        "ember.serving.serve_cli",
        "the OpenAI API over HTTP: ember serve --checkpoint PATH [--port 8000] [--adapter NAME=DIR]",
    ),
    "quantize": (
        "ember.training.quantization.command",
        "quantize a model's weights: ember quantize SRC OUT --format int8|int4|nf4 [--method rtn|gptq]",
    ),
    "linearize": (
        "ember.training.linearize.command",
        "make a softmax model linear-time (LoLCATs): ember linearize RUN_OR_HF_DIR OUT [key=value ...]",
    ),
    "export": (
        "ember.serving.export",
        "serialize a model's serving steps with jax.export: ember export RUN_DIR OUT_DIR",
    ),
}


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line, as every other error of the command."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see '{self.prog} --help')\n")


def _top_parser() -> argparse.ArgumentParser:
    lines = [f"  {name:<10} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    parser = _Parser(
        prog="ember",
        description="Ember: efficient sequence models and RL environments in JAX.",
        epilog="commands:\n" + "\n".join(lines) + "\n\nRun 'ember COMMAND --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ember {ember.__version__}")
    parser.add_argument("command", nargs="?", help="one of: " + ", ".join(COMMANDS))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        parser = _top_parser()
        parser.parse_args(argv)  # handles --help / --version and exits
        parser.print_help()
        return 0 if not argv else USAGE_ERROR
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        print(f"ember: unknown command '{name}'.{hint} Commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return USAGE_ERROR
    from ember.core.errors import EmberError  # lazily, like the commands: `ember --version` imports no JAX

    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = _Parser(prog=f"ember {name}", description=help_text)
    module.add_arguments(parser)
    args = _parse(parser, rest)
    try:
        return int(module.run(args) or 0)
    except BrokenPipeError:
        # The reader of the output left early (`ember train --list | head -1`): no mistake of the
        # user's. Python's advice: point stdout at devnull, so the flush at exit cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    # OSError: a path the system refuses (a file where a directory is due, no permission, a full disk).
    except (EmberError, OSError) as error:
        print(f"ember {name}: {error}", file=sys.stderr)
        return USAGE_ERROR


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Options anywhere among the positionals; commands with sub-commands (``envs``, ``data``)
    parse in the ordinary way, which is all argparse allows for them."""
    has_subcommands = any(isinstance(action, argparse._SubParsersAction) for action in parser._actions)
    return parser.parse_args(argv) if has_subcommands else parser.parse_intermixed_args(argv)


if __name__ == "__main__":
    sys.exit(main())

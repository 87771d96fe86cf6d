"""``ember generate``: batch inference from JSONL, or one text prompt.

    ember generate --checkpoint RUN_OR_HF_DIR --prompts in.jsonl --out out.jsonl
    ember generate --checkpoint RUN_DIR --prompt "Once upon a time" --max-tokens 64
    ember generate --artifact EXPORT_DIR --prompts in.jsonl --out out.jsonl
    ember generate --checkpoint HF_DIR --adapter sql=out/sql --adapter chat=out/chat --prompts in.jsonl
    ember generate --checkpoint RUN_DIR --mesh tensor=4 --prompts in.jsonl --out out.jsonl

``--adapter NAME=DIR`` (repeatable) serves PEFT LoRA adapters at once beside the base model;
a request line picks one with ``"adapter": "NAME"`` (see ``ember.serving.batch_io``), and
one naming an unknown adapter gets an ``error`` record while the rest complete. ``--mesh tensor=N``
splits the model tensor-parallel over the first ``N`` devices, ``--mesh expert=E,tensor=N`` an
MoE model's experts ``E`` ways too, over ``E * N`` devices (:mod:`ember.serving.mesh`), and
``--mesh data=D,...`` serves the batch on ``D`` such engines at once, each on devices of its own
(:mod:`ember.serving.replicas`).

See :mod:`ember.serving.batch_io` for the JSONL contract: records are written in input order
as they finish, so an interrupted batch keeps those it finished; a line's ``messages`` (a
conversation) is prompted by the model's tokenizer, with its chat template or else Ember's plain
one (:mod:`ember.core.chat`). With ``--artifact`` the model runs from a ``jax.export`` artifact
(``ember export``) without Ember's model code; its tokenizer, chat template included, travels
in it. Bad options fail before any model loads (``ConfigError`` naming the option); a rejected
request line is an ``error`` record in the output, except for ``--prompt``, whose rejection is
the command's error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ember.core.errors import ConfigError, EmberError, PathNotFoundError
from ember.core.jsonl import jsonl_lines, readable
from ember.serving.batch_io import InOrderRecords, InputLine, parse_lines, with_chat_prompts
from ember.serving.requests import SamplingParams

# Engine.from_model's arguments that the options set (their ConfigErrors are keyed by these)
ENGINE_OPTIONS = {"num_slots": "--num-slots", "token_budget": "--token-budget", "max_context": "--max-context"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    inputs = parser.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--prompts", help="JSONL file of requests (see 'ember.serving.batch_io')")
    inputs.add_argument("--prompt", help="a single text prompt; the generated text is printed")
    parser.add_argument("--out", help="JSONL output file (with --prompts; default: standard output)")
    parser.add_argument("--max-tokens", type=int, default=64, help="default max_tokens of a request")
    parser.add_argument("--temperature", type=float, default=0.0, help="default temperature (0 = greedy)")
    parser.add_argument("--top-k", type=int, default=0, help="default top_k (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="default top_p (1 = off)")
    parser.add_argument("--seed", type=int, default=0, help="base seed (line n without a seed uses seed + n - 1)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options saying what to serve and how (``ember generate`` and ``ember serve``): the
    model, its adapters, the engine's sizes and the mesh; checked by :func:`check_model_options`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="an Ember LM run directory or a Hugging Face model directory")
    source.add_argument("--artifact", help="a directory written by 'ember export'")
    parser.add_argument(
        "--step", type=int, default=None, help="checkpoint step of a run directory (default: latest; --checkpoint)"
    )
    # No argparse defaults for the engine sizes: None tells an option left out from one given, which
    # --artifact refuses (its sizes were fixed by 'ember export'); the engine's defaults apply.
    parser.add_argument("--num-slots", type=int, default=None, help="requests served at once (default 8; --checkpoint)")
    parser.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="most tokens per step, decodes + prefill chunks (default 64; --checkpoint)",
    )
    parser.add_argument(
        "--max-context", type=int, default=None, help="longest sequence (default: the model's; --checkpoint)"
    )
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve the PEFT LoRA adapter in DIR as NAME (repeatable; --checkpoint); requests pick it by name",
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every request's whole prompt (default: requests that begin alike share the cache pages of "
        "that beginning; see 'ember.serving.prefix_cache')",
    )
    parser.add_argument(
        "--mesh",
        default=None,
        metavar="[data=D,]tensor=N[,expert=E]",
        help="split the model tensor-parallel (and an MoE's experts E ways) over N*E devices, D engines at once on "
        "devices of their own (--checkpoint; see 'ember.serving.mesh')",
    )


def check_engine_options(args: argparse.Namespace) -> None:
    """The engine sizes and checkpoint step of ``ember generate`` and ``ember export``, checked
    before any model is loaded (``ConfigError`` keyed by the option)."""
    for flag, value in (
        ("--num-slots", args.num_slots),
        ("--token-budget", args.token_budget),
        ("--max-context", args.max_context),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value}", key=flag)
    if args.step is not None and args.step < 0:
        raise ConfigError(f"--step must be a checkpoint step >= 0, got {args.step}", key="--step")


def check_options(args: argparse.Namespace) -> dict[str, Any]:
    """Validates the options before any model is loaded; returns the default sampling fields
    of a request. Raises ``ConfigError`` keyed by the option (``--top-p``, ``--out``; those of
    :func:`check_model_options`)."""
    check_model_options(args)
    if args.out and not args.prompts:
        raise ConfigError("--out goes with --prompts (a --prompt's text is printed)", key="--out")
    if args.out and Path(args.out).is_dir():  # found now, not after the whole batch has run
        raise ConfigError(f"--out {args.out} is a directory; give the path of the JSONL file to write", key="--out")
    defaults = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    for name, value in defaults.items():
        try:
            SamplingParams(**{name: value})
        except ValueError as error:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag}: {error}", key=flag) from None
    return defaults


def check_model_options(args: argparse.Namespace) -> None:
    """The options of :func:`add_model_arguments`, checked before any model is loaded
    (``ConfigError`` keyed by the option: a bad size or step, ``--step`` or an engine size with
    ``--artifact``, whose weights and sizes ``ember export`` fixed, a bad ``--mesh`` or ``--adapter``)."""
    check_engine_options(args)
    if args.artifact:
        checkpoint_only = {"--step": args.step, **{flag: getattr(args, name) for name, flag in ENGINE_OPTIONS.items()}}
        for flag, value in checkpoint_only.items():
            if value is not None:
                raise ConfigError(
                    f"{flag} applies to --checkpoint, not to an exported --artifact (fixed by 'ember export')", key=flag
                )
    if args.mesh is not None:
        if args.artifact:
            raise ConfigError("--mesh applies to --checkpoint: an exported --artifact runs on one device", key="--mesh")
        mesh_config(args.mesh)
    adapter_dirs(args)


def adapter_dirs(args: argparse.Namespace) -> dict[str, Path]:
    """``{name: directory}`` of the ``--adapter NAME=DIR`` options, checked (``ConfigError``
    keyed ``--adapter``: no ``=``, an empty or repeated name, a missing directory, or with
    ``--artifact``)."""
    found: dict[str, Path] = {}
    for value in args.adapter:
        name, sep, directory = value.partition("=")
        if not sep or not name or not directory:
            raise ConfigError(f"--adapter takes NAME=DIR, got {value!r}", key="--adapter")
        if name in found:
            raise ConfigError(f"--adapter name {name!r} is given twice", key="--adapter")
        if not Path(directory).is_dir():
            raise ConfigError(f"--adapter {name}: no such directory: {directory}", key="--adapter")
        found[name] = Path(directory)
    if found and args.artifact:
        raise ConfigError("--adapter serves adapters on a --checkpoint, not on an exported --artifact", key="--adapter")
    return found


def mesh_config(text: str) -> Any:
    """The ``MeshConfig`` of a ``--mesh`` value: ``AXIS=SIZE`` pairs joined by commas
    (``tensor=2``), the other axes 1. Raises ``ConfigError`` keyed ``--mesh`` for an unknown
    axis, a bad size or an axis serving does not split (``ember.serving.mesh``)."""
    from ember.core.config import load_config
    from ember.core.sharding import MeshConfig
    from ember.serving.mesh import check_serving_mesh

    try:
        config = load_config(MeshConfig, {"data": 1}, overrides=[pair.strip() for pair in text.split(",")])
        check_serving_mesh(config.sizes(), replicas=True)
    except ConfigError as error:
        raise ConfigError(f"--mesh {text}: {error}", key="--mesh") from None
    return config


def build_engine(args: argparse.Namespace):
    """The engine for ``--checkpoint`` or ``--artifact``: an ``Engine``, or with ``--mesh data=N``
    (N > 1) the ``Replicas`` of N engines (each generates as one)."""
    from ember.serving.engine import Engine

    if args.artifact:
        from ember.serving.export import load_artifact

        program, tokenizer, eos_ids = load_artifact(args.artifact)
        return Engine(program, tokenizer=tokenizer, eos_id=eos_ids, prefix_caching=not args.no_prefix_caching)
    from ember.serving.loading import load_model, weights_fit_model
    from ember.serving.mesh import replica_meshes

    meshes = [None]
    if args.mesh is not None:
        try:
            meshes = replica_meshes(mesh_config(args.mesh))
        except ConfigError as error:  # more devices than there are
            raise ConfigError(f"--mesh {args.mesh}: {error}", key="--mesh") from None
    replicated = len(meshes) > 1
    # One mesh: the weights read straight into its shards; several: once onto the host, then each replica's.
    loaded = load_model(args.checkpoint, step=args.step, mesh=None if replicated else meshes[0], host=replicated)
    adapters = None
    if args.adapter:
        from ember.models.hf.peft import load_peft_adapter

        adapters = {name: load_peft_adapter(path, loaded.config) for name, path in adapter_dirs(args).items()}
    options = dict(
        tokenizer=loaded.tokenizer,
        eos_id=loaded.eos_ids,
        adapters=adapters,
        prefix_caching=not args.no_prefix_caching,
        **{name: getattr(args, name) for name in ENGINE_OPTIONS if getattr(args, name) is not None},
    )
    with engine_options_named(), weights_fit_model(args.checkpoint):
        if replicated:
            from ember.serving.replicas import Replicas

            return Replicas.from_model(loaded.config, loaded.params, meshes, **options)
        return Engine.from_model(loaded.config, loaded.params, mesh=meshes[0], **options)


@contextlib.contextmanager
def engine_options_named() -> Iterator[None]:
    """Re-raises a ``ConfigError`` about an engine size (keyed ``max_context``, say) keyed by
    and naming its option (``--max-context``); one about the model (layers the engine cannot
    serve) passes as it is."""
    try:
        yield
    except ConfigError as error:
        flag = ENGINE_OPTIONS.get(error.key)
        if flag is None:
            raise
        raise ConfigError(f"{flag}: {error}", key=flag) from None


def read_prompts(args: argparse.Namespace, defaults: dict[str, Any]) -> list[InputLine]:
    """The request lines of ``--prompts`` (a JSONL file) or ``--prompt``."""
    if args.prompt is not None:
        return parse_lines([json.dumps({"prompt": args.prompt})], defaults)
    path = Path(args.prompts)
    if not readable(path):  # a pipe is welcome: --prompts /dev/stdin
        raise PathNotFoundError(f"--prompts: no such file: {path}")
    return parse_lines(jsonl_lines(path, "--prompts: "), defaults)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    lines = read_prompts(args, check_options(args))
    engine = build_engine(args)
    lines = with_chat_prompts(lines, engine.tokenizer)
    valid = [i for i, line in enumerate(lines) if line.error is None]
    total = sum(lines[i].params.max_tokens for i in valid)
    prompts, params = [lines[i].prompt for i in valid], [lines[i].params for i in valid]

    def generate(on_result=None):
        with tqdm(total=total, unit="tok", desc="generate", disable=args.no_progress, file=sys.stderr) as bar:
            return engine.generate(prompts, params, progress=bar, on_result=on_result)

    if args.prompt is not None:
        result = generate()[0] if valid else None
        error = lines[0].error if lines[0].error is not None else result.error
        if error is not None:  # the one request was rejected (a prompt too long, say): the user's input
            raise EmberError(f"--prompt: {error}")
        print(result.text if result.text is not None else result.tokens)
        return 0
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") if args.out else contextlib.nullcontext(sys.stdout) as stream:
        records = InOrderRecords(lines, stream)
        generate(lambda index, result: records.done(valid[index], result))
    return 0


__all__ = [
    "adapter_dirs",
    "add_arguments",
    "add_model_arguments",
    "build_engine",
    "check_engine_options",
    "check_model_options",
    "check_options",
    "mesh_config",
    "read_prompts",
    "run",
]

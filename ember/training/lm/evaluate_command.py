"""``ember eval MODEL [--text FILE]``: the held-out loss of a language model (``ember.training.lm.evaluate``).

MODEL is anything ``ember.serving.loading.load_model`` reads: an Ember LM run of any kind
(``lm``, ``finetune``, ``linearize``, ``quantized``, ...) or a Hugging Face directory;
``--adapter DIR`` merges a PEFT LoRA adapter into it first. Prints the mean next-token loss
(nats per token), the perplexity, bits per byte and the tokens evaluated; ``--json`` prints
them as a JSON object (a figure that is no finite number, the perplexity of a loss past
``exp``'s range or a diverged model's NaN loss, as null: JSON has no infinity).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from ember.core.errors import ConfigError

OPTIONS = {
    "text": "--text",
    "seq_len": "--seq-len",
    "batch_size": "--batch-size",
    "max_windows": "--max-windows",
    "adapter": "--adapter",
    "step": "--step",
    "no_progress": "--no-progress",
}
"""The options of a language model's evaluation: ``{args attribute: flag}``; each defaults to
None (or False), which tells an option left out from one given (an RL run refuses them)."""
DEFAULTS = {"seq_len": 128, "batch_size": 8}


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--text",
        default=None,
        help='a UTF-8 text file, or a .jsonl of {"text": ...} lines (default for a byte-level model: the '
        "validation split of the Ember LM run it is or descends from)",
    )
    group.add_argument("--seq-len", type=int, default=None, help="tokens predicted per window (default 128)")
    group.add_argument("--batch-size", type=int, default=None, help="windows per batch (default 8)")
    group.add_argument("--max-windows", type=int, default=None, help="evaluate at most this many windows (default all)")
    group.add_argument("--adapter", default=None, help="a PEFT LoRA adapter directory to merge into the model first")
    group.add_argument("--step", type=int, default=None, help="checkpoint step of a run directory (default: latest)")
    group.add_argument("--no-progress", action="store_true", default=None, help="hide the progress bar")


def _checked(args: argparse.Namespace) -> dict[str, int | None]:
    """``seq_len``, ``batch_size`` (defaults filled in) and ``max_windows``, each checked positive."""
    values = {name: getattr(args, name) if getattr(args, name) is not None else DEFAULTS.get(name)
              for name in ("seq_len", "batch_size", "max_windows")}  # fmt: skip
    for name, value in values.items():
        if value is not None and value < 1:
            raise ConfigError(f"{OPTIONS[name]} must be a positive integer, got {value}", key=OPTIONS[name])
    if args.step is not None and args.step < 0:
        raise ConfigError(f"--step must be a checkpoint step >= 0, got {args.step}", key="--step")
    if args.adapter is not None and not Path(args.adapter).is_dir():
        raise ConfigError(f"--adapter: no such directory: {args.adapter}", key="--adapter")
    return values


def run(args: argparse.Namespace) -> int:
    from ember.serving.loading import load_model, weights_fit_model
    from ember.training.lm.eval_windows import check_seq_len
    from ember.training.lm.evaluate import default_text, evaluate_tokens, lineage_dataset, read_documents, tokenized

    sizes = _checked(args)
    documents = read_documents(args.text) if args.text is not None else None  # before the model loads
    loaded = load_model(args.model, step=args.step)
    check_seq_len(sizes["seq_len"], loaded.config)
    if args.adapter is not None:
        loaded = with_merged_adapter(loaded, args.adapter)
    if documents is not None:
        text = tokenized(documents, loaded.tokenizer)
    else:
        need = None if sizes["max_windows"] is None else sizes["max_windows"] * (sizes["seq_len"] + 1)
        text = default_text(loaded, lineage_dataset(args.model), need)
    with weights_fit_model(args.model):
        figures = evaluate_tokens(loaded, text, **sizes, progress=not args.no_progress)
    figures = {"model": str(args.model), **({"adapter": str(args.adapter)} if args.adapter else {}), **figures}
    print(figures_json(figures) if args.json else format_figures(figures))
    return 0


def figures_json(figures: dict) -> str:
    """The figures of ``evaluate_tokens`` as a JSON object, a float that is no finite number as null."""
    finite = {
        key: None if isinstance(value, float) and not math.isfinite(value) else value for key, value in figures.items()
    }
    return json.dumps(finite, indent=2, allow_nan=False)


def with_merged_adapter(loaded, adapter: str | Path):
    """``loaded`` with the PEFT LoRA adapter in directory ``adapter`` merged into its weights."""
    from ember.models.adapters.merge import merged_weights
    from ember.models.hf.peft import load_peft_adapter, with_adapter
    from ember.models.variables import as_variables

    variables = as_variables(loaded.params)
    adapted = with_adapter(variables["params"], load_peft_adapter(adapter, loaded.config))
    merged = merged_weights(adapted)
    params = merged if len(variables) == 1 else {**variables, "params": merged}
    return dataclasses.replace(loaded, params=params)


def format_figures(figures: dict) -> str:
    """The figures of ``evaluate_tokens`` as two lines of text."""
    bpb = "n/a" if figures["bits_per_byte"] is None else f"{figures['bits_per_byte']:.4f}"
    return (
        f"loss {figures['loss']:.4f} nats/token, perplexity {figures['perplexity']:.3f}, {bpb} bits/byte\n"
        f"over {figures['tokens']} tokens ({figures['windows']} windows of {figures['seq_len']} + 1) covering "
        f"{figures['bytes']} bytes of {figures['text']}"
    )

"""``ember linearize RUN_OR_HF_DIR OUT [key=value ...] [--config FILE] [--resume]``.

Loads the linearize config (default: the shipped ``configs/linearize/lolcats.yaml``, the
paper's settings; ``configs/linearize/tiny.yaml`` suits the tiny preset), points it at the
source model and the output run directory, runs both stages and prints the figures
(``ember.training.linearize.entry``; ``gap_closed`` is ``null``, with a line saying why, when the
naive swap is less than ``entry.MIN_GAP`` = 0.05 nats worse than the teacher).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ember.core.config import load_config, read_key
from ember.core.errors import ConfigError
from ember.training.launcher import DEFAULT_KIND, shipped_configs_dir
from ember.training.linearize import entry
from ember.training.linearize.config import LinearizeRunConfig

SUMMARY_KEYS = (
    "teacher_val_loss", "swap_val_loss", "transfer_val_loss", "linearized_val_loss", "gap_closed",
    "attention_mse_before", "attention_mse_after", "parameters_trained", "trained_fraction", "tokens",
    "transfer_seconds", "low_rank_seconds",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="the softmax model: an Ember LM run or a Hugging Face directory")
    parser.add_argument("out", help="the run directory to write (the linearised model)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    parser.add_argument("--config", type=Path, default=None, help="a kind: linearize YAML (default: lolcats.yaml)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run in OUT")


def run(args: argparse.Namespace) -> int:
    path = args.config or shipped_configs_dir() / "linearize" / "lolcats.yaml"
    kind = read_key(path, "kind", args.overrides, default=DEFAULT_KIND)
    if kind != "linearize":  # its sections would be refused one unknown key at a time
        raise ConfigError(
            f"--config {path} is a kind: {kind} config; ember linearize takes a kind: linearize one "
            f"(such as configs/linearize/lolcats.yaml); 'ember train {path}' runs this one",
            key="kind",
        )
    # Quoted: an override's value is read as YAML, where a directory named 007 is the int 7.
    overrides = [f"base_model.path={json.dumps(args.source)}", f"run_dir={json.dumps(args.out)}", *args.overrides]
    summary = entry.run(load_config(LinearizeRunConfig, path, overrides), resume=args.resume)
    print(json.dumps({key: summary[key] for key in SUMMARY_KEYS if key in summary}, indent=2))
    return 0

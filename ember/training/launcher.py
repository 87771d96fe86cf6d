"""``ember train CONFIG.yaml [key=value ...] [--resume]`` and ``ember train --list``.

The launcher is thin: it reads the config's ``kind`` (``lm`` by default), loads and
validates the config against that kind's schema — so an unknown key, a wrong type or a bad
value fails here, before anything compiles — and calls the kind's ``run(config, resume=...)``.
A kind is a module that defines ``CONFIG_SCHEMA`` and ``run``. Errors are ``EmberError``s,
which ``ember.cli`` prints as one line (exit code 2).
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import ember
from ember.core.config import load_config, read_key
from ember.core.errors import ConfigError

# config kind -> module defining CONFIG_SCHEMA and run(config, *, resume) -> summary dict
KINDS: dict[str, str] = {
    "lm": "ember.training.lm.entry",
    "finetune": "ember.training.finetune.entry",
    "rl": "ember.training.rl.entry",
    "grpo": "ember.training.rl_lm.entry",
    "linearize": "ember.training.linearize.entry",
}
DEFAULT_KIND = "lm"


def shipped_configs_dir() -> Path:
    """``configs/`` beside the package (a source checkout, as ``make`` installs it). Runnable
    configs name their ``kind:``; files without one are presets that others extend."""
    return Path(ember.__file__).resolve().parents[1] / "configs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", type=Path, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied last")
    parser.add_argument("--resume", action="store_true", help="continue the run in run_dir from its last checkpoint")
    parser.add_argument("--list", action="store_true", help="list the shipped configs")


def run(args: argparse.Namespace) -> int:
    if args.list:
        if args.config is not None:  # it would be ignored: the user meant one of the two
            raise ConfigError(f"--list lists the shipped configs and takes no CONFIG (got {str(args.config)!r})")
        return _list_configs()
    if args.config is None:
        raise ConfigError("a CONFIG.yaml is required (see 'ember train --list')")
    kind = read_key(args.config, "kind", args.overrides, default=DEFAULT_KIND)
    if not isinstance(kind, str) or kind not in KINDS:
        raise ConfigError(f"unknown config kind {kind!r}; known kinds: {', '.join(sorted(KINDS))}", key="kind")
    module = importlib.import_module(KINDS[kind])
    config = load_config(module.CONFIG_SCHEMA, args.config, args.overrides)
    summary = module.run(config, resume=args.resume)
    printable = {k: v for k, v in summary.items() if k != "samples"}
    print(json.dumps(printable, indent=2))
    for sample in summary.get("samples", []):
        print("---\n" + sample)
    return 0


def _list_configs() -> int:
    root = shipped_configs_dir()
    if not root.is_dir():
        print(f"no shipped configs found (looked in {root})")
        return 1
    here = Path.cwd().resolve()
    # Files without a kind are presets other configs extend. Each path is one 'ember train'
    # accepts from here: relative inside the checkout, else absolute.
    runnable = [
        (str(path.relative_to(here) if path.is_relative_to(here) else path), kind)
        for path in sorted(root.rglob("*.yaml"))
        if (kind := read_key(path, "kind")) is not None
    ]
    width = max((len(shown) for shown, _ in runnable), default=0)
    for shown, kind in runnable:
        print(f"{shown:<{width}}  kind={kind}")
    return 0

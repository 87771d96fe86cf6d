"""``ember eval MODEL ...``: one command for both things Ember evaluates, chosen by what MODEL is.

- An RL run directory (``kind: rl``): its policy runs episodes (``ember.training.rl.eval_command``:
  ``--episodes``, ``--seed``, ``--stochastic``, ``--gif``).
- Anything else ``ember.serving.loading.load_model`` reads (an Ember LM run of any kind, a Hugging
  Face directory): its loss on a text (``ember.training.lm.evaluate_command``: ``--text``,
  ``--seq-len``, ``--batch-size``, ``--max-windows``, ``--adapter``, ``--step``, ``--no-progress``).

``--json`` applies to both. An option of the other kind is refused with the kind it applies to.
"""

from __future__ import annotations

import argparse

from ember.core.config import run_kind
from ember.core.errors import ConfigError
from ember.training.lm import evaluate_command as lm
from ember.training.rl import eval_command as rl


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="an RL run directory, an Ember LM run or a Hugging Face model directory")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    rl.add_arguments(parser.add_argument_group("RL policies (an RL run directory)"))
    lm.add_arguments(parser.add_argument_group("language models (the loss on a text)"))


def run(args: argparse.Namespace) -> int:
    is_policy = run_kind(args.model) == "rl"
    command, other, what = (rl, lm, "language models") if is_policy else (lm, rl, "RL run directories")
    given = [flag for name, flag in other.OPTIONS.items() if getattr(args, name) is not None]
    if given:
        kind = "an RL run directory" if is_policy else "a language model"
        verb = "applies" if len(given) == 1 else "apply"
        raise ConfigError(f"{', '.join(given)} {verb} to {what}; {args.model} is {kind}", key=given[0])
    return command.run(args)

"""The prompts a GRPO run learns from and the held-out prompts it is evaluated on."""

from __future__ import annotations

from pathlib import Path

from ember.core.errors import DataError, PathNotFoundError
from ember.core.jsonl import jsonl_records, lone_surrogate, readable
from ember.training.data.arithmetic import arithmetic_problems, split_problems
from ember.training.rl_lm.config import PromptsConfig


def load_prompts(config: PromptsConfig) -> tuple[list[str], list[str]]:
    """``(train prompts, held-out prompts)`` as ``config`` describes (held-out: at most
    ``eval_prompts``, in a fixed order; empty when there are none).

    Raises:
      PathNotFoundError: a prompts file does not exist.
      DataError: a file is not UTF-8 text, a line is not a JSON object with a non-empty string
        ``"prompt"`` of Unicode text, or a file has none.
    """
    if config.source == "arithmetic":
        train, held_out = split_problems(
            arithmetic_problems(config.max_operand, config.operators), config.held_out_fraction
        )
        return [p.prompt for p in train], [p.prompt for p in held_out][: config.eval_prompts]
    train = read_prompts(config.source)
    held_out = read_prompts(config.eval) if config.eval else []
    return train, held_out[: config.eval_prompts]


def read_prompts(path: str | Path) -> list[str]:
    """The ``"prompt"`` of every line of the JSONL file at ``path`` (blank lines skipped)."""
    path = Path(path)
    if not readable(path):  # a file or a pipe
        raise PathNotFoundError(f'prompts file {path} does not exist (JSONL lines of {{"prompt": "..."}})')
    prompts = []
    for record, where in jsonl_records(path):
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise DataError(f'{where}: expected an object with a non-empty string "prompt"')
        surrogate = lone_surrogate(prompt)
        if surrogate:
            raise DataError(f"{where}: the prompt holds a lone surrogate {surrogate[1]}: not Unicode text")
        prompts.append(prompt)
    if not prompts:
        raise DataError(f"{path} holds no prompts")
    return prompts


__all__ = ["load_prompts", "read_prompts"]

"""A synthetic arithmetic corpus, generated rather than downloaded: ``"a+b=c"`` problems.

    problems = arithmetic_problems(max_operand=100)           # every a+b with 0 <= a, b < 100
    train, held_out = split_problems(problems, held_out_fraction=0.1)
    directory = arithmetic_corpus_dir(max_operand=100)         # pretraining data (train problems only)

Each problem is a prompt ``"a+b="`` and its answer ``"c"``; a corpus document is the two
together (``"17+25=42"``), followed by the tokenizer's end-of-document token, so a model
pretrained on it stops after the answer. Which problems are held out is decided by a hash of
the prompt, so the split does not depend on the order or range of generation: held-out
problems never appear in the pretraining corpus or among reinforcement-learning prompts.

The corpus is prepared once into Ember's cache directory, keyed by its generation arguments
and by how it was prepared (``ember.training.data.corpus_cache``): a change to the documents
generated here bumps ``token_files.PREPARATION_FORMAT``, so caches of the old ones are
prepared again.
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import numpy as np

from ember.core.errors import ConfigError
from ember.training.data.corpus_cache import cached_corpus

OPERATORS = ("+", "-")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One exercise: ``prompt`` (``"17+25="``) and its exact ``answer`` (``"42"``)."""

    prompt: str
    answer: str


def arithmetic_problems(max_operand: int = 100, operators: str = "+") -> list[Problem]:
    """Every ``a<op>b`` with ``0 <= a, b < max_operand`` for each operator in ``operators``
    (``+``, ``-``), in a fixed order."""
    if max_operand < 2:
        raise ConfigError(f"max_operand must be >= 2, got {max_operand}", key="max_operand")
    unknown = sorted(set(operators) - set(OPERATORS))
    if unknown or not operators:
        raise ConfigError(
            f"operators must be a non-empty string of {', '.join(OPERATORS)}, got {operators!r}", key="operators"
        )
    problems = []
    for op in operators:
        for a in range(max_operand):
            for b in range(max_operand):
                value = a + b if op == "+" else a - b
                problems.append(Problem(f"{a}{op}{b}=", str(value)))
    return problems


def is_held_out(problem: Problem, held_out_fraction: float) -> bool:
    """Whether ``problem`` is held out (a hash of its prompt, independent of generation order)."""
    return zlib.crc32(problem.prompt.encode("utf-8")) % 10_000 < held_out_fraction * 10_000


def split_problems(problems: list[Problem], held_out_fraction: float = 0.1) -> tuple[list[Problem], list[Problem]]:
    """``(train, held_out)``: the problems to learn from and the ones kept for evaluation."""
    if not 0 < held_out_fraction < 1:
        raise ConfigError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}", key="held_out_fraction")
    held = [is_held_out(p, held_out_fraction) for p in problems]
    return [p for p, h in zip(problems, held) if not h], [p for p, h in zip(problems, held) if h]


def arithmetic_corpus_dir(
    max_operand: int = 100,
    operators: str = "+",
    held_out_fraction: float = 0.1,
    *,
    wrong_fraction: float = 0.0,
    repeats: int = 4,
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> Path:
    """The prepared pretraining dataset of the train problems (``repeats`` shuffled passes),
    generated into ``$EMBER_CACHE/corpora`` on first use and reused after (prepared again when
    the cached one was prepared another way). A ``wrong_fraction`` of the documents carry a
    systematic mistake, the answer plus one (a corpus with errors in it, like text from the
    web: the model learns both answers, and a reward that checks answers can teach it which
    one is right)."""
    if not 0 <= wrong_fraction < 1:
        raise ConfigError(f"wrong_fraction must be in [0, 1), got {wrong_fraction}", key="wrong_fraction")

    def documents() -> list[tuple[str, str]]:
        train, _ = split_problems(arithmetic_problems(max_operand, operators), held_out_fraction)
        rng = np.random.default_rng(seed)
        generated = []
        for round_ in range(repeats):
            for index in rng.permutation(len(train)):
                problem = train[index]
                answer = str(int(problem.answer) + 1) if rng.random() < wrong_fraction else problem.answer
                generated.append((f"{problem.prompt}#{round_}", problem.prompt + answer))
        return generated

    name = f"arithmetic-{operators.replace('+', 'plus').replace('-', 'minus')}-{max_operand}"
    return cached_corpus(
        f"{name}-h{held_out_fraction:g}-w{wrong_fraction:g}-r{repeats}-s{seed}", documents, cache_dir=cache_dir
    )


__all__ = ["OPERATORS", "Problem", "arithmetic_corpus_dir", "arithmetic_problems", "is_held_out", "split_problems"]

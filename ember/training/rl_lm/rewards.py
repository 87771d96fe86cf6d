"""Rewards of completions: plain Python functions of ``(prompt, completion)`` text, or jitted
functions of token arrays, and the scorer that never lets one bad sample stop a run.

    def my_reward(prompt: str, completion: str) -> float: ...
    reward = resolve_reward("my_package.rewards:my_reward")   # or a shipped name, see REWARDS

    @token_reward
    def shorter_is_better(prompt_tokens, prompt_lengths, completion_tokens, completion_lengths):
        return -completion_lengths.astype(jnp.float32)          # [n], runs under jax.jit

A Python reward that raises (or returns something that is not a finite number) scores 0
for that sample, and the scorer reports it; the other samples keep their scores. A token
reward scores a whole batch at once; if it raises, the batch scores 0 and that is reported.
"""

from __future__ import annotations

import ast
import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ember.core.errors import ConfigError

TextReward = Callable[[str, str], float]

_PROBLEM = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*=\s*$")


def arithmetic_exact_match(prompt: str, completion: str) -> float:
    """1.0 when ``completion`` (surrounding whitespace ignored) is exactly the value of the
    prompt's ``"a+b="`` / ``"a-b="`` / ``"a*b="`` problem, else 0.0. Raises ``ValueError``
    for a prompt that is not such a problem."""
    match = _PROBLEM.match(prompt)
    if match is None:
        raise ValueError(f"not an arithmetic problem of the form 'a+b=': {prompt!r}")
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return float(completion.strip() == str(value))


def python_parses(prompt: str, completion: str) -> float:
    """1.0 when ``prompt + completion`` parses as Python (``ast.parse``), else 0.0."""
    try:
        ast.parse(prompt + completion)
    except (SyntaxError, ValueError):
        return 0.0
    return 1.0


REWARDS: dict[str, TextReward] = {"arithmetic": arithmetic_exact_match, "python_parses": python_parses}
"""The shipped rewards, by the name a config gives."""


class TokenReward:
    """A jitted reward of token arrays (see :func:`token_reward`)."""

    def __init__(self, fn: Callable[..., jax.Array]):
        self.fn = fn
        self.jitted = jax.jit(fn)
        self.__name__ = getattr(fn, "__name__", "token_reward")

    def __call__(self, *arrays: jax.Array) -> jax.Array:
        return self.jitted(*arrays)


def token_reward(fn: Callable[..., jax.Array]) -> TokenReward:
    """Marks ``fn(prompt_tokens [n, P], prompt_lengths [n], completion_tokens [n, C],
    completion_lengths [n]) -> [n]`` (int32 token arrays, right-padded with 0) as a reward
    the scorer runs under ``jax.jit`` on a whole batch."""
    return TokenReward(fn)


def resolve_reward(name: str) -> TextReward | TokenReward:
    """A shipped reward (``REWARDS``) or ``"package.module:function"``; ``ConfigError`` (key
    ``reward``) when it cannot be found."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise ConfigError(
            f"reward {name!r} is neither a shipped reward ({', '.join(REWARDS)}) nor 'package.module:function'",
            key="reward",
        )
    module_name, _, attribute = name.partition(":")
    if not module_name or module_name.startswith(".") or not attribute:
        raise ConfigError(
            f"reward {name!r} is not 'package.module:function' (an absolute module name, then a function name)",
            key="reward",
        )
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        # The `ember` script, unlike `python -m ember`, does not look in the current directory.
        hint = " (a module of your own must be on PYTHONPATH)" if isinstance(error, ModuleNotFoundError) else ""
        raise ConfigError(f"reward {name!r} cannot be imported: {error}{hint}", key="reward") from None
    if not callable(function):
        raise ConfigError(f"reward {name!r} is not callable", key="reward")
    return function


class Scores(NamedTuple):
    """``rewards`` float32 ``[n]``; ``failures``: ``"sample i: what went wrong"`` for each
    sample (or batch) that scored 0 because its reward failed."""

    rewards: np.ndarray
    failures: list[str]


def score(
    reward: TextReward | TokenReward,
    prompts: Sequence[str],
    completions: Sequence[str],
    prompt_tokens: Sequence[Sequence[int]],
    completion_tokens: Sequence[Sequence[int]],
) -> Scores:
    """The reward of each ``(prompt, completion)`` (see the module docstring for failures)."""
    if isinstance(reward, TokenReward):
        return _score_tokens(reward, prompt_tokens, completion_tokens)
    rewards = np.zeros(len(prompts), np.float32)
    failures = []
    for index, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        try:
            value = float(reward(prompt, completion))
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
        except Exception as error:
            failures.append(f"sample {index}: {type(error).__name__}: {error}")
            continue
        rewards[index] = value
    return Scores(rewards, failures)


def _score_tokens(
    reward: TokenReward, prompt_tokens: Sequence[Sequence[int]], completion_tokens: Sequence[Sequence[int]]
) -> Scores:
    prompts, prompt_lengths = _padded(prompt_tokens)
    completions, completion_lengths = _padded(completion_tokens)
    try:
        values = np.asarray(reward(prompts, prompt_lengths, completions, completion_lengths), np.float32)
        if values.shape != (len(prompt_tokens),):
            raise ValueError(f"returned shape {values.shape}, expected ({len(prompt_tokens)},)")
    except Exception as error:
        return Scores(np.zeros(len(prompt_tokens), np.float32), [f"batch: {type(error).__name__}: {error}"])
    bad = np.flatnonzero(~np.isfinite(values))
    failures = [f"sample {i}: returned {values[i]}" for i in bad]
    return Scores(np.where(np.isfinite(values), values, 0.0).astype(np.float32), failures)


def _padded(rows: Sequence[Sequence[int]]) -> tuple[jax.Array, jax.Array]:
    width = max(1, max((len(r) for r in rows), default=0))
    array = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        array[i, : len(row)] = row
    return jnp.asarray(array), jnp.asarray([len(r) for r in rows], jnp.int32)


__all__ = [
    "REWARDS",
    "Scores",
    "TextReward",
    "TokenReward",
    "arithmetic_exact_match",
    "python_parses",
    "resolve_reward",
    "score",
    "token_reward",
]

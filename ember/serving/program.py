"""``DeviceProgram``: the compiled device side of an engine, independent of where it came
from (a ``DecoderLM`` in :mod:`ember.serving.model_program`, or a ``jax.export`` artifact
in :mod:`ember.serving.export`).

Every step function has the signature

    step(params, kv, batch, settings) -> (kv, tokens [rows], logprobs [rows])

with ``kv`` the cache pages (donated), ``batch`` = ``tokens int32 [rows, width]``,
``starts int32 [rows]`` (position of each row's first token), ``counts int32 [rows]``
(valid tokens per row; the rest is padding), ``page_table int32 [rows, pages_per_seq]``,
and ``settings`` the per-row sampling arrays of :mod:`ember.serving.sampling`. Row ``r``'s
token is sampled from the logits of its last valid token. One function exists per chunk
``width``; all are compiled before the engine serves its first request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ember.serving.sampling import settings_spec

StepFunction = Callable[[Any, Any, dict[str, jax.Array], dict[str, jax.Array]], tuple[Any, jax.Array, jax.Array]]


@dataclasses.dataclass
class DeviceProgram:
    """Compiled step functions plus the arrays they run on.

    ``steps`` maps a chunk width to its compiled step; ``kv`` is the paged cache
    (``{"block_<j>": {"k_pages", "v_pages": [groups, num_pages, page_size, kv_heads,
    head_dim]}}``), replaced by each step's output since its buffers are donated.
    """

    steps: dict[int, StepFunction]
    params: Any
    kv: Any
    num_slots: int
    pages_per_seq: int
    page_size: int
    num_pages: int
    vocab_size: int
    max_context: int

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(sorted(self.steps))


def batch_arrays(rows: int, width: int, pages_per_seq: int) -> dict[str, np.ndarray]:
    """Zeroed host buffers of one step's ``batch`` argument."""
    return {
        "tokens": np.zeros((rows, width), np.int32),
        "starts": np.zeros((rows,), np.int32),
        "counts": np.zeros((rows,), np.int32),
        "page_table": np.zeros((rows, pages_per_seq), np.int32),
    }


def step_argument_specs(params: Any, kv: Any, rows: int, width: int, pages_per_seq: int) -> tuple[Any, ...]:
    """``jax.ShapeDtypeStruct``s of a step's four arguments (for lowering and export)."""
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    batch = {name: spec(array) for name, array in batch_arrays(rows, width, pages_per_seq).items()}
    return jax.tree.map(spec, params), jax.tree.map(spec, kv), batch, settings_spec(rows)


def check_widths(widths: tuple[int, ...]) -> tuple[int, ...]:
    """Sorted distinct positive chunk widths; raises ``ValueError`` otherwise."""
    if not widths or any(int(w) < 1 for w in widths):
        raise ValueError(f"widths must be a non-empty list of positive chunk widths, got {widths!r}")
    return tuple(sorted({int(w) for w in widths}))


__all__ = ["DeviceProgram", "StepFunction", "batch_arrays", "check_widths", "step_argument_specs"]

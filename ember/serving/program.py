"""``DeviceProgram``: the compiled device side of an engine, independent of where it came
from (a ``DecoderLM`` in :mod:`ember.serving.model_program`, or a ``jax.export`` artifact
in :mod:`ember.serving.export`).

Every step function has the signature

    step(params, kv, batch, settings) -> (kv, tokens [slots], logprobs [slots])

with ``kv`` the cache pages and state slots (donated) and ``batch`` one flat token budget
of mixed prefill chunks and decode tokens (the layout of ``ember.kernels_pallas.ragged_paged_attention``):

    tokens        int32 [num_tokens]              the budget; rows outside every run are padding
    query_starts  int32 [slots]                   first budget row of each slot's run
    query_lens    int32 [slots]                   tokens of the run (0: the slot sits out)
    kv_lens       int32 [slots]                   sequence length after the run
    page_table    int32 [slots, pages_per_seq]
    adapters      int32 [slots]                   each slot's adapter (-1: none); only in
                                                  programs serving several adapters

and ``settings`` the per-slot sampling arrays of :mod:`ember.serving.sampling`. Slot ``s``'s
token is sampled from the logits of its run's last token. One function exists per budget
size ``num_tokens`` (a *bucket*); all are compiled before the engine serves its first
request, and each step uses the smallest bucket that holds its tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ember.core.errors import ConfigError
from ember.serving.sampling import settings_spec

StepFunction = Callable[[Any, Any, dict[str, jax.Array], dict[str, jax.Array]], tuple[Any, jax.Array, jax.Array]]


@dataclasses.dataclass
class DeviceProgram:
    """Compiled step functions plus the arrays they run on.

    ``steps`` maps a token bucket (budget size) to its compiled step; ``kv`` is the cache's
    ``layers`` tree (``ember.models.cache``: pages ``[groups, num_pages, page_size, kv_heads,
    head_dim]`` and per-slot states ``[groups, num_slots, ...]``), replaced by each step's
    output since its buffers are donated. A slot whose run starts at position 0 starts
    from an empty state, so a reused or preempted slot needs no reset.
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
    adapter_names: tuple[str, ...] = ()
    """The adapters the params hold stacked (slot ``i`` is ``adapter_names[i]``), if any."""

    def fresh_copy(self, params: Any = None) -> DeviceProgram:
        """A program sharing these compiled steps with its own empty cache (and ``params``
        instead of these, of the same shapes, if given): engines on copies run independently."""
        kv = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), self.kv)
        return dataclasses.replace(self, kv=kv, params=self.params if params is None else params)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.steps))

    @property
    def token_budget(self) -> int:
        """The most tokens one step can take (the largest bucket)."""
        return max(self.steps)


LAYOUT_FIELDS: tuple[str, ...] = tuple(
    field.name
    for field in dataclasses.fields(DeviceProgram)
    if field.name not in ("steps", "params", "kv", "adapter_names")
)
"""``DeviceProgram``'s size fields: ``num_slots``, ``pages_per_seq``, ``page_size``, ``num_pages``,
``vocab_size``, ``max_context``."""


def batch_arrays(slots: int, num_tokens: int, pages_per_seq: int, *, adapters: bool = False) -> dict[str, np.ndarray]:
    """Zeroed host buffers of one step's ``batch`` argument (``adapters``: with the slots'
    adapter indices, all -1)."""
    arrays = {
        "tokens": np.zeros((num_tokens,), np.int32),
        "query_starts": np.zeros((slots,), np.int32),
        "query_lens": np.zeros((slots,), np.int32),
        "kv_lens": np.zeros((slots,), np.int32),
        "page_table": np.zeros((slots, pages_per_seq), np.int32),
    }
    if adapters:
        arrays["adapters"] = np.full((slots,), -1, np.int32)
    return arrays


def step_argument_specs(
    params: Any, kv: Any, slots: int, num_tokens: int, pages_per_seq: int, *, adapters: bool = False
) -> tuple[Any, ...]:
    """``jax.ShapeDtypeStruct``s of a step's four arguments (for lowering and export)."""
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    arrays = batch_arrays(slots, num_tokens, pages_per_seq, adapters=adapters)
    batch = {name: spec(array) for name, array in arrays.items()}
    return jax.tree.map(spec, params), jax.tree.map(spec, kv), batch, settings_spec(slots)


def resolve_token_buckets(num_slots: int, token_budget: int, buckets: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The budget sizes to compile, sorted: ``buckets`` if given (their largest is the
    budget), else ``num_slots`` (a step of decodes only) and ``token_budget``. Raises
    ``ConfigError`` (keyed by the argument) for non-positive sizes."""
    if num_slots < 1:
        raise ConfigError(f"num_slots must be positive, got {num_slots}", key="num_slots")
    if buckets is None:
        if token_budget < 1:
            raise ConfigError(f"token_budget must be positive, got {token_budget}", key="token_budget")
        buckets = (min(num_slots, token_budget), token_budget)
    if not buckets or any(int(b) < 1 for b in buckets):
        raise ConfigError(
            f"token_buckets must be a non-empty list of positive budget sizes, got {buckets!r}", key="token_buckets"
        )
    return tuple(sorted({int(b) for b in buckets}))


__all__ = [
    "LAYOUT_FIELDS",
    "DeviceProgram",
    "StepFunction",
    "batch_arrays",
    "resolve_token_buckets",
    "step_argument_specs",
]

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

A program built from the model also has *scoring* steps (:class:`ScoringSteps`), for requests
that ask for prompt log-probabilities or alternatives: they take one more batch array,

    targets       int32 [num_tokens]              the token each row is scored for

and return ``(kv, tokens, logprobs, scores)``, ``scores`` the ``row_scores`` of every row of
the budget (:func:`ember.serving.sampling.row_scores`, :data:`TOP_ALTERNATIVES` of them).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ember.core.errors import ConfigError
from ember.core.sharding import unbox
from ember.core.tree import param_paths
from ember.serving.requests import MAX_TOP_LOGPROBS
from ember.serving.sampling import settings_spec

StepFunction = Callable[[Any, Any, dict[str, jax.Array], dict[str, jax.Array]], tuple[Any, ...]]
TOP_ALTERNATIVES = MAX_TOP_LOGPROBS
"""Alternatives a scoring step gives per row (fewer for a smaller vocabulary): every request's."""


class ScoringSteps:
    """A program's scoring steps (module docstring), each bucket's compiled when first asked for:
    few requests ask for prompt log-probabilities or alternatives, and compiling them with the
    others would double every engine's start-up. Engines on copies of a program share them."""

    def __init__(self, compile_bucket: Callable[[int], StepFunction]):
        self._compile_bucket = compile_bucket
        self._steps: dict[int, StepFunction] = {}
        self._lock = threading.Lock()  # engines in threads may ask for the same bucket at once

    def __getitem__(self, bucket: int) -> StepFunction:
        with self._lock:
            if bucket not in self._steps:
                self._steps[bucket] = self._compile_bucket(bucket)
            return self._steps[bucket]


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
    weight_dtypes: Mapping[str, np.dtype] = dataclasses.field(default_factory=dict)
    """The weights stored in the narrower dtype the steps read them in (``ember.core.read_dtypes``),
    by path: weights given for them in their original dtype are converted on the way in."""
    inputs: Any = None
    """Where the steps take their ``batch`` and ``settings`` (and place them, given host arrays):
    the default device (None) or, for a program split over a mesh (``ember.serving.mesh``),
    replicated over it."""
    scoring_steps: ScoringSteps | None = None
    """The scoring steps (module docstring); None for a program without them (an exported one)."""
    shares_prefixes: bool = False
    """Whether sequences that begin alike may share cache pages: every layer of the model keeps
    its cache in the pages (``ember.serving.prefix_cache``)."""

    def fresh_copy(self, params: Any = None) -> DeviceProgram:
        """A program sharing these compiled steps with its own empty cache (and ``params``
        instead of these, of the same shapes, if given): engines on copies run independently.
        Both are placed as this program's (on a mesh, each leaf in its shards)."""
        kv = empty_cache(self.kv)
        if params is not None:
            params = self.stored(params)
            if self.inputs is not None:  # compiled for weights in the shards of the program's own
                params = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), unbox(params), self.params)
        return dataclasses.replace(self, kv=kv, params=self.params if params is None else params)

    def stored(self, weights: Any) -> Any:
        """``weights`` (the whole tree or a nested-dict part of it) as the program stores them."""
        return narrowed_weights(weights, self.weight_dtypes)

    def load_params(self, updates: Any) -> None:
        """Replaces the weights in ``updates`` (the whole tree or any nested-dict part of it,
        such as the trainable leaves of a run) with copies of them on this program's devices,
        device to device: the compiled steps take the new weights as they are (nothing
        recompiles) and no buffer is shared with the caller, whose arrays may be donated later.
        A weight the program stores narrower (:attr:`weight_dtypes`) is converted to it.

        Raises:
          ValueError: a path that is not one of the weights, or a shape or dtype that differs
            from the weight it replaces (the steps were compiled for those).
        """
        current = {path: _unboxed(leaf) for path, leaf in param_paths(self.params).items()}
        new = {path: _unboxed(leaf) for path, leaf in param_paths(self.stored(updates)).items()}
        for path, leaf in new.items():
            if path not in current:
                known = ", ".join(sorted(current)[:4])
                raise ValueError(f"{path!r} is not one of the served weights (they look like {known}, ...)")
            old = current[path]
            if tuple(leaf.shape) != tuple(old.shape) or jnp.dtype(leaf.dtype) != jnp.dtype(old.dtype):
                raise ValueError(
                    f"weight {path!r} is {jnp.dtype(leaf.dtype).name}{list(leaf.shape)}; the steps were compiled "
                    f"for {jnp.dtype(old.dtype).name}{list(old.shape)}"
                )
        copies = {path: owned_copy(leaf, current[path].sharding) for path, leaf in new.items()}
        self.params = _with_leaves(self.params, copies)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.steps))

    @property
    def token_budget(self) -> int:
        """The most tokens one step can take (the largest bucket)."""
        return max(self.steps)


def owned_copy(tree: Any, placement: Any) -> Any:
    """``tree``'s arrays on ``placement`` (a device or sharding) in buffers of their own, by
    transfers only (nothing compiles). Moving a replicated array to one of its devices hands
    back that device's shard even with ``may_alias=False`` (jax 0.10), and a later donation of
    the original would delete it; a second ``device_put`` on the same placement copies."""
    return jax.tree.map(lambda leaf: jax.device_put(jax.device_put(leaf, placement), placement, may_alias=False), tree)


def narrowed_weights(weights: Any, dtypes: Mapping[str, Any]) -> Any:
    """``weights`` (nested dicts) with the float leaves at the paths of ``dtypes`` converted to
    theirs (a boxed leaf keeps its box): NumPy leaves on the host, jax arrays by one program for
    all those on the same devices (converted leaf by leaf, each weight shape compiled its own)."""
    targets = {}
    for path, leaf in param_paths(weights).items():
        leaf = _unboxed(leaf)
        if path in dtypes and jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != dtypes[path]:
            targets[path] = leaf
    narrowed, on_devices = {}, {}
    for path, leaf in targets.items():
        if isinstance(leaf, jax.Array):  # one program may take arrays of one device set only
            devices = None if isinstance(leaf, jax.core.Tracer) else frozenset(leaf.sharding.device_set)
            on_devices.setdefault(devices, {})[path] = leaf
        else:
            narrowed[path] = leaf.astype(dtypes[path])
    for leaves in on_devices.values():
        narrowed.update(_converted(leaves, tuple((path, np.dtype(dtypes[path])) for path in sorted(leaves))))
    return _with_leaves(weights, narrowed) if narrowed else weights


@functools.partial(jax.jit, static_argnums=1)
def _converted(leaves: dict[str, jax.Array], dtypes: tuple[tuple[str, np.dtype], ...]) -> dict[str, jax.Array]:
    """``leaves`` (by path) converted to the dtypes of ``dtypes``' ``(path, dtype)`` pairs."""
    return {path: leaves[path].astype(dtype) for path, dtype in dtypes}


def empty_cache(like: Any, shardings: Any = None) -> Any:
    """A cache of zeros with the shapes and dtypes of ``like``'s leaves (arrays or
    ``ShapeDtypeStruct``s), placed by ``shardings`` (a tree of them) if given, else where each
    leaf is: by its ``sharding``, or uncommitted on the default device for an array committed to
    none (a program's own cache as ``build_program`` makes it, so copies share its program).
    One program makes the whole tree (zeroed leaf by leaf, each leaf shape compiled its own), and
    a cache split over a mesh is made in its shards (whole, it may not fit one device)."""
    leaves, treedef = jax.tree.flatten(like)
    shapes = tuple((tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in leaves)
    if shardings is None:
        shardings = [leaf.sharding if getattr(leaf, "committed", True) else None for leaf in leaves]
    else:
        shardings = treedef.flatten_up_to(shardings)
    return jax.tree.unflatten(treedef, jax.jit(_zeros, static_argnums=0, out_shardings=shardings)(shapes))


def _zeros(shapes: tuple[tuple[tuple[int, ...], np.dtype], ...]) -> list[jax.Array]:
    return [jnp.zeros(shape, dtype) for shape, dtype in shapes]


def _unboxed(leaf: Any) -> Any:
    return leaf.unbox(apply_constraint=False) if isinstance(leaf, nn.meta.AxisMetadata) else leaf


def _with_leaves(tree: Any, leaves: dict[str, Any], prefix: str = "") -> Any:
    """``tree`` (nested dicts) with the leaves at the ``/``-joined paths of ``leaves`` replaced
    (a boxed leaf keeps its box: the compiled steps take the tree's structure as it was)."""

    def replaced(path: str, old: Any) -> Any:
        if path not in leaves:
            return old
        return old.replace_boxed(leaves[path]) if isinstance(old, nn.meta.AxisMetadata) else leaves[path]

    return {
        key: _with_leaves(value, leaves, f"{prefix}{key}/")
        if isinstance(value, Mapping)
        else replaced(prefix + key, value)
        for key, value in tree.items()
    }


LAYOUT_FIELDS: tuple[str, ...] = tuple(
    field.name
    for field in dataclasses.fields(DeviceProgram)
    if field.name
    not in ("steps", "params", "kv", "adapter_names", "weight_dtypes", "inputs", "scoring_steps", "shares_prefixes")
)
"""``DeviceProgram``'s size fields: ``num_slots``, ``pages_per_seq``, ``page_size``, ``num_pages``,
``vocab_size``, ``max_context``."""


def batch_arrays(
    slots: int, num_tokens: int, pages_per_seq: int, *, adapters: bool = False, targets: bool = False
) -> dict[str, np.ndarray]:
    """Zeroed host buffers of one step's ``batch`` argument (``adapters``: with the slots'
    adapter indices, all -1; ``targets``: with a scoring step's targets)."""
    arrays = {
        "tokens": np.zeros((num_tokens,), np.int32),
        "query_starts": np.zeros((slots,), np.int32),
        "query_lens": np.zeros((slots,), np.int32),
        "kv_lens": np.zeros((slots,), np.int32),
        "page_table": np.zeros((slots, pages_per_seq), np.int32),
    }
    if adapters:
        arrays["adapters"] = np.full((slots,), -1, np.int32)
    if targets:
        arrays["targets"] = np.zeros((num_tokens,), np.int32)
    return arrays


def step_argument_specs(
    params: Any,
    kv: Any,
    slots: int,
    num_tokens: int,
    pages_per_seq: int,
    *,
    adapters: bool = False,
    targets: bool = False,
) -> tuple[Any, ...]:
    """``jax.ShapeDtypeStruct``s of a step's four arguments (for lowering and export;
    ``targets``: a scoring step's)."""
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    arrays = batch_arrays(slots, num_tokens, pages_per_seq, adapters=adapters, targets=targets)
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
    "TOP_ALTERNATIVES",
    "DeviceProgram",
    "ScoringSteps",
    "StepFunction",
    "batch_arrays",
    "empty_cache",
    "narrowed_weights",
    "owned_copy",
    "resolve_token_buckets",
    "step_argument_specs",
]

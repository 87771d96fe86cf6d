"""Builds a :class:`~ember.serving.program.DeviceProgram` from a ``DecoderLM``.

The step runs the model once over the step's flat token budget (prefill chunks and decode
tokens of every slot, through the model's ragged cache: ``ragged_paged_attention`` for
softmax-family layers, per-slot state for CCA and linear attention), computes logits only
at each slot's last token and samples on device. Cache pages and state slots are donated
and every token bucket is compiled here, once. The scoring steps (logits at every row of the
budget) are compiled when an engine first needs them.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ember.core.errors import ConfigError
from ember.core.read_dtypes import read_dtypes
from ember.core.sharding import tree_shardings, unbox, use_sharding
from ember.core.tree import leaves_with_paths, map_paths, param_paths
from ember.models.adapters.stacking import stack_adapters
from ember.models.cache import cache_layer_axes, init_cache_layers
from ember.models.config import SOFTMAX_FAMILY, ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.quantization.placement import split_alike_shapes
from ember.models.quantization.quantize import stored_part_axes
from ember.models.quantization.stored import stored_weight_paths
from ember.models.variables import as_variables, serving_weights, split_variables
from ember.serving.mesh import SERVING_RULES, StepPlacement, check_serving_mesh
from ember.serving.program import (
    TOP_ALTERNATIVES,
    DeviceProgram,
    ScoringSteps,
    empty_cache,
    narrowed_weights,
    resolve_token_buckets,
    step_argument_specs,
)
from ember.serving.sampling import row_scores, sample_tokens


def model_step(
    model: DecoderLM,
    params: Any,
    kv: Any,
    batch: dict[str, jax.Array],
    settings: dict[str, jax.Array],
    *,
    scoring: bool = False,
):
    """One serving step of ``model`` (the ``StepFunction`` signature of ``ember.serving.program``);
    ``params`` are the model's weights as ``ember.models.variables.serving_weights`` gives them
    (the param tree, or the parameters with the model state, such as an MoE balancing bias).
    ``scoring``: a scoring step (logits at every row of the budget, each row scored)."""
    cache = {
        name: batch[name]
        for name in ("page_table", "query_starts", "query_lens", "kv_lens", "adapters")
        if name in batch
    }
    last = jnp.maximum(batch["query_starts"] + batch["query_lens"] - 1, 0)  # [slots]
    logits, cache = model.apply(
        as_variables(params),
        batch["tokens"][None],
        cache={**cache, "layers": kv},
        logits_at=None if scoring else last[None],
    )
    if not scoring:
        next_tokens, logprobs = sample_tokens(logits[0], settings)
        return cache["layers"], next_tokens, logprobs
    log_probs = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)  # [num_tokens, vocab]
    next_tokens, _ = sample_tokens(logits[0][last], settings)
    # The sampled tokens' log-probabilities from the rows the alternatives come from: equal to the
    # first alternative's, to the bit, when the greedy token is drawn.
    logprobs = log_probs[last, next_tokens]
    scores = row_scores(log_probs, batch["targets"], min(TOP_ALTERNATIVES, log_probs.shape[-1]))
    return cache["layers"], next_tokens, logprobs, scores


def jitted_step(config: ModelConfig, placement: StepPlacement | None = None, *, scoring: bool = False):
    """The jitted ``model_step`` of ``DecoderLM(config)`` (``scoring``: its scoring step) with the
    cache (pages, state slots) donated; with ``placement``, its arguments and results sharded so
    (the donated cache comes back with the sharding it went in with, step after step)."""
    step = functools.partial(model_step, DecoderLM(config), scoring=scoring)
    if placement is None:
        return jax.jit(step, donate_argnums=1)
    outputs = placement.out_shardings + ((placement.replicated,) if scoring else ())
    return jax.jit(step, donate_argnums=1, in_shardings=placement.in_shardings, out_shardings=outputs)


def build_program(
    config: ModelConfig,
    params: Any,
    *,
    num_slots: int = 8,
    token_budget: int = 64,
    token_buckets: tuple[int, ...] | None = None,
    max_context: int | None = None,
    num_pages: int | None = None,
    kv_dtype: Any = None,
    adapters: Mapping[str, Any] | None = None,
    mesh: Mesh | None = None,
) -> DeviceProgram:
    """Compiles the steps of ``DecoderLM(config)`` for every token bucket.

    Args:
      config, params: the model.
      num_slots: requests served at once.
      token_budget: the most tokens one step takes (decodes plus prefill chunks).
      token_buckets: budget sizes to compile (their largest replaces ``token_budget``);
        default ``(num_slots, token_budget)``: steps of decodes only run at ``num_slots``.
      max_context: longest sequence (prompt + output); default ``config.max_seq_len``.
      num_pages: pages in the pool; default enough for every slot at ``max_context``.
      kv_dtype: page (and convolution-tail) dtype; default the model's compute dtype.
      adapters: name -> adapter leaves (``ember.models.adapters``) to serve at once, stacked
        onto ``params`` (``ember.models.adapters.stacking``); each request names one or none.
      mesh: serve the model split over this mesh's ``tensor`` and ``expert`` axes
        (``ember.serving.mesh``: its other axes must have size 1); default one device.
    """
    names: tuple[str, ...] = ()
    if adapters:
        weights, state = split_variables(as_variables(params))
        weights, names = stack_adapters(weights, adapters)
        params = serving_weights(weights, state)
    buckets = resolve_token_buckets(num_slots, token_budget, token_buckets)
    layout = program_layout(config, num_slots, max_context, num_pages)
    kv_shapes = jax.eval_shape(functools.partial(init_cache_layers, config, num_slots, layout["num_pages"], kv_dtype))
    placement = None
    if mesh is not None:
        params = unbox(params)
        placement = step_placement(config, params, kv_shapes, mesh)
    kv = empty_cache(kv_shapes, None if placement is None else placement.kv)
    step = jitted_step(config, placement)
    pages_per_seq, with_adapters = layout["pages_per_seq"], bool(names)
    with contextlib.nullcontext() if mesh is None else use_sharding(mesh, SERVING_RULES):
        weight_dtypes = read_weight_dtypes(step, params, kv, num_slots, pages_per_seq, adapters=with_adapters)
        params = narrowed_weights(params, weight_dtypes)
        steps = {
            size: step.lower(
                *step_argument_specs(params, kv, num_slots, size, pages_per_seq, adapters=with_adapters)
            ).compile()
            for size in buckets
        }
    param_specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    kv_specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), kv)

    def compile_scoring(size: int):
        specs = step_argument_specs(
            param_specs, kv_specs, num_slots, size, pages_per_seq, adapters=with_adapters, targets=True
        )
        with contextlib.nullcontext() if mesh is None else use_sharding(mesh, SERVING_RULES):
            return jitted_step(config, placement, scoring=True).lower(*specs).compile()

    if placement is not None:
        params = jax.device_put(params, placement.params)
    return DeviceProgram(
        steps=steps,
        params=params,
        kv=kv,
        adapter_names=names,
        weight_dtypes=weight_dtypes,
        inputs=None if placement is None else placement.replicated,
        scoring_steps=ScoringSteps(compile_scoring),
        shares_prefixes=shares_prefixes(config),
        **layout,
    )


def shares_prefixes(config: ModelConfig) -> bool:
    """Whether a serving program of ``DecoderLM(config)`` may share the cache pages of sequences
    that begin alike: every layer keeps its cache in the pages (a recurrent layer's state at the
    end of a prefix is not kept)."""
    return set(config.layer_kinds) <= set(SOFTMAX_FAMILY)


def step_placement(config: ModelConfig, params: Any, kv: Any, mesh: Mesh) -> StepPlacement:
    """The shardings of a step of ``DecoderLM(config)`` on ``mesh`` (checked by
    :func:`check_serving_mesh`; an ``expert`` axis needs a model with MoE layers), for
    ``params`` (unboxed, as ``serving_weights`` gives them) and the cache ``kv``
    (``ember.models.cache.init_cache_layers``)."""
    check_serving_mesh(mesh.shape)
    experts = mesh.shape.get("expert", 1)
    if experts > 1 and "moe" not in config.layer_mlps:
        raise ConfigError(
            f"mesh.expert={experts}: the model has no mixture-of-experts layer to split over it (every device "
            "would hold and compute the same); give mesh.expert=1",
            key="mesh.expert",
        )
    return StepPlacement(
        params=weight_shardings(config, params, mesh),
        kv=tree_shardings(mesh, cache_layer_axes(config), SERVING_RULES, shapes=kv),
        replicated=NamedSharding(mesh, PartitionSpec()),
    )


def weight_shardings(config: ModelConfig, params: Any, mesh: Mesh) -> Any:
    """``NamedSharding``s of the weights ``params`` (arrays or ``ShapeDtypeStruct``s) of
    ``DecoderLM(config)`` on ``mesh``: by :func:`weight_axes` under ``SERVING_RULES``, each
    stored quantized weight's parts split alike (``ember.models.quantization.placement``)."""
    axes = weight_axes(config, params)
    return tree_shardings(mesh, axes, SERVING_RULES, shapes=split_alike_shapes(params, axes))


def weight_axes(config: ModelConfig, params: Any) -> Any:
    """``params``' tree with each leaf's logical axes (a ``PartitionSpec`` of logical names):
    those ``DecoderLM(config).init`` gives the weight at its path and shape, and a stored
    quantized weight's parts those its quantized layout implies (``stored_part_axes``: its codes
    and scales split as the float weight's columns and first input axis); a leaf the model's
    own init has not (a stacked adapter's factors, another layout) stays replicated."""
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    abstract = jax.eval_shape(DecoderLM(config).init, jax.random.key(0), tokens)
    declared = param_paths(serving_weights(*split_variables(abstract)))
    flat = param_paths(params)
    parts: dict[str, list[str]] = {}  # stored weight path -> its parts' keys
    for path in flat:
        weight, _, key = path.rpartition("/")
        parts.setdefault(weight, []).append(key)
    stored = {
        path: stored_part_axes(path, declared[path], parts[path])
        for path in stored_weight_paths(flat)
        if isinstance(declared.get(path), nn.Partitioned)
    }

    def axes(path: str, leaf: Any) -> PartitionSpec:
        box = declared.get(path)
        if isinstance(box, nn.Partitioned) and tuple(box.value.shape) == tuple(jnp.shape(leaf)):
            return PartitionSpec(*box.names)
        weight, _, key = path.rpartition("/")
        names = stored.get(weight, {}).get(key)
        if names is not None and len(names) == len(jnp.shape(leaf)):
            return PartitionSpec(*names)
        return PartitionSpec()

    return map_paths(axes, params)


def read_weight_dtypes(
    step: Any, params: Any, kv: Any, num_slots: int, pages_per_seq: int, *, adapters: bool = False
) -> dict[str, np.dtype]:
    """``{path: dtype}`` of the float weights in ``params`` that ``step`` reads only converted
    to a narrower dtype (``ember.core.read_dtypes``): the float32 weights of a bf16 model's
    projections and embeddings, not its norm scales or routers (read in float32). Stored in
    that dtype, they give the same tokens and logprobs, and each step reads half the bytes
    and converts nothing."""
    specs = step_argument_specs(nn.meta.unbox(params), kv, num_slots, num_slots, pages_per_seq, adapters=adapters)
    paths_and_leaves = leaves_with_paths(params)
    dtypes = read_dtypes(step, *specs)[: len(paths_and_leaves)]
    return {
        "/".join(path): dtype
        for (path, leaf), dtype in zip(paths_and_leaves, dtypes)
        if dtype is not None and jnp.issubdtype(leaf.dtype, jnp.floating) and dtype.itemsize < leaf.dtype.itemsize
    }


def program_layout(
    config: ModelConfig, num_slots: int, max_context: int | None, num_pages: int | None
) -> dict[str, int]:
    """The size fields of a program of ``DecoderLM(config)`` (``ember.serving.program.LAYOUT_FIELDS``),
    with the defaults of :func:`build_program` filled in and checked."""
    max_context = config.max_seq_len if max_context is None else max_context
    if not 1 <= max_context <= config.max_seq_len:
        raise ConfigError(
            f"max_context must be in [1, max_seq_len={config.max_seq_len}], got {max_context}", key="max_context"
        )
    pages_per_seq = math.ceil(max_context / config.page_size)
    return dict(
        num_slots=num_slots,
        pages_per_seq=pages_per_seq,
        page_size=config.page_size,
        num_pages=num_slots * pages_per_seq if num_pages is None else num_pages,
        vocab_size=config.vocab_size,
        max_context=max_context,
    )


__all__ = [
    "build_program",
    "jitted_step",
    "model_step",
    "program_layout",
    "read_weight_dtypes",
    "shares_prefixes",
    "step_placement",
    "weight_axes",
    "weight_shardings",
]

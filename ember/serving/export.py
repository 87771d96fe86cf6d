"""Serving artifacts: the step functions serialized with ``jax.export`` plus the weights.

    ember export RUN_OR_HF_DIR OUT_DIR [--num-slots 8 --token-budget 64 --max-context N]
    ember generate --artifact OUT_DIR --prompts in.jsonl --out out.jsonl

``OUT_DIR`` holds ``manifest.json`` (engine sizes, token buckets, tokenizer description, EOS
ids), ``step_t<tokens>.jaxexport`` (one serialized step per token bucket) and ``params.npz`` (the
parameter leaves in the order of the exported functions' input tree, each in the dtype the
step reads it in: ``ember.serving.model_program.read_weight_dtypes``). Loading an artifact
(:func:`load_artifact`) imports neither ``ember.models`` nor Flax model code: the exported
functions carry their input trees, from which the parameters and the empty cache are rebuilt.
The tokenizer travels in the manifest (its ``describe()``: Ember's byte tokenizer, or a Hugging
Face model's ``tokenizer.json`` and configuration), so an artifact takes text prompts; one
exported without a tokenizer takes ``prompt_tokens`` only.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ember.core.errors import DataError, PathNotFoundError
from ember.core.tokenizer import tokenizer_from_description
from ember.serving.program import (
    LAYOUT_FIELDS,
    DeviceProgram,
    empty_cache,
    narrowed_weights,
    resolve_token_buckets,
    step_argument_specs,
)
from ember.serving.scheduler import eos_ids_of

FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)
"""Format 2 held one ``eos_id``; 3 holds ``eos_ids``, a list."""


def export_program(
    config: Any,
    params: Any,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    eos_id: int | Sequence[int] | None = None,
    num_slots: int = 8,
    token_budget: int = 64,
    token_buckets: tuple[int, ...] | None = None,
    max_context: int | None = None,
    num_pages: int | None = None,
) -> Path:
    """Writes the artifact of ``DecoderLM(config)`` with ``params`` to ``out_dir``
    (sizes as in :func:`ember.serving.model_program.build_program`; ``eos_id``: one
    end-of-sequence id or several, as ``Engine`` takes them)."""
    from ember.models.cache import init_cache_layers  # model code: export side only
    from ember.serving.model_program import jitted_step, program_layout, read_weight_dtypes, shares_prefixes

    buckets = resolve_token_buckets(num_slots, token_budget, token_buckets)
    layout = program_layout(config, num_slots, max_context, num_pages)
    kv = jax.eval_shape(lambda: init_cache_layers(config, num_slots, layout["num_pages"]))
    step = jitted_step(config)
    params = narrowed_weights(params, read_weight_dtypes(step, params, kv, num_slots, layout["pages_per_seq"]))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for size in buckets:
        exported = jax.export.export(step)(*step_argument_specs(params, kv, num_slots, size, layout["pages_per_seq"]))
        (out / f"step_t{size}.jaxexport").write_bytes(exported.serialize())
    leaves = jax.tree.leaves(params)
    np.savez(out / "params.npz", **{f"leaf_{i:05d}": np.asarray(leaf) for i, leaf in enumerate(leaves)})
    description = tokenizer.describe() if hasattr(tokenizer, "describe") else None
    manifest = dict(
        format_version=FORMAT_VERSION,
        token_buckets=list(buckets),
        **layout,
        tokenizer=description,
        eos_ids=list(eos_ids_of(eos_id)),
        shares_prefixes=shares_prefixes(config),
    )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def load_artifact(directory: str | Path) -> tuple[DeviceProgram, Any, tuple[int, ...]]:
    """``(program, tokenizer or None, eos_ids)`` from an artifact directory; every step is
    compiled (with the cache donated) before this returns."""
    directory = Path(directory)
    manifest_file = directory / "manifest.json"
    if not manifest_file.is_file():
        raise PathNotFoundError(f"no manifest.json in {directory}: not an 'ember export' artifact")
    manifest = _read_part(manifest_file, lambda path: json.loads(path.read_text()))
    if not isinstance(manifest, dict):
        raise DataError(f"{manifest_file} holds a JSON {type(manifest).__name__}, not the object 'ember export' writes")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise DataError(
            f"artifact format {manifest.get('format_version')!r} of {directory} is not one of the supported "
            f"{', '.join(map(str, READABLE_VERSIONS))}: export it again with this version of Ember"
        )
    eos_key = "eos_id" if manifest["format_version"] == 2 else "eos_ids"
    missing = [key for key in ("token_buckets", "tokenizer", eos_key, *LAYOUT_FIELDS) if key not in manifest]
    if missing:
        raise DataError(f"{manifest_file} lacks {', '.join(missing)}: export the artifact again")
    exported = {
        size: _read_part(
            directory / f"step_t{size}.jaxexport", lambda path: jax.export.deserialize(bytearray(path.read_bytes()))
        )
        for size in manifest["token_buckets"]
    }
    first = exported[manifest["token_buckets"][0]]
    args_tree = jax.tree_util.treedef_children(first.in_tree)[0]
    params_tree, kv_tree, _, _ = jax.tree_util.treedef_children(args_tree)
    param_avals = first.in_avals[: params_tree.num_leaves]
    leaves = _read_part(directory / "params.npz", lambda path: _read_leaves(path, param_avals))
    params = jax.tree_util.tree_unflatten(params_tree, jax.device_put(leaves))  # placed, not compiled per leaf
    kv_avals = first.in_avals[params_tree.num_leaves : params_tree.num_leaves + kv_tree.num_leaves]
    kv = empty_cache(jax.tree_util.tree_unflatten(kv_tree, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in kv_avals]))
    steps = {}
    for size, function in exported.items():
        specs = jax.tree_util.tree_unflatten(
            args_tree, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in function.in_avals]
        )
        steps[size] = jax.jit(function.call, donate_argnums=1).lower(*specs).compile()
    layout = {name: manifest[name] for name in LAYOUT_FIELDS}
    # An artifact written before prefix caching does not say: its pages are not shared.
    program = DeviceProgram(
        steps=steps, params=params, kv=kv, shares_prefixes=bool(manifest.get("shares_prefixes")), **layout
    )
    tokenizer = tokenizer_from_description(manifest["tokenizer"]) if manifest["tokenizer"] else None
    eos_ids = eos_ids_of(manifest[eos_key])
    return program, tokenizer, eos_ids


def _read_part(path: Path, read: Any) -> Any:
    """``read(path)`` for a file of an artifact; ``PathNotFoundError`` if it is missing and
    ``DataError`` naming it if its parser fails on it (a torn copy, another export's file)."""
    if not path.is_file():
        raise PathNotFoundError(f"{path} is missing: the artifact is incomplete; export it again")
    try:
        return read(path)
    except Exception as error:  # whatever json, numpy's zip reader or jax.export raise on bad bytes
        raise DataError(
            f"{path} is not a readable part of an 'ember export' artifact ({type(error).__name__}: {error}); "
            "export it again"
        ) from None


def _read_leaves(path: Path, avals: Sequence[Any]) -> list[np.ndarray]:
    """The parameter leaves in ``params.npz`` (NumPy), checked against the shapes the steps take."""
    leaves = []
    with np.load(path) as stored:
        for i, aval in enumerate(avals):
            # npz keeps dtypes numpy lacks (float8: a quantized model's scales) as raw bytes: view them back.
            leaf = stored[f"leaf_{i:05d}"].view(aval.dtype)
            if leaf.shape != aval.shape:
                raise ValueError(f"leaf_{i:05d} has shape {leaf.shape}; the exported steps take {aval.shape}")
            leaves.append(leaf)
    return leaves


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="an Ember LM run directory or a Hugging Face model directory")
    parser.add_argument("out_dir", help="directory to write the artifact to")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step of a run directory (default: latest)")
    parser.add_argument("--num-slots", type=int, default=8, help="requests served at once")
    parser.add_argument("--token-budget", type=int, default=64, help="most tokens per step (decodes + prefill chunks)")
    parser.add_argument("--max-context", type=int, default=None, help="longest sequence (default: the model's)")


def run(args: argparse.Namespace) -> int:
    from ember.serving.cli import check_engine_options, engine_options_named
    from ember.serving.loading import load_model, weights_fit_model

    check_engine_options(args)
    loaded = load_model(args.source, step=args.step)
    with engine_options_named(), weights_fit_model(args.source):
        out = export_program(
            loaded.config,
            loaded.params,
            args.out_dir,
            tokenizer=loaded.tokenizer,
            eos_id=loaded.eos_ids,
            num_slots=args.num_slots,
            token_budget=args.token_budget,
            max_context=args.max_context,
        )
    buckets = resolve_token_buckets(args.num_slots, args.token_budget)
    print(f"wrote {out} (token buckets {', '.join(map(str, buckets))})")
    return 0


__all__ = ["FORMAT_VERSION", "add_arguments", "export_program", "load_artifact", "run"]

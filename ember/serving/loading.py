"""Finds the model to serve at a path: an Ember LM run directory or a Hugging Face directory.

- Ember fine-tuning or GRPO run (``kind: finetune`` / ``grpo``): the base model's config and tokenizer, and the
  run's checkpointed weights (LoRA adapters applied unmerged, MixLoRA experts, or all weights).
- Ember linearising run (``kind: linearize``, ``ember linearize``; its ``attention_transfer/``
  stage too): the base model's config made linear (its ``linear:`` section) and tokenizer, and
  the run's checkpointed weights (stage 2's LoRA adapters applied unmerged).
- Ember run directory: ``config.yaml`` whose ``model:`` section is a ``ModelConfig`` and
  ``checkpoints/`` (``ember.core.checkpoint``) whose state has a ``params`` entry. Only the
  params and the model state (a trained MoE's balancing bias: ``ember.models.variables``)
  are read (never the optimizer state), in whichever layer layout they were saved and
  converted to the config's ``scan_layers``; the tokenizer is Ember's byte tokenizer.
  ``LoadedModel.params`` are the weights serving applies (``serving_weights``).
- Quantized model (``kind: quantized``, written by ``ember quantize``): a run directory whose
  checkpointed params hold packed quantized weights (they stay packed on the device), with
  the source's Hugging Face tokenizer's files when it read text with one.
- Hugging Face directory: ``config.json`` + safetensors, read by ``ember.models.hf``; its
  tokenizer is its ``tokenizer.json`` (``ember.core.hf_tokenizer``), when it has one.

On a GPU every model is loaded with its layers unrolled unless the caller sets
``scan_layers`` (:func:`serving_overrides`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import flax.errors
import jax
from jax.sharding import Mesh

from ember.core.checkpoint import CheckpointManager
from ember.core.config import load_config, read_key, run_kind
from ember.core.errors import ConfigError, DataError, PathNotFoundError
from ember.core.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from ember.core.tokenizer import ByteTokenizer
from ember.core.tree import param_paths
from ember.models.config import ModelConfig, runtime_overrides
from ember.models.layer_layout import saved_layout
from ember.models.linearize import LinearizeConfig, linearized_config
from ember.models.quantization.stored import stored_weight_paths
from ember.models.variables import serving_weights
from ember.serving.model_program import weight_shardings
from ember.serving.program import narrowed_weights
from ember.serving.scheduler import eos_ids_of


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: Any
    """The weights serving applies: the param tree, or with model state ``{"params", <state>}``."""
    tokenizer: Any
    eos_ids: tuple[int, ...]
    """The end-of-sequence ids (any ends a request): a Hugging Face ``config.json`` may list several."""


def load_model(
    path: str | Path,
    *,
    step: int | None = None,
    mesh: Mesh | None = None,
    host: bool = False,
    **config_overrides: Any,
) -> LoadedModel:
    """The model at ``path`` (see the module docstring); ``step`` picks an Ember checkpoint
    (default the latest); ``config_overrides`` replace ``ModelConfig`` fields.

    Where the weights go: by default whole onto the default device. ``mesh``: the mesh the model
    will be served on (``ember.serving.mesh``): each weight goes straight into the shards it is
    served in (an Ember checkpoint's restored into them, a Hugging Face tensor placed from the
    host), so no device holds a weight the mesh splits. ``host``: NumPy arrays, no device touched,
    for a caller that places them itself (a trainer on its mesh).

    Raises:
      PathNotFoundError: ``path`` holds no model, or not checkpoint ``step``.
      ConfigError: its config is invalid (or names an architecture Ember does not support), or
        ``step`` is given for a Hugging Face directory (which has no checkpoint steps).
      ValueError: both ``mesh`` and ``host``.
    """
    if mesh is not None and host:
        raise ValueError(
            "load_model takes a mesh to place the weights on or host=True to keep them on the host, not both"
        )
    path = Path(path)
    config_overrides = {**serving_overrides(), **config_overrides}
    if (path / "config.json").is_file():
        if step is not None:
            raise ConfigError(
                f"{path} is a Hugging Face model directory, which has no checkpoint steps: step {step} "
                "(--step, base_model.step) applies to an Ember run directory's checkpoints",
                key="step",
            )
        return _load_hf(path, config_overrides, mesh, host)
    if (path / "config.yaml").is_file():
        return _load_run(path, step, config_overrides, mesh, host)
    raise PathNotFoundError(
        f"{path} is neither an Ember run directory (config.yaml + checkpoints/) nor a Hugging Face "
        "model directory (config.json + safetensors)"
    )


def _load_run(
    path: Path, step: int | None, config_overrides: dict[str, Any], mesh: Mesh | None, host: bool
) -> LoadedModel:
    kind = run_kind(path)
    if kind in ("finetune", "grpo", "linearize"):
        return _load_finetune_run(path, step, config_overrides, mesh, host, linearized=kind == "linearize")
    section = read_key(path / "config.yaml", "model")
    if section is None:
        raise ConfigError(f"{path / 'config.yaml'} has no model: section", key="model")
    try:
        config = dataclasses.replace(load_config(ModelConfig, section), **config_overrides)
    except ConfigError as error:  # keyed within the section: name it as the run's config.yaml does
        raise ConfigError(f"{path / 'config.yaml'}, model.{error}", key=f"model.{error.key}") from None
    params, model_state = restore_weights(path, step, config, mesh, host=host)
    params = in_param_dtype(params, config)
    if kind == "quantized" and read_key(path / "config.yaml", "tokenizer") == "hf":
        tokenizer = _hf_tokenizer(path)
        # "eos_id" (one id) in directories written before "eos_ids"
        eos_ids = read_key(path / "config.yaml", "eos_ids", default=read_key(path / "config.yaml", "eos_id"))
    else:
        tokenizer = ByteTokenizer()
        eos_ids = tokenizer.eos_id
    return LoadedModel(config, serving_weights(params, model_state), tokenizer, eos_ids_of(eos_ids))


WEIGHT_MISMATCH = (
    flax.errors.ScopeParamNotFoundError,
    flax.errors.ScopeParamShapeError,
    flax.errors.ScopeCollectionNotFound,
    flax.errors.ScopeVariableNotFoundError,
)
"""Flax's errors for weights that are not the ones a model reads (other Flax errors are Ember's bugs)."""


@contextlib.contextmanager
def weights_fit_model(path: str | Path) -> Iterator[None]:
    """Runs the building of a model's steps; Flax's error for weights that do not fit the
    model (a parameter missing, or of another shape: a run's config.yaml edited after its
    checkpoint was saved) becomes a ``DataError`` naming ``path``."""
    try:
        yield
    except WEIGHT_MISMATCH as error:
        first_line = str(error).splitlines()[0]
        raise DataError(f"the weights in {path} do not fit the model its config describes: {first_line}") from None


def serving_overrides() -> dict[str, Any]:
    """The ``ModelConfig`` fields :func:`load_model` sets unless its caller does: on a GPU,
    ``scan_layers=False``; elsewhere none (the saved layout).

    Compiled for an H100 (``python -m benchmarks.deviceless_compile``), a decode step with
    scanned layers did work the unrolled one did not, every step. With int8 or int4 weights,
    XLA copied each layer's packed weights out of the stacked parameter for the quantized
    matmul, a custom call (XLA's own dot reads its slice in place): a read and a write of
    every weight besides the kernel's read. With float weights, it transposed the stacked
    q, k and v kernels of all layers. Unrolled layers cost compile time (each layer is
    compiled, where a scan compiles one). On CPU, XLA ran the int8 step 6-7x slower unrolled.
    """
    return {"scan_layers": False} if jax.default_backend() == "gpu" else {}


def _load_finetune_run(
    path: Path,
    step: int | None,
    config_overrides: dict[str, Any],
    mesh: Mesh | None,
    host: bool,
    *,
    linearized: bool = False,
) -> LoadedModel:
    """A ``kind: finetune`` (or ``grpo``, or with ``linearized`` ``linearize``) run: the base
    model's config (``base_model:`` of its config.yaml; linearised by its ``linear:`` section)
    and tokenizer, the run's own checkpointed weights (adapters included, applied unmerged)."""
    base = read_key(path / "config.yaml", "base_model") or {}
    if "path" not in base:
        raise ConfigError(f"{path / 'config.yaml'} has no base_model.path", key="base_model.path")
    base_step = base.get("step", -1)
    loaded = load_model(
        base["path"],
        step=None if base_step is None or base_step < 0 else base_step,
        mesh=mesh,
        host=host,
        **{**runtime_overrides({"scan_layers": True, **base}), **config_overrides},
    )
    config = loaded.config
    if linearized:
        config = linearized_config(config, load_config(LinearizeConfig, read_key(path / "config.yaml", "linear") or {}))
    params, model_state = restore_weights(path, step, config, mesh, host=host)
    return LoadedModel(config, serving_weights(params, model_state), loaded.tokenizer, loaded.eos_ids)


def restore_weights(
    path: Path, step: int | None, config: ModelConfig, mesh: Mesh | None = None, *, host: bool = False
) -> tuple[Any, Any]:
    """``(params, model state)`` of checkpoint ``step`` of the run in ``path``, in ``config``'s layer
    layout; with ``mesh``, each array read straight into its shards (``sharded_targets``); with
    ``host``, as NumPy arrays."""
    try:
        if not (path / "checkpoints").is_dir():  # nothing to open (opening would create it)
            raise PathNotFoundError(f"no complete checkpoint in {path / 'checkpoints'}")
        with CheckpointManager(path / "checkpoints", read_only=True) as manager:  # the run may be training
            saved = manager.state_metadata(step)
            targets = sharded_targets(saved, config, mesh) if mesh is not None and "params" in saved else {}
            params = manager.restore_part("params", step, target=targets.get("params"), host=host)
            has_state = "model_state" in saved
            model_state = (
                manager.restore_part("model_state", step, target=targets.get("model_state"), host=host)
                if has_state
                else {}
            )
    except KeyError as error:
        raise DataError(error.args[0]) from None
    layout = saved_layout(config, params)
    if layout is not None:
        _, convert = layout
        params, model_state = convert((params, model_state))
    return params, model_state


def sharded_targets(saved: Any, config: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """``{"params", "model_state"}`` restore targets for a checkpoint's ``saved`` metadata: the
    saved shapes and dtypes in the shardings a program on ``mesh`` serves them in
    (``ember.serving.model_program.weight_shardings``, in the saved layer layout), so no device
    holds a whole weight the mesh splits."""
    shapes = {
        part: jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), saved[part])
        for part in ("params", "model_state")
        if part in saved
    }
    layout = saved_layout(config, shapes["params"])
    saved_config = config if layout is None else layout[0]
    weights = serving_weights(shapes["params"], shapes.get("model_state"))
    shardings = weight_shardings(saved_config, weights, mesh)
    placed = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), weights, shardings
    )
    if "model_state" not in shapes:
        return {"params": placed}
    return {
        "params": placed["params"],
        "model_state": {name: tree for name, tree in placed.items() if name != "params"},
    }


def in_param_dtype(params: Any, config: ModelConfig) -> Any:
    """``params`` with every float weight in ``config``'s parameter dtype (``precision``'s
    ``params``), as ``DecoderLM(config).init`` gives them: a run trained with float32 master
    weights loaded with ``precision=pure_bf16`` (a fine-tuning run's ``base_model.precision``)
    holds bfloat16 weights. Stored quantized weights' parts are kept as they are. Converted by
    ``narrowed_weights`` (which also widens): in one program, not one per weight shape."""
    flat, dtype = param_paths(params), config.policy.param_dtype
    quantized = tuple(f"{path}/" for path in stored_weight_paths(flat))
    return narrowed_weights(params, {path: dtype for path in flat if not path.startswith(quantized)})


def _load_hf(path: Path, config_overrides: dict[str, Any], mesh: Mesh | None, host: bool) -> LoadedModel:
    from ember.models import hf

    config, params = hf.load(path, **config_overrides)  # NumPy, read tensor by tensor
    if mesh is not None:
        params = jax.device_put(params, weight_shardings(config, params, mesh))
    elif not host:
        params = jax.device_put(params)  # jnp.asarray would compile a program per leaf shape
    return LoadedModel(config, params, _hf_tokenizer(path), _hf_eos_ids(path))


def _hf_eos_ids(path: Path) -> tuple[int, ...]:
    """The ids that end generation, as ``transformers``' ``generate`` takes them: from
    ``generation_config.json`` where it names them (chat models often list their end-of-turn
    tokens only there), else from ``config.json``; each file holds one id or a list."""
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file() and (eos := json.loads(file.read_text()).get("eos_token_id")) is not None:
            return eos_ids_of(eos)
    return ()


def _hf_tokenizer(path: Path) -> HFTokenizer | None:
    return load_hf_tokenizer(path) if (path / "tokenizer.json").is_file() else None


__all__ = [
    "LoadedModel",
    "in_param_dtype",
    "load_model",
    "restore_weights",
    "serving_overrides",
    "sharded_targets",
    "weights_fit_model",
]

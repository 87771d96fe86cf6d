"""Reading and writing Hugging Face checkpoint directories (``config.json`` + safetensors).

Reading never holds the checkpoint in memory beside its conversion: each tensor is read from its
memory-mapped file when it is converted, and scanned layers are stacked on the host layer by
layer (``ember.models.layer_layout.layers_from_list``): loading takes about the model's own size in
host memory and touches no device (``ember.serving.loading`` places the NumPy arrays: on one
device, into their shards on a mesh, or nowhere for a trainer, which places them itself).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ember.core.errors import DataError, PathNotFoundError
from ember.models.config import ModelConfig
from ember.models.hf.config_map import config_from_hf, config_to_hf
from ember.models.hf.gemma import MULTIMODAL_GEMMA3, Gemma3TextTensors
from ember.models.hf.weights import params_from_hf, params_to_hf

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def load(path: str | Path, *, dtype: Any = None, **config_overrides: Any) -> tuple[ModelConfig, dict[str, Any]]:
    """``(config, params)`` from a Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Gemma / Gemma 2 /
    Gemma 3 / Mixtral / Qwen2-MoE / Qwen3-MoE / Mamba-2 directory (of a multimodal Gemma 3, its
    language model's).

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` or a sharded
        ``model.safetensors.index.json`` + shards.
      dtype: dtype of the returned (numpy) parameters; default the config's parameter dtype
        (``precision``'s ``params``: float32 unless ``precision="pure_bf16"`` or ``params=...``),
        the dtype ``DecoderLM(config).init`` gives them.
      config_overrides: ``ModelConfig`` fields to set (``precision="bf16"``,
        ``scan_layers=False``, ``attention_impl=...``).

    Raises:
      PathNotFoundError (a ``FileNotFoundError``): no config.json or no safetensors weights (or a shard).
      ConfigError, DataError (``ValueError``s): an unsupported architecture or config field; a missing tensor;
        a truncated safetensors file, an unreadable index or config.json.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise PathNotFoundError(f"no config.json in {path}")
    try:
        hf_config = json.loads(config_file.read_text())
    except ValueError as error:  # not UTF-8, or not JSON
        raise DataError(f"{config_file} is not JSON ({error})") from None
    if not isinstance(hf_config, dict):
        raise DataError(f"{config_file} is not a JSON object")
    config = config_from_hf(hf_config, **config_overrides)
    dtype = config.policy.param_dtype if dtype is None else dtype
    model_type = hf_config["model_type"]
    with open_state(path) as state:
        if model_type == MULTIMODAL_GEMMA3:
            state, model_type = Gemma3TextTensors(state), "gemma3_text"
        return config, params_from_hf(config, state, dtype=dtype, model_type=model_type)


def save(
    path: str | Path, config: ModelConfig, params: dict[str, Any], *, model_type: str = "llama", dtype: Any = None
) -> None:
    """Writes ``config.json`` and ``model.safetensors`` (one file) loadable by
    ``transformers`` ``AutoModelForCausalLM.from_pretrained(path)`` and by :func:`load`.

    ``model_type``: one of :data:`~ember.models.hf.SUPPORTED_MODEL_TYPES` (``llama``, ``mistral``,
    ``qwen2``, ``qwen3``, ``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``mamba2``) that can express
    ``config`` (a QK-norm model is ``qwen3`` or ``qwen3_moe``).
    """
    path = Path(path)
    hf_config = config_to_hf(config, model_type)
    path.mkdir(parents=True, exist_ok=True)
    state = params_to_hf(config, params, dtype=dtype, model_type=model_type)
    hf_config["torch_dtype"] = str(next(iter(state.values())).dtype)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(state, str(path / SINGLE_FILE), metadata={"format": "pt"})


def read_state(path: Path) -> dict[str, np.ndarray]:
    """All tensors of the checkpoint in ``path`` (see :func:`open_state`), read into memory."""
    with open_state(path) as state:
        return dict(state)


@contextlib.contextmanager
def open_state(path: Path) -> Iterator[Mapping[str, np.ndarray]]:
    """The tensors of the checkpoint in ``path`` by name (single file or sharded with an index;
    the single file first where both are there, as ``transformers`` reads them), each read from
    its memory-mapped file when it is looked up: a caller that converts one tensor at a time
    holds one tensor at a time, not the whole checkpoint beside its own copy."""
    if (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    elif (index := path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [path / shard for shard in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or no {"weight_map": {name: shard}}
            raise DataError(f"{index} is not a safetensors index (a JSON object with a 'weight_map')") from None
    else:
        raise PathNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    with contextlib.ExitStack() as stack:
        handles = {}
        for file in files:
            handle = stack.enter_context(_open_safetensors(file))
            handles.update(dict.fromkeys(handle.keys(), handle))
        yield _LazyState(handles)


class _LazyState(Mapping[str, np.ndarray]):
    """Tensor name -> array, read from its open safetensors file on each lookup."""

    def __init__(self, handles: dict[str, Any]):
        self._handles = handles

    def __getitem__(self, name: str) -> np.ndarray:
        return self._handles[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)


def _open_safetensors(file: Path) -> Any:
    if not file.is_file():
        raise PathNotFoundError(f"no {file.name} in {file.parent} (the checkpoint's index names it)")
    try:
        return safe_open(str(file), framework="numpy")
    except SafetensorError as error:  # a truncated or corrupt file (an interrupted download)
        raise DataError(f"{file} is not a complete safetensors file: {error}") from None

"""What a fine-tuning run leaves behind: the adapter in PEFT format and a merged checkpoint.

``run_dir/adapter/`` (LoRA runs, ``export.peft``): ``adapter_config.json`` +
``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained`` loads on the base.
``run_dir/merged/`` (``export.merged``): a Hugging Face checkpoint of the fine-tuned weights
(adapters folded in), with the base's tokenizer files copied beside it (an Ember base's
tokenizer written from the loaded one, Ember's byte tokenizer as a byte-level ``tokenizer.json``,
its end-of-sequence ids into ``config.json``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from ember.core.errors import ConfigError
from ember.core.hf_tokenizer import CHAT_TEMPLATE_FILE, HFTokenizer
from ember.core.sharding import addressable_here
from ember.core.tokenizer import ByteTokenizer
from ember.models import hf
from ember.models.adapters import merged_weights
from ember.models.config import ModelConfig
from ember.models.hf.gemma import MULTIMODAL_GEMMA3
from ember.models.hf.peft import save_peft_adapter
from ember.serving.loading import LoadedModel
from ember.training.finetune.config import MODEL_TYPES, FinetuneConfig

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    CHAT_TEMPLATE_FILE,
)
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_hook(task: Any) -> Callable[[Any], None]:
    """The end-of-run hook of a ``FinetuneTask``: writes the exports its config asks for and
    records their paths in the run summary (``exports``)."""

    def export(info) -> None:
        config, run_dir = task.config, info.trainer.run_dir
        params = jax.device_get(addressable_here(info.state.params))  # sharded over processes: gathered
        if not info.trainer.is_main:
            return
        written = {}
        if config.exports_peft:
            save_peft_adapter(run_dir / "adapter", task.model_config, params, base_model=config.base_model.path)
            written["adapter"] = str(run_dir / "adapter")
        if config.export.merged:
            weights = merged_weights(params) if config.method == "lora" else params
            hf.save(run_dir / "merged", task.model_config, weights, model_type=merged_model_type(config))
            _copy_tokenizer(task.base, Path(config.base_model.path), run_dir / "merged")
            written["merged"] = str(run_dir / "merged")
        info.trainer.results["exports"] = written

    return export


def _copy_tokenizer(base: LoadedModel, path: Path, merged: Path) -> None:
    """The base's tokenizer and special token ids beside the merged weights: a Hugging Face base
    directory's files, copied; an Ember run's (an LM run, or a fine-tuning run fine-tuned again,
    which hold no tokenizer files) written from its loaded tokenizer (Ember's byte tokenizer as
    ``ByteTokenizer.hf_files``) and end-of-sequence ids.
    The ids go into the merged ``config.json``, which ``hf.save`` writes without them:
    ``transformers`` would take its class defaults instead (Llama's ``eos_token_id`` 2) and
    ``ember generate`` no end-of-sequence id."""
    if (path / "config.json").is_file():
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (path / name).is_file():
                shutil.copy(path / name, merged / name)
        base_config = json.loads((path / "config.json").read_text())
        ids = {key: base_config[key] for key in TOKEN_ID_FIELDS if key in base_config}
    else:
        ids = {}
        if isinstance(base.tokenizer, HFTokenizer):
            description = base.tokenizer.describe()
            (merged / "tokenizer.json").write_text(description["tokenizer_json"])
            (merged / "tokenizer_config.json").write_text(json.dumps(description["config"], indent=2) + "\n")
            ids = {"bos_token_id": base.tokenizer.bos_id} if base.tokenizer.bos_id is not None else {}
        elif isinstance(base.tokenizer, ByteTokenizer):
            for name, text in base.tokenizer.hf_files().items():
                (merged / name).write_text(text)
        if base.eos_ids:
            ids["eos_token_id"] = base.eos_ids[0] if len(base.eos_ids) == 1 else list(base.eos_ids)
    merged_config = json.loads((merged / "config.json").read_text())
    (merged / "config.json").write_text(json.dumps({**merged_config, **ids}, indent=2) + "\n")


def merged_model_type(config: FinetuneConfig) -> str:
    """The ``model_type`` ``export.merged`` writes."""
    return config.export.model_type or base_model_type(Path(config.base_model.path))


def check_merged_export(config: FinetuneConfig, model_config: ModelConfig) -> None:
    """Raises ``ConfigError`` (keyed ``export.model_type``, or ``export.merged`` when it was
    chosen from the base) when ``export.merged`` cannot write ``model_config`` as its model type:
    said before training rather than by the export after it."""
    if not config.export.merged:
        return
    model_type = merged_model_type(config)
    try:
        hf.config_to_hf(model_config, model_type)
    except ConfigError as error:
        chosen = "export.model_type" if config.export.model_type else "export.merged"
        source = "" if config.export.model_type else " (the base's type; export.model_type picks another)"
        raise ConfigError(
            f"{chosen}: the fine-tuned model cannot be written as a Hugging Face {model_type} checkpoint"
            f"{source}: {error}; set export.merged false to keep the run's own checkpoint and adapter only",
            key=chosen,
        ) from None


def base_model_type(path: Path) -> str:
    """The ``model_type`` of a Hugging Face base directory when Ember can write it (a multimodal
    Gemma 3's as its language model's), else ``llama``."""
    config_file = path / "config.json"
    if config_file.is_file():
        model_type = json.loads(config_file.read_text()).get("model_type")
        if model_type == MULTIMODAL_GEMMA3:  # Ember loaded its language model alone
            return "gemma3_text"
        if model_type in MODEL_TYPES:
            return model_type
    return "llama"


__all__ = ["base_model_type", "check_merged_export", "export_hook", "merged_model_type"]

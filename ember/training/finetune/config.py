"""The fine-tuning experiment config (``kind: finetune`` for ``ember train``).

    kind: finetune
    run_dir: runs/my-lora
    base_model: {path: path/to/hf_model}     # or an Ember LM run directory
    data: {train: data/train.jsonl, eval: data/eval.jsonl}
    method: lora                              # lora | full
    adapter: {rank: 8, alpha: 16, targets: [q, k, v, o]}
    train: {steps: 200, batch_size: 8, seq_len: 256}
    optim: {name: adamw, lr: 2e-4}
    export: {merged: false}                   # peft: on for method lora unless false

The sections shared with ``kind: lm`` (train, optim, mesh, sharding, checkpoint, logging,
distributed) mean the same. Every section is a frozen dataclass, so a bad key or value
fails at load time with its key path. Paths (``base_model.path``, ``data.train``, ``data.eval``),
on the command line or in a YAML file, are relative to the current directory and stored
absolute (``ember.core.config.absolute_path``), so a run's saved config works from anywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import MISSING

from ember.core.config import absolute_path
from ember.core.distributed import DistributedConfig
from ember.core.errors import ConfigError
from ember.core.precision import Precision
from ember.core.sharding import MeshConfig
from ember.kernels_pallas.quantized_formats import FORMATS
from ember.models.adapters.lora import LoraConfig
from ember.models.adapters.mixlora import MixLoraConfig
from ember.models.config import RUNTIME_CHOICES, runtime_overrides
from ember.models.hf.config_map import SUPPORTED_MODEL_TYPES
from ember.models.quantization import QuantizeConfig
from ember.training.config import CheckpointConfig, LoggingConfig, changed_fields, warn_unused
from ember.training.lm.config import RUNTIME_KEYS, ShardingConfig, TrainLoopConfig, check_data_seed, run_identity
from ember.training.optimizers import OptimConfig

METHODS: tuple[str, ...] = ("lora", "mixlora", "full")
"""``lora``: train the ``adapter`` section's adapters, base frozen. ``mixlora``: MixLoRA experts
in every dense MLP (the ``mixlora`` section) plus the ``adapter`` section's LoRA on the
attention projections it names (the paper's setup), base frozen. ``full``: every weight."""
MIXLORA_LORA_TARGETS: tuple[str, ...] = ("q", "k", "v", "o")
"""The ``adapter.targets`` names method ``mixlora`` puts plain LoRA on (the attention projections)."""
BASE_MODEL_RUNTIME_KEYS: tuple[str, ...] = tuple(
    f"base_model.{k}" for k in ("attention_impl", "quantized_impl", "remat", "scan_layers")
)
"""``base_model`` settings a run may resume with changed (how the base runs, not what it is)."""
MODEL_TYPES: tuple[str, ...] = SUPPORTED_MODEL_TYPES
"""The Hugging Face ``model_type`` values ``export.merged`` writes (every one Ember reads)."""


@dataclasses.dataclass(frozen=True)
class BaseModelConfig:
    """The model to fine-tune: a Hugging Face directory (``config.json`` + safetensors, its
    tokenizer read from the same directory) or an Ember LM run directory (``step`` -1: the
    latest checkpoint). Empty ``attention_impl`` / ``quantized_impl`` / ``remat`` / ``precision``
    keep the base's; these and ``scan_layers`` are runtime settings (``quantized_impl``: the
    quantized matmul's, for a ``quantize``d base, one of ``QUANTIZED_IMPLS``). ``quantize``
    (int8 | int4 | nf4; empty: float) stores the frozen base's linear maps quantized while LoRA
    trains beside them (QLoRA with ``nf4``), an MoE base's routed experts included;
    ``quantize_group_size`` 0 keeps the format's default group."""

    path: str = MISSING
    step: int = -1
    attention_impl: str = ""
    quantized_impl: str = ""
    remat: str = ""
    precision: str = ""
    scan_layers: bool = True
    quantize: str = ""
    quantize_group_size: int = 0

    def __post_init__(self):
        if not self.path:
            message = "base_model.path must name a Hugging Face model or Ember run directory"
            raise ConfigError(message, key="base_model.path")
        # Checked here, not first when the loaded base's config is rebuilt with them (keyed without
        # base_model., after the base was read).
        for name, allowed in RUNTIME_CHOICES.items():
            value = getattr(self, name, "")
            if value and value not in allowed:
                message = f"base_model.{name} must be empty (the base's) or one of {', '.join(allowed)}, got {value!r}"
                raise ConfigError(message, key=f"base_model.{name}")
        if self.precision:
            try:
                Precision.from_string(self.precision)
            except ValueError as error:
                raise ConfigError(f"base_model.precision: {error}", key="base_model.precision") from None
        if self.quantize and self.quantize not in FORMATS:
            message = f"base_model.quantize must be empty or one of {', '.join(FORMATS)}, got {self.quantize!r}"
            raise ConfigError(message, key="base_model.quantize")
        if self.quantize_group_size and not self.quantize:  # it would do nothing: refuse it rather than ignore it
            raise ConfigError(
                f"base_model.quantize_group_size is {self.quantize_group_size} but base_model.quantize is empty "
                f"(a float base); set base_model.quantize to one of {', '.join(FORMATS)}",
                key="base_model.quantize_group_size",
            )
        self.quantization()
        object.__setattr__(self, "path", absolute_path(self.path))

    def quantization(self) -> QuantizeConfig | None:
        """How the frozen base is stored (None: in float)."""
        if not self.quantize:
            return None
        group = self.quantize_group_size or None
        try:
            return QuantizeConfig(format=self.quantize, group_size=group)
        except ConfigError as error:
            message = f"base_model.{error}".replace("quantize.group_size", "quantize_group_size")
            raise ConfigError(message, key="base_model.quantize_group_size") from None

    def overrides(self) -> dict[str, Any]:
        """The ``ModelConfig`` fields these settings replace."""
        return runtime_overrides(dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class FinetuneDataConfig:
    """JSONL examples (``{"prompt", "completion"}`` or ``{"messages": [...]}``; the loss is on
    completion / assistant tokens only). Evaluation: the ``eval`` file, else a seeded
    ``eval_fraction`` of ``train``'s examples, at least one (0: no evaluation)."""

    train: str = MISSING
    eval: str = ""
    eval_fraction: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not self.train:
            raise ConfigError("data.train must name a JSONL file of examples", key="data.train")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(
                f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}", key="data.eval_fraction"
            )
        if self.eval and self.eval_fraction:
            raise ConfigError("set data.eval or data.eval_fraction, not both", key="data.eval_fraction")
        check_data_seed(self.seed)
        for name in ("train", "eval"):
            object.__setattr__(self, name, absolute_path(getattr(self, name)))


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """What the run leaves in ``run_dir`` at the end: ``adapter/`` in PEFT format (``peft``,
    method lora only; unset: on for method lora) and ``merged/``, a Hugging Face checkpoint of
    the fine-tuned weights (``merged``, LoRA and full runs; ``model_type`` empty: the base's
    own, else ``llama``). Every run also serves from its own directory
    (``ember generate --checkpoint RUN_DIR``)."""

    peft: bool | None = None
    merged: bool = False
    model_type: str = ""

    def __post_init__(self):
        if self.model_type and self.model_type not in MODEL_TYPES:
            raise ConfigError(
                f"export.model_type must be one of {', '.join(MODEL_TYPES)}, got {self.model_type!r}",
                key="export.model_type",
            )


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    kind: str = "finetune"
    run_dir: str = "runs/finetune"
    seed: int = 0
    base_model: BaseModelConfig = dataclasses.field(default_factory=BaseModelConfig)
    data: FinetuneDataConfig = dataclasses.field(default_factory=FinetuneDataConfig)
    method: str = "lora"
    adapter: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    mixlora: MixLoraConfig = dataclasses.field(default_factory=MixLoraConfig)
    train: TrainLoopConfig = dataclasses.field(default_factory=TrainLoopConfig)
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=2e-4, weight_decay=0.0))
    export: ExportConfig = dataclasses.field(default_factory=ExportConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def __post_init__(self):
        if self.kind != "finetune":
            raise ConfigError(f"kind must be 'finetune' for a fine-tuning config, got {self.kind!r}", key="kind")
        if self.method not in METHODS:
            raise ConfigError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}", key="method")
        if self.base_model.quantize:
            if self.method != "lora" or self.adapter.dora:
                raise ConfigError(
                    "base_model.quantize: a quantized base trains LoRA adapters beside it (method lora, "
                    f"adapter.dora false), got method {self.method!r}" + (" with DoRA" if self.adapter.dora else ""),
                    key="base_model.quantize",
                )
            if self.export.merged:
                raise ConfigError(
                    "export.merged: a quantized base does not merge with its adapters; export the PEFT "
                    "adapter and merge it into the float base",
                    key="export.merged",
                )
        if self.export.peft and self.method != "lora":
            raise ConfigError(
                f"export.peft writes a LoRA adapter in PEFT format, for method lora only; method {self.method} has "
                "none (full: every weight trains, export.merged writes them; mixlora: its routed experts have no PEFT "
                "format, the run serves from run_dir): set export.peft false or leave it unset",
                key="export.peft",
            )
        if self.method == "mixlora":
            others = [t for t in self.adapter.targets if t not in MIXLORA_LORA_TARGETS]
            if others:  # the task keeps the attention names only: these would be dropped without a word
                raise ConfigError(
                    f"adapter.targets {others} with method mixlora: its plain LoRA goes on the attention projections "
                    f"named {', '.join(MIXLORA_LORA_TARGETS)} (MLP matrices get MixLoRA experts, mixlora.targets)",
                    key="adapter.targets",
                )
            if self.adapter.init == "lora_ga":
                raise ConfigError(
                    "adapter.init lora_ga initialises the adapters of method lora only; method mixlora's attention "
                    "adapters take lora, gaussian or pissa",
                    key="adapter.init",
                )
            if self.export.merged:
                raise ConfigError(
                    "export.merged: MixLoRA's routed experts do not merge into one model", key="export.merged"
                )
            missing = [n for n in ("load_balance", "router_z") if n not in self.train.aux_loss_weights]
            if missing:
                raise ConfigError(
                    f"method mixlora sows the router losses {', '.join(missing)}: give them weights in "
                    "train.aux_loss_weights (MixLoRA uses load_balance 0.01, router_z 0 logs it)",
                    key="train.aux_loss_weights",
                )

        self._warn_unused_keys()

    @property
    def exports_peft(self) -> bool:
        """Whether the run writes ``run_dir/adapter/`` in PEFT format (``export.peft``, unset: on)."""
        return self.method == "lora" and self.export.peft is not False

    def _warn_unused_keys(self) -> None:
        """Warns, naming the keys, of settings the run never reads (``warn_unused``)."""
        unused = []
        if self.method == "full":
            unused += [f"adapter.{name}" for name in changed_fields(self.adapter, LoraConfig())]
        if self.method != "mixlora":
            unused += [f"mixlora.{name}" for name in changed_fields(self.mixlora, MixLoraConfig())]
        if self.method != "full" and self.adapter.init != "lora_ga":
            ga = {"ga_batches", "ga_gamma"} & set(changed_fields(self.adapter, LoraConfig()))
            unused += [f"adapter.{name} (read by adapter.init lora_ga only)" for name in sorted(ga)]
        if self.export.model_type and not self.export.merged:
            unused.append("export.model_type (read by export.merged only)")
        warn_unused(f"method {self.method}", unused)

    def identity(self) -> dict[str, Any]:
        """The flattened keys that define the run (what must not change on resume)."""
        runtime = (*RUNTIME_KEYS, "export", *BASE_MODEL_RUNTIME_KEYS)
        return run_identity({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, runtime)


__all__ = [
    "BASE_MODEL_RUNTIME_KEYS",
    "METHODS",
    "MIXLORA_LORA_TARGETS",
    "BaseModelConfig",
    "ExportConfig",
    "FinetuneConfig",
    "FinetuneDataConfig",
]

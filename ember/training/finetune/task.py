"""Fine-tuning a pretrained decoder LM as a trainer task: LoRA-family adapters or every
weight, on JSONL examples with the loss on completion tokens only.

    task = FinetuneTask(config)                 # config: FinetuneConfig
    Trainer(task, loop=config.train, ...).train()

The base model comes from a Hugging Face directory or an Ember LM run (``ember.serving.
load_model``: weights, config and the base's own tokenizer). Its weights are the task's
:meth:`pretrained` variables, given logical axes from the model's own ``init`` so they
shard as a fresh model would; ``init_variables`` adds the adapters (LoRA-GA: from the mean
gradient of the first ``adapter.ga_batches`` training batches, computed inside the jitted
initialisation). With ``method: lora`` only the adapters train (``adapter_mask``): the
optimizer state is adapter-sized and the base is never written.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ember.core.errors import ConfigError, DataError
from ember.core.sharding import unbox
from ember.core.tree import param_paths, tree_from_paths
from ember.models.adapters import adapter_mask, add_lora, add_mixlora, target_paths
from ember.models.adapters.lora_ga import lora_ga_init
from ember.models.decoder import DecoderLM
from ember.models.flops import flops_per_token
from ember.models.hf.peft import check_peft_exportable
from ember.models.quantization import quantize_params
from ember.models.variables import as_variables, split_variables
from ember.serving.loading import LoadedModel
from ember.training.data.instructions import InstructionBatches, cut_counts, read_instructions
from ember.training.finetune.base import boxed_variables, load_base, restore_base_layout
from ember.training.finetune.config import FinetuneConfig
from ember.training.finetune.export import check_merged_export, export_hook
from ember.training.lm.task import BATCH_AXES, lm_loss
from ember.training.task import Task


class FinetuneTask(Task):
    """The ``finetune`` kind's task. ``base``: an already loaded base model (default: the one
    ``config.base_model`` names)."""

    batch_axes = BATCH_AXES
    count_name = "tokens"

    def __init__(self, config: FinetuneConfig, base: LoadedModel | None = None):
        self.config = config
        self.base = base or load_base(config.base_model)
        self.model_config = self.base.config
        self.model = DecoderLM(self.model_config)
        if config.train.seq_len > self.model_config.max_seq_len:  # as kind lm and linearize refuse it
            raise ConfigError(
                f"train.seq_len ({config.train.seq_len}) exceeds the base model's max_seq_len "
                f"({self.model_config.max_seq_len})",
                key="train.seq_len",
            )
        self.base_params, self.base_state = split_variables(as_variables(self.base.params))
        if config.method != "full":  # bad targets fail now, not inside the jitted initialisation
            adapted = self._adapted(self.base_params, jax.random.key(0), shapes_only=True)
            if config.exports_peft:  # ...nor in the export after training
                try:
                    check_peft_exportable(self.model_config, adapted)
                except DataError as error:
                    raise ConfigError(
                        f"export.peft: {error}; set export.peft false (export.merged still folds them in) or "
                        "leave those weights out of adapter.targets",
                        key="export.peft",
                    ) from None
        self._check_quantization()
        check_merged_export(config, self.model_config)
        self.examples, self.eval_examples = read_instructions(
            config.data.train,
            self.base.tokenizer,
            eval_path=config.data.eval or None,
            eval_fraction=config.data.eval_fraction,
            seed=config.data.seed,
        )
        self._check_lengths()

    def _check_lengths(self) -> None:
        """Examples longer than ``train.seq_len + 1`` tokens are cut to their start: said with a
        count (a warning), and a ``ConfigError`` when no training example keeps a trained token."""
        seq_len = self.config.train.seq_len
        for name, examples in (("data.train", self.examples), ("data.eval", self.eval_examples)):
            cut, emptied = cut_counts(examples, seq_len)
            if name == "data.train" and emptied and not any(e.trained[1 : seq_len + 1].any() for e in examples):
                raise ConfigError(
                    f"train.seq_len {seq_len}: every example of data.train is cut to its first {seq_len + 1} tokens "
                    "before any completion token, so nothing would train; raise train.seq_len",
                    key="train.seq_len",
                )
            if cut:
                warnings.warn(
                    f"{name}: {cut} of {len(examples)} examples are longer than train.seq_len + 1 = {seq_len + 1} "
                    f"tokens and are cut to their start; {emptied} of them keep no completion token and add "
                    "nothing to the loss",
                    stacklevel=3,
                )

    # ---------------------------------------------------------------- variables and masks
    def pretrained(self) -> dict[str, Any]:
        """The base weights (and model state), plus LoRA-GA's gradient batches."""
        weights = {"params": self.base_params, "state": self.base_state}
        if self.config.method == "lora" and self.config.adapter.init == "lora_ga":
            # Whole global batches, the same on every process: the initialisation takes them as
            # one replicated argument (a process's own rows would give each process other adapters).
            batches = self._batches(self.examples, shuffle=True, whole=True)
            stacked = [batches.next() for _ in range(self.config.adapter.ga_batches)]
            weights["ga_batches"] = jax.tree.map(lambda *xs: np.stack(xs), *stacked)
        return weights

    def init_variables(self, rng: jax.Array, pretrained: Any = None) -> dict[str, Any]:
        if pretrained is None:
            raise ValueError("FinetuneTask starts from its pretrained() weights")
        variables = boxed_variables(self.model, self.config.train.seq_len, pretrained)
        params = variables.pop("params")
        state = variables
        if self.config.method != "full":
            params = self._adapted(params, rng)
            if "ga_batches" in pretrained:
                gradients = self._mean_target_gradients(params, state, pretrained["ga_batches"])
                params = lora_ga_init(params, gradients, gamma=self.config.adapter.ga_gamma)
        quantization = self.config.base_model.quantization()
        if quantization is not None:  # QLoRA: adapters first (their init may read the float base)
            params = quantize_params(params, quantization)
        return {"params": params, **state}

    def _check_quantization(self) -> None:
        """A base that cannot be stored as ``base_model.quantize`` says so before anything compiles."""
        quantization = self.config.base_model.quantization()
        if quantization is None:
            return
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), self.base_params)
        try:
            jax.eval_shape(lambda p: quantize_params(p, quantization), shapes)
        except ConfigError as error:
            fmt = self.config.base_model.quantize
            if error.key == "quantize.group_size":
                message = f"base_model.quantize {fmt}: {error}".replace("quantize.group_size", "quantize_group_size")
                raise ConfigError(message, key="base_model.quantize_group_size") from None
            raise ConfigError(f"base_model.quantize {fmt}: {error}", key="base_model.quantize") from None

    def _adapted(self, params: Any, rng: jax.Array, *, shapes_only: bool = False) -> Any:
        """``params`` with the method's adapters: LoRA, or MixLoRA experts plus LoRA on the
        attention projections ``adapter.targets`` names. ``shapes_only``: checks the targets
        against abstract params (errors before anything compiles)."""
        if shapes_only:
            params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), params)
            return jax.eval_shape(lambda p: self._adapted(p, rng), params)
        config = self.config
        if config.method == "lora":
            return add_lora(params, config.adapter, rng)
        params = add_mixlora(params, config.mixlora, jax.random.fold_in(rng, 1))
        return add_lora(params, config.adapter, rng)  # the attention projections (FinetuneConfig checks)

    def _mean_target_gradients(self, params: Any, state: Any, batches: Any) -> dict[str, Any]:
        """LoRA-GA: the mean over ``batches`` (stacked ``[n, batch, seq]``) of the loss gradient
        of every adapted weight, at the base weights."""
        unboxed, base_state = param_paths(unbox(params)), unbox(state)
        targets = target_paths(unboxed, self.config.adapter)

        def loss(chosen, batch):
            terms = lm_loss(tree_from_paths({**unboxed, **chosen}), batch, model=self.model, model_state=base_state)
            return terms.loss_sum / jnp.maximum(terms.count, 1.0)

        chosen = {p: unboxed[p] for p in targets}
        grads = jax.lax.map(lambda batch: jax.grad(loss)(chosen, batch), batches)
        return tree_from_paths({p: jnp.mean(g, axis=0) for p, g in grads.items()})

    def trainable(self, params: Any) -> Any | None:
        return None if self.config.method == "full" else adapter_mask(params)

    # ---------------------------------------------------------------- loss and data
    def loss(
        self,
        params: Any,
        batch: dict[str, jax.Array],
        *,
        rng: jax.Array,
        teacher: Any,
        model_state: Any = None,
        step: Any = None,
    ) -> Any:
        """The completion tokens' next-token loss. Adapter dropout (``adapter.dropout``) applies
        in training steps only (``step`` given, as the train step does; evaluation passes none)."""
        dropout = step is not None and self.config.method != "full" and self.config.adapter.dropout > 0
        return lm_loss(params, batch, model=self.model, model_state=model_state, dropout_rng=rng if dropout else None)

    def _batches(self, examples, *, shuffle: bool, whole: bool = False) -> InstructionBatches:
        """This process's rows of each global batch (``whole``: every row)."""
        return InstructionBatches(
            examples,
            seq_len=self.config.train.seq_len,
            global_batch=self.config.train.batch_size,
            seed=self.config.data.seed,
            shuffle=shuffle,
            process_index=0 if whole else jax.process_index(),
            process_count=1 if whole else jax.process_count(),
        )

    def train_data(self) -> InstructionBatches:
        return self._batches(self.examples, shuffle=True)

    def eval_data(self) -> Iterator[dict] | None:
        """Up to ``train.eval_batches`` batches of the evaluation examples, in order."""
        if not self.eval_examples or self.config.train.eval_batches == 0:
            return None
        return self._batches(self.eval_examples, shuffle=False).epoch(max_batches=self.config.train.eval_batches)

    def work_per_step(self) -> dict[str, float]:
        tokens = self.config.train.batch_size * self.config.train.seq_len
        return {"tokens": tokens, "flops": flops_per_token(self.model_config, self.config.train.seq_len) * tokens}

    def add_hooks(self, trainer) -> None:
        trainer.add_hook(export_hook(self), on_last=True)  # every process: gathering the weights is a collective

    def restore_layout(self, saved_params: Any) -> tuple[Task, Any] | None:
        """A checkpoint written with the other ``base_model.scan_layers`` (a runtime setting) is
        read in its own layout, by this task over the base converted to it, and converted back,
        optimizer moments included (as ``LMTask.restore_layout``)."""
        return restore_base_layout(self.base, saved_params, lambda base: FinetuneTask(self.config, base))


__all__ = ["FinetuneTask"]

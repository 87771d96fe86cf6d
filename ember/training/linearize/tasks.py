"""The two trainer tasks of linearising (LoLCATs), on the LM batches of ``config.data``:

- :class:`AttentionTransferTask` (stage 1): the linearised model in attention-transfer mode,
  the teacher's weights frozen, only the new parameters (feature maps, window mix) trained on
  the sum over layers of each layer's output MSE against its softmax attention.
- :class:`LowRankTask` (stage 2): the stage-1 model plus LoRA adapters (the only trained
  parameters) on the next-token loss, optionally plus KL to the teacher's predictions.

Both are ``LMTask``s over a model built from the linearised config, so the data, validation
and throughput figures are the LM's own.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ember.core.errors import ConfigError
from ember.core.sharding import box_like, unbox
from ember.core.tree import map_paths, param_paths
from ember.models.adapters import adapter_mask, add_lora
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.layers.window_linear_attention import TRANSFER_LOSS
from ember.models.linearize import is_new_parameter, linearized_config, linearized_params
from ember.models.variables import as_variables, split_variables
from ember.serving.loading import LoadedModel
from ember.training.data import TokenDataset
from ember.training.finetune.base import boxed_variables
from ember.training.linearize.config import LinearizeRunConfig
from ember.training.linearize.evaluate import real_tokens
from ember.training.lm.config import LMConfig, SampleConfig
from ember.training.lm.task import LMTask
from ember.training.task import LossTerms, apply_model, next_token_kl, next_token_loss


class _LinearizeStage(LMTask):
    """An ``LMTask`` over ``model_config`` with the stage's loop (the config's ``section``,
    ``transfer.train`` or ``train``); the teacher is ``base``.

    Raises:
      ConfigError: the loop's ``seq_len`` exceeds the base model's ``max_seq_len`` (keyed in
        ``section``: the LM config's own check would name ``train.seq_len`` for either stage).
    """

    def __init__(
        self, config: LinearizeRunConfig, section: str, model_config: ModelConfig, base: LoadedModel,
        dataset: TokenDataset,
    ):  # fmt: skip
        loop = config.transfer.train if section == "transfer.train" else config.train
        if loop.seq_len > model_config.max_seq_len:
            raise ConfigError(
                f"{section}.seq_len ({loop.seq_len}) exceeds the base model's max_seq_len ({model_config.max_seq_len})",
                key=f"{section}.seq_len",
            )
        lm = LMConfig(run_dir=config.run_dir, seed=config.seed, model=model_config, data=config.data, train=loop,
                      sample=SampleConfig(prompts=()))  # fmt: skip
        super().__init__(lm, dataset)
        self.batch_key = f"{section}.batch_size"
        self.run_config = config
        self.base_params, self.base_state = split_variables(as_variables(base.params))

    def restore_layout(self, saved_params: Any) -> None:
        return None  # base_model.scan_layers is part of the run's identity: a checkpoint keeps its layout


class AttentionTransferTask(_LinearizeStage):
    """Stage 1. The loss is the sum over layers of each layer's mean error over the batch's
    real tokens, weighted by those tokens (``LossTerms.count``): a validation pass whose last
    batch is padded gives the mean over its real tokens, as the run summary's figures do."""

    count_name = "tokens"

    def __init__(self, config: LinearizeRunConfig, base: LoadedModel, dataset: TokenDataset):
        model_config = linearized_config(base.config, config.linear, attention_transfer=True)
        super().__init__(config, "transfer.train", model_config, base, dataset)

    def pretrained(self) -> dict[str, Any]:
        return {"params": self.base_params, "state": self.base_state}

    def init_variables(self, rng: jax.Array, pretrained: Any = None) -> dict[str, Any]:
        """The linearised model's ``init`` with every weight the teacher has taken from it."""
        fresh = super().init_variables(rng)
        state = {name: box_like(value, fresh[name]) for name, value in pretrained["state"].items()}
        return {"params": linearized_params(pretrained["params"], fresh["params"]), **state}

    def trainable(self, params: Any) -> Any:
        """The parameters linearising adds: those the teacher lacks (a ``linear`` layer's own
        feature maps, also named ``q_features``/``k_features``, are the teacher's and stay frozen)."""
        teacher = param_paths(unbox(self.base_params))
        return map_paths(lambda path, _: is_new_parameter(path) and path not in teacher, params)

    def loss(self, params, batch, *, rng, teacher, model_state=None, **_: Any) -> LossTerms:
        outputs = apply_model(
            self.model, params, batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
            model_state=model_state,
        )  # fmt: skip
        # The frozen base's own auxiliary losses (MoE balance) train nothing here.
        tokens = real_tokens(batch)
        return LossTerms(outputs.aux[TRANSFER_LOSS] * tokens, tokens, {}, outputs.metrics, outputs.model_state)


class LowRankTask(_LinearizeStage):
    """Stage 2, from ``transferred``: the stage-1 model's params (host arrays), given here or
    set once stage 1 has run (before training)."""

    def __init__(self, config: LinearizeRunConfig, base: LoadedModel, dataset: TokenDataset, transferred: Any = None):
        super().__init__(config, "train", linearized_config(base.config, config.linear), base, dataset)
        self.transferred = transferred
        self.teacher_model = DecoderLM(base.config) if config.distill.weight else None

    def pretrained(self) -> dict[str, Any]:
        return {"params": self.transferred, "state": self.base_state}

    def init_variables(self, rng: jax.Array, pretrained: Any = None) -> dict[str, Any]:
        variables = boxed_variables(self.model, self.config.train.seq_len, pretrained)
        variables["params"] = add_lora(variables["params"], self.run_config.adapter, rng)
        return variables

    def trainable(self, params: Any) -> Any:
        return adapter_mask(params)

    def teacher_params(self) -> Any | None:
        if self.teacher_model is None:
            return None
        teacher = {"params": self.base_params, "state": self.base_state}
        return boxed_variables(self.teacher_model, self.config.train.seq_len, teacher)

    def loss(self, params, batch, *, rng, teacher, model_state=None, step=None) -> LossTerms:
        """The next-token loss; in training steps (``step`` given) plus the distillation term and
        with ``adapter.dropout``, so validation reports the plain next-token loss."""
        inputs = dict(positions=batch["positions"], segment_ids=batch["segment_ids"])
        dropout = {"rngs": {"dropout": rng}} if step is not None and self.run_config.adapter.dropout else {}
        outputs = apply_model(self.model, params, batch["tokens"], model_state=model_state, **inputs, **dropout)
        logits, _ = outputs.output
        loss_sum, count = next_token_loss(logits, batch["targets"], batch["loss_mask"])
        metrics = dict(outputs.metrics)
        if teacher is not None and step is not None:
            distill = self.run_config.distill
            teacher_logits, _ = self.teacher_model.apply(teacher, batch["tokens"], **inputs)
            kl = next_token_kl(logits, teacher_logits, batch["loss_mask"], distill.temperature)
            metrics["distill_kl"] = kl / jnp.maximum(count, 1.0)
            loss_sum = loss_sum + distill.weight * kl
        return LossTerms(loss_sum, count, outputs.aux, metrics, outputs.model_state)


__all__ = ["AttentionTransferTask", "LowRankTask"]

"""Pretraining the decoder LM as a trainer task: ``DecoderLM``, next-token cross-entropy (plus
any auxiliary losses the model sows), packed token batches, validation, end-of-run samples.

    task = LMTask(config)                       # config: LMConfig
    Trainer(task, loop=config.train, ...).train()
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ember.core.errors import ConfigError
from ember.core.sharding import addressable_here
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.flops import flops_per_token
from ember.models.layer_layout import saved_layout
from ember.models.variables import serving_weights
from ember.training.data import PackedBatches, TokenDataset
from ember.training.lm.config import BUILTIN_DATASETS, LMConfig
from ember.training.lm.sampling import encode_prompts, sample_text
from ember.training.quantization.qat import qat_params
from ember.training.task import LossTerms, Task, apply_model, next_token_loss

BATCH_AXES = ("batch", "seq")
"""Every LM batch leaf is ``[batch, seq_len]``: ``tokens``, ``targets``, ``segment_ids``,
``positions`` (int32) and ``loss_mask`` (float32)."""


def lm_loss(
    params: Any,
    batch: dict[str, jax.Array],
    *,
    model: DecoderLM,
    model_state: Any = None,
    dropout_rng: jax.Array | None = None,
    **_: Any,
) -> LossTerms:
    """Next-token cross-entropy of a packed batch (sum and token count) plus the auxiliary
    losses and metrics the model sows, and its updated ``model_state`` (when it has one);
    ignores the trainer's ``rng`` and ``teacher``. ``dropout_rng`` turns on adapter dropout."""
    outputs = apply_model(
        model,
        params,
        batch["tokens"],
        positions=batch["positions"],
        segment_ids=batch["segment_ids"],
        model_state=model_state,
        **({"rngs": {"dropout": dropout_rng}} if dropout_rng is not None else {}),
    )
    logits, _ = outputs.output
    loss_sum, count = next_token_loss(logits, batch["targets"], batch["loss_mask"])
    return LossTerms(loss_sum, count, outputs.aux, outputs.metrics, outputs.model_state)


class LMTask(Task):
    """The ``lm`` kind's task. ``dataset`` defaults to the one ``config.data`` names."""

    batch_axes = BATCH_AXES
    count_name = "tokens"
    batch_key = "train.batch_size"
    """The config key of ``config.train.batch_size`` as the user wrote it (named in errors)."""

    def __init__(self, config: LMConfig, dataset: TokenDataset | None = None):
        self.config = config
        data = config.data
        prepare = BUILTIN_DATASETS.get(data.dataset, lambda _: Path(data.dataset))
        self.dataset = dataset or TokenDataset.open(prepare(data))
        if config.model.vocab_size < self.dataset.tokenizer.vocab_size:
            raise ConfigError(
                f"model.vocab_size ({config.model.vocab_size}) is smaller than the dataset's tokenizer "
                f"vocabulary ({self.dataset.tokenizer.vocab_size})",
                key="model.vocab_size",
            )
        # a sample prompt longer than the context fails now, not after training
        encode_prompts(config.sample.prompts, self.dataset.tokenizer, config.model.max_seq_len)
        self.model = DecoderLM(config.model)
        if config.qat.format:  # targets and group sizes that do not fit the model fail now, not in the step
            abstract = jax.eval_shape(self.init_params, jax.random.key(0))
            jax.eval_shape(lambda p: qat_params(p, config.qat, jnp.int32(0), config.train.steps), abstract)

    def init_variables(self, rng: jax.Array) -> dict[str, Any]:
        """What ``DecoderLM.init`` returns: the parameters and any state collections."""
        seq_len = self.config.train.seq_len
        tokens = jnp.zeros((1, seq_len), jnp.int32)
        return dict(self.model.init(rng, tokens, positions=jnp.arange(seq_len, dtype=jnp.int32)[None]))

    def init_params(self, rng: jax.Array) -> Any:
        return self.init_variables(rng)["params"]

    def loss(
        self,
        params: Any,
        batch: dict[str, jax.Array],
        *,
        rng: jax.Array,
        teacher: Any,
        model_state: Any = None,
        step: jax.Array | None = None,
    ) -> LossTerms:
        """The LM loss; with ``qat.format`` set, training steps (``step`` given) from the QAT
        phase on see the target weights fake-quantized (validation sees the float weights)."""
        if step is not None:
            params = qat_params(params, self.config.qat, step, self.config.train.steps)
        return lm_loss(params, batch, model=self.model, model_state=model_state)

    def _batches(self, stream, **kwargs) -> PackedBatches:
        return PackedBatches(
            stream,
            seq_len=self.config.train.seq_len,
            global_batch=self.config.train.batch_size,
            eos_id=self.dataset.tokenizer.eos_id,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            batch_key=self.batch_key,
            **kwargs,
        )

    def train_data(self) -> PackedBatches:
        return self._batches(self.dataset.train, seed=self.config.data.seed)

    def eval_data(self) -> Iterator[dict] | None:
        """Up to ``train.eval_batches`` validation batches, fixed and in order: one pass over
        the validation windows at most, so each counts once in the loss."""
        if self.config.train.eval_batches == 0:
            return None
        if len(self.dataset.val) <= self.config.train.seq_len:  # not one row: nothing to evaluate
            where = getattr(self.dataset, "directory", "the dataset")
            warnings.warn(
                f"the validation split of {where} holds {len(self.dataset.val)} tokens, fewer than "
                f"one row of train.seq_len {self.config.train.seq_len} + 1: this run logs no val_loss (prepare the "
                "text with a larger --val-fraction, or set train.eval_batches=0 to say so)",
                stacklevel=2,
            )
            return None
        return self._batches(self.dataset.val, shuffle=False).epoch(max_batches=self.config.train.eval_batches)

    def work_per_step(self) -> dict[str, float]:
        tokens = self.config.train.batch_size * self.config.train.seq_len
        return {"tokens": tokens, "flops": flops_per_token(self.config.model, self.config.train.seq_len) * tokens}

    def add_hooks(self, trainer) -> None:
        if self.config.sample.prompts:  # on every process: gathering the weights is a collective
            trainer.add_hook(self._sample, on_last=True)

    def _sample(self, info) -> None:
        """Continues ``sample.prompts`` with the final model (on the main process): ``samples.txt``
        and the summary. Weights sharded over several processes are gathered first (every
        process takes part), since the sampling engine runs on one device."""
        prompts = self.config.sample.prompts
        weights = serving_weights(info.state.params, info.state.model_state)
        weights = addressable_here(weights)
        if not info.trainer.is_main:
            return
        samples = sample_text(self.model, weights, self.dataset.tokenizer, self.config.sample)
        (info.trainer.run_dir / "samples.txt").write_text(
            "".join(f"--- {p!r}\n{p}{s}\n" for p, s in zip(prompts, samples))
        )
        info.trainer.results["samples"] = samples

    def restore_layout(self, saved_params: Any) -> tuple[Task, Any] | None:
        """A checkpoint written with the other ``scan_layers`` (a runtime setting) is read in
        its own layout and converted, optimizer moments included."""
        layout = saved_layout(self.config.model, saved_params)
        if layout is None:
            return None
        saved_model, convert = layout
        return _with_model(self, saved_model), convert


def _with_model(task: LMTask, model: ModelConfig) -> LMTask:
    """``task`` with another model config, sharing its dataset."""
    return LMTask(dataclasses.replace(task.config, model=model), task.dataset)


__all__ = ["BATCH_AXES", "LMTask", "lm_loss"]

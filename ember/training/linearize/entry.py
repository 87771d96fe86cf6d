"""The ``linearize`` kind: both stages of LoLCATs and the figures that judge them.

    summary = run(config)      # config: LinearizeRunConfig; also ``ember linearize`` / ``ember train``

1. The teacher and the *naive swap* (softmax attention replaced by the untrained linearised
   layers: identity feature maps, even mix) are evaluated on the stage-2 validation batches,
   with each layer's attention-transfer error.
2. Stage 1 (``run_dir/attention_transfer``): :class:`AttentionTransferTask`; the errors again.
3. Stage 2 (``run_dir``): :class:`LowRankTask` from the stage-1 weights; the final loss is the
   stage-2 trainer's last evaluation (the same batches).

``run_dir/summary.json`` adds to the stage-2 trainer's summary: ``teacher_val_loss``,
``swap_val_loss``, ``transfer_val_loss`` (after stage 1), ``linearized_val_loss``, ``gap_closed``
(the share of the swap's excess loss over the teacher that linearising removed: 1 is the
teacher's loss, above 1 better than the teacher; ``null``, with a printed line saying why, when
the swap is less than ``MIN_GAP`` nats worse than the teacher, a gap too small to take shares of),
``attention_mse_before``/``_after`` (per layer), ``parameters_total`` (the teacher's),
``parameters_trained`` (stage 1's plus stage 2's) and ``trained_fraction``, ``tokens`` (both
stages) and each stage's wall time. With ``resume``, a stage that ran its steps to the end is
not run again (a finished run returns its summary), and an unfinished one continues from its
last checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import jax

from ember.core.distributed import initialize_distributed
from ember.core.errors import ConfigError
from ember.core.files import write_text_atomic
from ember.core.sharding import addressable_here, logical_rules, make_mesh, shard_variables
from ember.core.tree import param_count
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.serving.loading import LoadedModel, restore_weights
from ember.training.data import TokenDataset, stdlib_corpus_dir
from ember.training.finetune.base import boxed_variables, load_base
from ember.training.linearize.config import TRANSFER_DIR, LinearizeRunConfig
from ember.training.linearize.evaluate import Evaluator
from ember.training.linearize.tasks import AttentionTransferTask, LowRankTask
from ember.training.lm.config import DataConfig
from ember.training.lm.trainer import check_resumable, make_trainer
from ember.training.trainable import select

CONFIG_SCHEMA = LinearizeRunConfig


BASELINE_KEYS = ("teacher_val_loss", "swap_val_loss", "attention_mse_before")
"""Figures measured before stage 1, kept in its summary (a resumed run does not measure them again)."""
MIN_GAP = 0.05
"""Nats by which the naive swap's validation loss must exceed the teacher's for ``gap_closed``
to be reported: below it the share divides by next to nothing (a random or barely trained
teacher, whose swap is about as good: a random Hugging Face Llama's read 545)."""


def run(config: LinearizeRunConfig, *, resume: bool = False) -> dict[str, Any]:
    """Linearises (or resumes linearising) ``config.base_model`` into ``config.run_dir``;
    returns the summary it writes (a stage stopped early returns that stage's summary)."""
    finished = _finished(Path(config.run_dir), config.train.steps) if resume else None
    if finished is not None and "linearized_val_loss" in finished:
        return finished
    initialize_distributed(config.distributed)  # before the base is loaded onto a device
    mesh = make_mesh(config.mesh)  # a mesh that does not fit the devices fails before the base is loaded
    stage_dir = Path(config.run_dir) / TRANSFER_DIR
    transfer_summary = _finished(stage_dir, config.transfer.train.steps) if resume else None
    if resume:  # so does a run directory this config cannot resume (make_trainer checks again, and warns)
        check_resumable(stage_dir, config.stage("transfer"), warn=False)  # finished too: its weights are reused
        check_resumable(Path(config.run_dir), config, warn=False)
    base = load_base(config.base_model)
    dataset = _dataset(config.data, base)
    transfer = AttentionTransferTask(config, base, dataset)
    low_rank = LowRankTask(config, base, dataset)
    if config.train.eval_batches and len(dataset.val) <= config.train.seq_len:  # not one row to compare on
        raise ConfigError(
            f"data.dataset: the validation split holds {len(dataset.val)} tokens, fewer than the "
            f"{config.train.seq_len + 1} of one row of train.seq_len {config.train.seq_len}: the summary compares "
            "validation losses (prepare the text with a larger --val-fraction, or shorten train.seq_len)",
            key="data.dataset",
        )
    batches = list(low_rank.eval_data() or ())
    if not batches:
        raise ConfigError(
            "train.eval_batches must be >= 1: the summary compares validation losses", key="train.eval_batches"
        )
    evaluator = Evaluator(batches, mesh, logical_rules(config.sharding.rules))
    linear_model = DecoderLM(low_rank.config.model)

    if transfer_summary is None:
        baseline = _baseline(config, base, transfer, linear_model, evaluator)
        transfer_summary, transferred = _train(
            make_trainer(config.stage("transfer"), resume=resume, task=transfer, mesh=mesh), extra=baseline
        )
        if transfer_summary["stopped_early"]:
            return transfer_summary
    else:
        transferred = _restore(stage_dir, transfer.model.config)
    figures = {key: transfer_summary[key] for key in BASELINE_KEYS}
    print("linearize: after transfer ...", flush=True)
    figures["attention_mse_after"] = evaluator.transfer_errors(transfer.model, transferred)
    figures["transfer_val_loss"] = evaluator.validation_loss(linear_model, transferred)

    low_rank.transferred = _host_params(transferred)
    summary, final = _train(make_trainer(config, resume=resume, task=low_rank, mesh=mesh))
    if summary["stopped_early"]:
        return summary
    figures["linearized_val_loss"] = summary["val_loss"]  # the trainer's last evaluation, on the same batches
    figures["gap_closed"] = gap_closed(figures["teacher_val_loss"], figures["swap_val_loss"], summary["val_loss"])
    if figures["gap_closed"] is None:
        print(
            f"linearize: gap_closed is null: the naive swap's validation loss ({figures['swap_val_loss']:.4f}) is "
            f"not {MIN_GAP} nats above the teacher's ({figures['teacher_val_loss']:.4f}), no gap to take a share of",
            flush=True,
        )
    figures.update(
        _costs(config, transfer, low_rank, transferred["params"], final["params"], transfer_summary, summary)
    )
    summary = {**summary, **figures}
    if jax.process_index() == 0:
        write_text_atomic(Path(config.run_dir) / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def gap_closed(teacher_loss: float, swap_loss: float, linearized_loss: float) -> float | None:
    """The share of the naive swap's excess validation loss over the teacher's that linearising
    removed, ``(swap - linearized) / (swap - teacher)`` (1: the teacher's loss; above 1: better
    than the teacher); ``None`` when the swap is less than ``MIN_GAP`` nats worse than the
    teacher (or the losses are not finite), where the share would measure next to nothing."""
    excess = swap_loss - teacher_loss
    if not excess >= MIN_GAP or not math.isfinite(excess) or not math.isfinite(linearized_loss):
        return None
    return (swap_loss - linearized_loss) / excess


def _baseline(config, base, transfer, linear_model, evaluator) -> dict[str, Any]:
    """The teacher's and the naive swap's validation losses and the swap's per-layer errors."""
    print("linearize: teacher and naive swap ...", flush=True)
    teacher_model = DecoderLM(base.config)
    seq_len = config.train.seq_len
    mesh, rules = evaluator.mesh, evaluator.rules
    teacher = shard_variables(boxed_variables(teacher_model, seq_len, transfer.pretrained()), mesh, rules)
    swap = jax.jit(transfer.init_variables)(jax.random.key(config.seed), transfer.pretrained())
    swap = shard_variables(swap, mesh, rules)
    return {
        "teacher_val_loss": evaluator.validation_loss(teacher_model, teacher),
        "swap_val_loss": evaluator.validation_loss(linear_model, swap),
        "attention_mse_before": evaluator.transfer_errors(transfer.model, swap),
    }


def _costs(config, transfer, low_rank, transfer_params, final_params, transfer_summary, summary) -> dict[str, Any]:
    """Parameters trained (each stage's trainable ones, against the teacher's total), tokens
    and wall seconds of both stages."""
    trained_transfer = param_count(select(transfer_params, transfer.trainable(transfer_params)))
    trained_low_rank = param_count(select(final_params, low_rank.trainable(final_params)))
    total = param_count(transfer.base_params)
    transfer_tokens = transfer_summary["steps"] * config.transfer.train.batch_size * config.transfer.train.seq_len
    low_rank_tokens = summary["steps"] * config.train.batch_size * config.train.seq_len
    return dict(
        parameters_total=total,
        parameters_trained_transfer=trained_transfer,
        parameters_trained_low_rank=trained_low_rank,
        parameters_trained=trained_transfer + trained_low_rank,
        trained_fraction=(trained_transfer + trained_low_rank) / total,
        tokens_transfer=transfer_tokens,
        tokens_low_rank=low_rank_tokens,
        tokens=transfer_tokens + low_rank_tokens,
        transfer_seconds=transfer_summary["wall_seconds"],
        low_rank_seconds=summary["wall_seconds"],
    )


def _dataset(data: DataConfig, base: LoadedModel) -> TokenDataset:
    """The LM text, tokenized with the base model's tokenizer (the stdlib corpus is prepared
    with it on first use; a prepared directory must have been).

    Raises:
      ConfigError: a prepared directory's tokenizer is not the base's (keyed ``data.dataset``).
    """
    if data.dataset == "stdlib":
        return TokenDataset.open(stdlib_corpus_dir(tokenizer=base.tokenizer))
    dataset = TokenDataset.open(Path(data.dataset))
    if dataset.tokenizer.describe() != base.tokenizer.describe():
        raise ConfigError(
            f"data.dataset {data.dataset} was tokenized with a {dataset.tokenizer.describe()['type']} tokenizer "
            "other than the base model's; prepare the text with it ('ember data prepare FILES --out DIR "
            "--tokenizer BASE_DIR') or use stdlib",
            key="data.dataset",
        )
    return dataset


def _train(trainer, extra: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Trains; returns the summary (with ``wall_seconds`` and ``extra``, also written to the
    run's summary.json) and the final variables, placed."""
    start = time.perf_counter()
    summary = trainer.train()
    summary.update(wall_seconds=time.perf_counter() - start, **(extra or {}))
    if trainer.is_main:
        write_text_atomic(trainer.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary, {"params": trainer.state.params, **trainer.state.model_state}


def _host_params(variables: dict[str, Any]) -> Any:
    """The params of a trainer's final ``variables`` as host arrays, whole on every process
    (sharded over several processes, e.g. by FSDP: gathered, a collective every process joins)."""
    return jax.device_get(addressable_here(variables["params"]))


def _finished(run_dir: Path, steps: int) -> dict[str, Any] | None:
    """The summary of a run in ``run_dir`` that trained its ``steps`` to the end, or None."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    return summary if not summary.get("stopped_early", True) and summary.get("steps", 0) >= steps else None


def _restore(run_dir: Path, config: ModelConfig) -> dict[str, Any]:
    """The variables of a finished stage's last checkpoint, as host arrays (restored, they sit
    committed to one device)."""
    params, state = restore_weights(run_dir, None, config)
    return jax.device_get({"params": params, **state})


__all__ = ["CONFIG_SCHEMA", "run"]

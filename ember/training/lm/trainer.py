"""The LM trainer: ``train(config)`` runs (or resumes) one run in ``config.run_dir``.

The run directory is the run's identity. It holds the resolved ``config.yaml``,
``metrics.jsonl`` (one JSON object per logged step), TensorBoard event files,
``checkpoints/`` and, at the end, ``summary.json`` and ``samples.txt``. A run killed at any
moment resumes (``resume=True``) from its last complete checkpoint and continues the same
trajectory: parameters, optimizer state, step and data position are all restored.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import signal
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
from tqdm import tqdm

from ember.core.checkpoint import CheckpointManager, abstract_with_shardings
from ember.core.config import ConfigError, from_yaml, to_dict, to_yaml
from ember.core.errors import EmberError
from ember.core.distributed import initialize_distributed
from ember.core.sharding import (
    host_local_to_global,
    logical_rules,
    make_mesh,
    named_sharding,
    tree_shardings,
    unbox,
    use_sharding,
)
from ember.core.system_info import peak_flops_per_device
from ember.models.decoder import DecoderLM
from ember.models.flops import flops_per_token
from ember.training.data import PackedBatches, TokenDataset, stdlib_corpus_dir
from ember.training.lm.config import LMConfig
from ember.training.lm.sampling import sample_text
from ember.training.lm.step import TrainState, eval_step, init_state, train_step
from ember.training.metrics import MetricsWriter
from ember.training.optimizers import make_optimizer, make_schedule

BATCH_AXES = ("batch", "seq")
RESUMABLE_CHANGES = frozenset({"train.steps", "train.log_every", "train.eval_every", "logging.progress",
                               "logging.tensorboard", "checkpoint.every", "checkpoint.keep", "sample"})


class NonFiniteLossError(EmberError, RuntimeError):
    """The loss or gradients became NaN/Inf and ``train.on_nan`` is ``stop``."""


@dataclasses.dataclass
class _Run:
    """What the loop needs, built once by :func:`_set_up`."""

    config: LMConfig
    run_dir: Path
    dataset: TokenDataset
    model: DecoderLM
    mesh: Any
    rules: Any
    train_step: Any
    eval_step: Any
    state: TrainState
    train_batches: PackedBatches
    manager: CheckpointManager
    is_main: bool


def train(config: LMConfig, *, resume: bool = False) -> dict[str, Any]:
    """Trains (or resumes) the run described by ``config``; returns the summary it writes.

    Raises:
      ConfigError: a bad config, or a run directory that conflicts with ``resume``.
      NonFiniteLossError: the loss went NaN/Inf with ``train.on_nan=stop``.
    """
    initialize_distributed(config.distributed)
    run = _set_up(config, resume)
    stop_requested = _StopFlag()
    writer = MetricsWriter(run.run_dir, tensorboard=config.logging.tensorboard, enabled=run.is_main)
    start_step = int(run.state.step)
    writer.truncate_after(start_step)
    tokens_per_step = config.train.batch_size * config.train.seq_len
    model_flops = flops_per_token(config.model, config.train.seq_len) * tokens_per_step
    peak = peak_flops_per_device()
    last_saved = start_step if run.manager.latest_step() == start_step else None
    state = run.state
    bar = tqdm(total=config.train.steps, initial=start_step, desc="train", unit="step",
               disable=not (run.is_main and config.logging.progress))
    # Throughput windows count training steps only: the first step (compilation), evaluation
    # and checkpoint saves restart the window.
    window_start, window_steps = None, 0
    last_metrics: dict[str, float] = {}
    try:
        with use_sharding(run.mesh, run.rules):
            for step in range(start_step, config.train.steps):
                batch = host_local_to_global(run.train_batches.next(), run.mesh, BATCH_AXES, run.rules)
                state, metrics = run.train_step(state, batch)
                window_steps += 1
                done = step + 1
                is_last = done == config.train.steps
                # One reading of the flag per step: a signal that lands later is honoured next step.
                stopping = stop_requested.is_set
                saving = done % config.checkpoint.every == 0 or is_last or stopping
                logging_now = done % config.train.log_every == 0 or saving
                evaluating = done % config.train.eval_every == 0 or is_last
                if logging_now:
                    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    if not values.pop("finite"):
                        if config.train.on_nan == "stop":
                            raise NonFiniteLossError(_nan_message(done, values, run.manager))
                        writer.event(done, "skipped non-finite step")
                    if window_start is not None:
                        elapsed = time.perf_counter() - window_start
                        values["tokens_per_second"] = tokens_per_step * window_steps / elapsed
                        if peak:
                            values["mfu"] = model_flops * window_steps / elapsed / (peak * jax.device_count())
                    writer.write(done, values)
                    last_metrics = values
                    bar.set_postfix(_postfix(values))
                if evaluating:
                    val_loss = _evaluate(run, state.params)
                    if val_loss is not None:
                        writer.write(done, {"val_loss": val_loss})
                        last_metrics["val_loss"] = val_loss
                if saving:
                    run.manager.save(done, state, extra={"data": run.train_batches.state()})
                    last_saved = done
                bar.update(1)
                if window_start is None or logging_now or evaluating:
                    jax.block_until_ready(state.step)
                    window_start, window_steps = time.perf_counter(), 0
                if stopping:
                    break
        run.manager.wait()
    finally:
        bar.close()
        stop_requested.restore()
        writer.close()
        run.manager.close()
    summary = {
        "run_dir": str(run.run_dir),
        "steps": int(state.step),
        "stopped_early": int(state.step) < config.train.steps,
        "last_checkpoint": last_saved,
        **{key: last_metrics[key] for key in ("loss", "val_loss", "tokens_per_second", "mfu") if key in last_metrics},
    }
    if run.is_main and not summary["stopped_early"] and config.sample.prompts:
        samples = sample_text(run.model, state.params, run.dataset.tokenizer, config.sample)
        (run.run_dir / "samples.txt").write_text("".join(f"--- {p!r}\n{p}{s}\n" for p, s in zip(config.sample.prompts, samples)))
        summary["samples"] = samples
    if run.is_main:
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _set_up(config: LMConfig, resume: bool) -> _Run:
    run_dir = Path(config.run_dir)
    manager_dir = run_dir / "checkpoints"
    has_checkpoints = manager_dir.is_dir() and any(p.name.isdigit() for p in manager_dir.iterdir())
    if has_checkpoints and not resume:
        raise ConfigError(f"run_dir {run_dir} already holds checkpoints; pass --resume to continue it, "
                          "or choose another run_dir", key="run_dir")
    if resume:
        _check_resumable(run_dir, config)
    is_main = jax.process_index() == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(config))

    dataset = TokenDataset.open(stdlib_corpus_dir() if config.data.dataset == "stdlib" else config.data.dataset)
    if config.model.vocab_size < dataset.tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size ({config.model.vocab_size}) is smaller than the dataset's tokenizer "
                          f"vocabulary ({dataset.tokenizer.vocab_size})", key="model.vocab_size")

    mesh = make_mesh(config.mesh)
    rules = logical_rules(config.sharding.rules)
    model = DecoderLM(config.model)
    tx = make_optimizer(config.optim, config.train.steps)
    schedule = make_schedule(config.optim, config.train.steps)
    make_state = functools.partial(init_state, model=model, tx=tx, seq_len=config.train.seq_len)

    # Initialisation needs no activation constraints: out_shardings place the state.
    rng = jax.random.key(config.seed)
    boxed = jax.eval_shape(make_state, rng)
    state_shardings = tree_shardings(mesh, nn.get_partition_spec(boxed), rules, shapes=boxed)
    abstract = unbox(boxed)
    batch_shardings = named_sharding(mesh, BATCH_AXES, rules, (config.train.batch_size, config.train.seq_len))
    step_fn = jax.jit(
        functools.partial(train_step, model=model, tx=tx, schedule=schedule, grad_accum=config.train.grad_accum,
                          skip_nonfinite=config.train.on_nan == "skip"),
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )
    eval_fn = jax.jit(functools.partial(eval_step, model=model), in_shardings=(state_shardings.params, batch_shardings))

    train_batches = PackedBatches(dataset.train, seq_len=config.train.seq_len, global_batch=config.train.batch_size,
                                  seed=config.data.seed, eos_id=dataset.tokenizer.eos_id,
                                  process_index=jax.process_index(), process_count=jax.process_count())
    manager = CheckpointManager(manager_dir, max_to_keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)
    if resume and manager.latest_step() is not None:
        restored = manager.restore(target=abstract_with_shardings(abstract, state_shardings))
        state = restored.state
        train_batches.restore(restored.extra["data"])
    else:
        state = jax.jit(lambda key: unbox(make_state(key)), out_shardings=state_shardings)(rng)
    return _Run(config, run_dir, dataset, model, mesh, rules, step_fn, eval_fn, state, train_batches, manager, is_main)


def _check_resumable(run_dir: Path, config: LMConfig) -> None:
    """A run directory's saved config may differ from ``config`` only in harmless keys."""
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        return
    saved = _flatten(to_dict(from_yaml(LMConfig, saved_path.read_text())))
    current = _flatten(to_dict(config))
    changed = sorted(k for k in saved.keys() | current.keys()
                     if saved.get(k) != current.get(k) and not any(k == r or k.startswith(r + ".") for r in RESUMABLE_CHANGES))
    if changed:
        raise ConfigError(f"run_dir {run_dir} was started with a different config; changed keys: {', '.join(changed)}. "
                          "Use a new run_dir, or change only train.steps / logging / checkpoint / sample settings",
                          key=changed[0])


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _evaluate(run: _Run, params: Any) -> float | None:
    """Mean token loss over the first ``eval_batches`` validation batches (fixed, in order)."""
    config = run.config
    if config.train.eval_batches == 0 or len(run.dataset.val) <= config.train.seq_len:
        return None
    batches = PackedBatches(run.dataset.val, seq_len=config.train.seq_len, global_batch=config.train.batch_size,
                            shuffle=False, eos_id=run.dataset.tokenizer.eos_id,
                            process_index=jax.process_index(), process_count=jax.process_count())
    total, count = 0.0, 0.0
    for _ in range(config.train.eval_batches):
        batch = host_local_to_global(batches.next(), run.mesh, BATCH_AXES, run.rules)
        loss_sum, tokens = jax.device_get(run.eval_step(params, batch))
        total, count = total + float(loss_sum), count + float(tokens)
    return total / max(count, 1.0)


def _nan_message(step: int, values: dict[str, float], manager: CheckpointManager) -> str:
    last = manager.latest_step()
    pointer = f"the last good checkpoint is step {last} in {manager.directory}" if last is not None else "no checkpoint was saved yet"
    return (f"non-finite loss at step {step} (loss={values['loss']}, grad_norm={values['grad_norm']}); {pointer}. "
            "Lower optim.lr, raise optim.schedule.warmup_steps, or set train.on_nan=skip to skip such steps.")


def _postfix(values: dict[str, float]) -> dict[str, str]:
    postfix = {"loss": f"{values['loss']:.3f}"}
    if "tokens_per_second" in values:
        postfix["tok/s"] = f"{values['tokens_per_second']:,.0f}"
    if "mfu" in values:
        postfix["mfu"] = f"{100 * values['mfu']:.1f}%"
    return postfix


class _StopFlag:
    """Turns SIGTERM/SIGINT into a request to checkpoint and stop after the current step."""

    def __init__(self):
        self.is_set = False
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, _frame):
        if self.is_set:  # a second signal: stop now
            raise KeyboardInterrupt
        self.is_set = True
        print(f"\nreceived {signal.Signals(signum).name}: saving a checkpoint after this step, then stopping")

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

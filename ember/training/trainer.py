"""The trainer every task runs through: a short loop plus hooks with an interval.

    trainer = Trainer(task, loop=LoopConfig(steps=1000), optim=OptimConfig(lr=3e-4),
                      run_dir="runs/x", mesh=make_mesh(MeshConfig(data=-1)))
    trainer.add_hook(lambda info: print(info.step), every=100)
    summary = trainer.train()

Each step runs the jitted :func:`ember.training.train_step.train_step` (explicit in/out
shardings from the logical rules, donated state). Periodic work is hooks: the trainer
registers logging (every ``log_every``; the only place metrics leave the device, and where
the NaN policy acts), evaluation, checkpointing (async; also on the last step and on
SIGTERM/SIGINT), then the task's own (``task.add_hooks``, e.g. LM samples), then yours.

The run directory holds ``metrics.jsonl`` (+ TensorBoard), ``checkpoints/`` and, at the end,
``summary.json``. With ``resume=True`` the run continues from its last complete
checkpoint: params, optimizer state, model state, step and data position, on whatever mesh
this process has. A run resumed with no steps left (killed after its final checkpoint) trains
nothing, runs the end-of-run hooks that follow the checkpoint and writes a complete summary.

Model state (non-gradient collections the model updates in its forward pass, see
``ember.models.variables``) lives in ``TrainState.model_state``: placed by its logical
annotations (replicated where it has none), checkpointed with the rest, read by evaluation.
Metrics the model sows (``LossTerms.metrics``) are logged with the step's own; a vector
``v`` of metric ``name`` is logged as scalars ``name/0``, ``name/1``, ... (``ember plot``
draws them in one panel).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from tqdm import tqdm

from ember.core.checkpoint import CheckpointManager, abstract_with_shardings
from ember.core.errors import ConfigError, DataError, EmberError
from ember.core.files import write_text_atomic
from ember.core.host_memory import reuse_freed_host_memory
from ember.core.sharding import (
    DEFAULT_RULES,
    drop_empty_boxes,
    host_local_to_global,
    make_mesh,
    named_sharding,
    tree_shardings,
    unbox,
    use_sharding,
)
from ember.core.system_info import peak_flops_per_device
from ember.core.tree import param_paths
from ember.training.config import CheckpointConfig, LoggingConfig, LoopConfig
from ember.training.loss_scaling import is_loss_scaled, uses_loss_scaling, with_dynamic_loss_scale
from ember.training.mesh_checks import (
    check_process_rows,
    idle_axes,
    idle_axes_message,
    replicated_rows_message,
    undivided_axes_message,
)
from ember.training.metrics import METRICS_FILE, MetricsWriter, read_metrics
from ember.training.optimizers import OptimConfig, make_optimizer, make_schedule
from ember.training.stop_request import StopRequest
from ember.training.task import Task
from ember.training.throughput import ThroughputWindow
from ember.training.train_step import TrainState, eval_step, init_state, train_step
from ember.training.trainable import select, trainable_mask

SUMMARY_METRICS = ("loss", "val_loss", "tokens_per_second", "mfu")
_SKIPPED = "skipped_since_log"
"""The checkpoint ``extra`` entry of the steps skipped (``train.on_nan=skip``) after the last log."""


class NonFiniteLossError(EmberError, RuntimeError):
    """The loss or gradients became NaN/Inf and ``train.on_nan`` is ``stop``."""


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a hook sees after step ``step`` (1-based count of steps done). ``metrics`` are
    still on the device: reading them synchronises, so only do it when you need them."""

    step: int
    state: TrainState
    metrics: dict[str, jax.Array]
    is_last: bool
    stopping: bool
    trainer: Trainer


@dataclasses.dataclass(frozen=True)
class Hook:
    """``fn(info)`` after every ``every``-th step (``None``: never periodically), and after
    the last step (``on_last``) or a step ending in a stop request (``on_stop``)."""

    fn: Callable[[StepInfo], None]
    every: int | None = None
    on_last: bool = False
    on_stop: bool = False

    def due(self, info: StepInfo) -> bool:
        return bool(
            (self.every and info.step % self.every == 0)
            or (self.on_last and info.is_last)
            or (self.on_stop and info.stopping)
        )


class Trainer:
    """Trains ``task`` (see the module docstring).

    Args:
      task: the model, loss, data, mask and teacher (``ember.training.task.Task``).
      loop, optim, checkpoint, logging: config sections (defaults when omitted).
      run_dir: where metrics, checkpoints and the summary go.
      mesh, rules: the device mesh and logical-axis rules (default: all devices data-parallel).
      seed: initialisation and per-step RNG (``fold_in(key(seed), step)``).
      resume: continue from the last checkpoint in ``run_dir`` (a fresh start if there is none).

    Raises:
      ConfigError: ``run_dir`` already holds checkpoints and ``resume`` is False.
    """

    def __init__(
        self,
        task: Task,
        *,
        loop: LoopConfig | None = None,
        optim: OptimConfig | None = None,
        checkpoint: CheckpointConfig | None = None,
        logging: LoggingConfig | None = None,
        run_dir: str | Path,
        mesh: Any = None,
        rules: Any = DEFAULT_RULES,
        seed: int = 0,
        resume: bool = False,
    ):
        self.task, self.seed = task, seed
        self.loop, self.optim = loop or LoopConfig(), optim or OptimConfig()
        self.checkpoint_config, self.logging = checkpoint or CheckpointConfig(), logging or LoggingConfig()
        self.run_dir, self.mesh, self.rules = Path(run_dir), mesh or make_mesh(), rules
        if self.mesh.devices.flat[0].platform == "cpu":
            reuse_freed_host_memory()  # each step's temporaries: one large block (ember.core.host_memory)
        self.is_main = jax.process_index() == 0
        self.tx = make_optimizer(self.optim, self.loop.steps)
        self.loss_scaled = uses_loss_scaling(self.loop.loss_scale, task.compute_dtype())
        if self.loss_scaled:
            self.tx = with_dynamic_loss_scale(self.tx)
        self.schedule = make_schedule(self.optim, self.loop.steps)
        boxed, self.state_shardings, self.mask = self._abstract_state(task)
        if self.loss_scaled:
            self._refuse_float16_params(boxed.params)
        self.data = task.train_data()
        self.teacher, teacher_shardings = self._place_teacher()
        self._step_fn = self._jit_step(teacher_shardings)
        self._warn_of_devices_computing_the_same(boxed.params, teacher_shardings)
        self._eval_fn = jax.jit(
            functools.partial(eval_step, loss_fn=task.loss),
            in_shardings=(self.state_shardings.params, self.state_shardings.model_state, None, teacher_shardings),
        )
        self.manager = CheckpointManager(
            self.run_dir / "checkpoints",
            max_to_keep=self.checkpoint_config.keep,
            async_save=self.checkpoint_config.async_save,
        )
        if self.manager.latest_step() is not None and not resume:
            self.manager.close()
            raise ConfigError(
                f"run_dir {self.run_dir} already holds checkpoints; pass --resume to continue it, "
                "or choose another run_dir",
                key="run_dir",
            )
        self._skipped: jax.Array | int | None = None  # skipped steps since the last log, on device
        self.state = self._restore(boxed) if resume and self.manager.latest_step() is not None else self._init(boxed)
        self.last_metrics: dict[str, float] = {}
        self.results: dict[str, Any] = {}
        self.last_saved = int(self.state.step) if self.manager.latest_step() == int(self.state.step) else None
        self._hooks: list[Hook] = []
        self._window = ThroughputWindow()
        self.add_hook(self._log, every=self.loop.log_every, on_last=True, on_stop=True)
        if task.eval_data() is not None:
            self.add_hook(self._evaluate_hook, every=self.loop.eval_every, on_last=True)
        self.add_hook(self._save, every=self.checkpoint_config.every, on_last=True, on_stop=True)
        task.add_hooks(self)

    # ----------------------------------------------------------------------------- set-up
    def _abstract_state(self, task: Task) -> tuple[TrainState, TrainState, Any]:
        """``(boxed abstract state, its shardings, trainable mask)`` for ``task``'s param layout."""
        init, args = self._initializer(task)
        abstract_params = jax.eval_shape(init, jax.random.key(self.seed), *args)["params"]
        mask = trainable_mask(abstract_params, freeze=self.loop.freeze, base=task.trainable(abstract_params))
        boxed = drop_empty_boxes(jax.eval_shape(self._state_maker(init, mask), jax.random.key(self.seed), *args))
        shardings = tree_shardings(self.mesh, nn.get_partition_spec(boxed), self.rules, shapes=boxed)
        return boxed, shardings, mask

    def _refuse_float16_params(self, params: Any) -> None:
        """Loss scaling unscales each gradient into the dtype of its parameter: a float16 one
        (``params=f16``) loses the small gradients the scale was there to keep, and the optimizer's
        moments underflow (PyTorch's ``GradScaler`` refuses float16 gradients for the same reason)."""
        trainable = param_paths(select(unbox(params), self.mask))
        half = [path for path, leaf in trainable.items() if np.dtype(leaf.dtype) == np.float16]
        if half:
            raise ConfigError(
                f"train.loss_scale={self.loop.loss_scale} needs float32 master weights, but {len(half)} trainable "
                f"parameter(s) are float16 ({half[0]} ...): their unscaled gradients would flush to zero and the "
                "optimizer's moments underflow; keep float32 parameters and compute in float16 (precision f16, "
                "or params=f32,compute=f16), or set train.loss_scale=off",
                key="train.loss_scale",
            )

    def _initializer(self, task: Task) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """``(init, args)``: ``init(rng, *args)`` gives ``task``'s fresh variables; a task's
        pretrained variables travel as an argument, so they are not compiled in as constants."""
        pretrained = task.pretrained()
        if pretrained is None:
            return task.init_variables, ()
        return (lambda rng, weights: task.init_variables(rng, weights)), (pretrained,)

    def _state_maker(self, init: Callable[..., Any], mask: Any) -> Callable[..., TrainState]:
        def make_state(rng, *args):
            return init_state(rng, init_variables=lambda key: init(key, *args), tx=self.tx, mask=mask)

        return make_state

    def _place_teacher(self) -> tuple[Any, Any]:
        params = self.task.teacher_params()
        if params is None:
            return None, None
        shardings = tree_shardings(self.mesh, nn.get_partition_spec(params), self.rules, shapes=params)
        return jax.device_put(unbox(params), shardings), shardings

    def _batch_shardings(self) -> Any:
        replicated = set()

        def one(leaf):
            global_shape = (leaf.shape[0] * jax.process_count(), *leaf.shape[1:])
            axes = (tuple(self.task.batch_axes) + (None,) * leaf.ndim)[: leaf.ndim]
            sharding = named_sharding(self.mesh, axes, self.rules, global_shape)
            check_process_rows(sharding, global_shape, leaf.shape[0], axes[0] if axes else None, self.rules)
            if axes and axes[0] is not None:
                # Each micro-batch (every grad_accum-th row) is what a device computes on at a time.
                accum = self.loop.grad_accum
                micro = (global_shape[0] // accum, *global_shape[1:])
                micro_sharding = named_sharding(self.mesh, axes, self.rules, micro)
                replicated.add(replicated_rows_message(micro_sharding, axes[0], micro[0], self.rules, accum))
            return sharding

        shardings = jax.tree.map(one, self._peek_batch())
        for message in sorted(replicated - {None}):
            if self.is_main:
                warnings.warn(message, stacklevel=4)  # at the caller of Trainer(...)
        return shardings

    def _peek_batch(self) -> Any:
        """One batch's shapes, without moving the data iterator (an iterator whose batches
        are costly to make, such as rollouts, says them with ``batch_spec()``)."""
        if hasattr(self.data, "batch_spec"):
            return self.data.batch_spec()
        position = self.data.state()
        batch = self.data.next()
        self.data.restore(position)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)

    def _jit_step(self, teacher_shardings: Any) -> Any:
        step = functools.partial(
            train_step,
            loss_fn=self.task.loss,
            tx=self.tx,
            schedule=self.schedule,
            mask=self.mask,
            aux_weights=self.loop.aux_loss_weights,
            grad_accum=self.loop.grad_accum,
            skip_nonfinite=self.loop.on_nan == "skip",
            seed=self.seed,
            count_name=self.task.count_name,
            batch_metrics=self.task.batch_metrics,
            finish_metrics=self.task.finish_metrics,
        )
        batch_shardings = self._batch_shardings()
        return jax.jit(
            step,
            in_shardings=(self.state_shardings, batch_shardings, teacher_shardings),
            out_shardings=(self.state_shardings, None),
            donate_argnums=0,
        )

    def _warn_of_devices_computing_the_same(self, params: Any, teacher_shardings: Any) -> None:
        """Warns of mesh axes that split nothing, and of those that do not divide some of the
        dimensions of ``params`` (boxed) the rules give them (``ember.training.mesh_checks``)."""
        if not self.is_main:
            return
        batch_axis = (tuple(self.task.batch_axes) or (None,))[0]
        idle = idle_axes(self.mesh, self.rules, batch_axis, self.state_shardings, teacher_shardings)
        for message in (
            idle_axes_message(self.mesh, self.rules, idle),
            undivided_axes_message(self.mesh, self.rules, params, skip=tuple(idle)),
        ):
            if message:
                warnings.warn(message, stacklevel=4)  # at the caller of Trainer(...)

    def _init(self, boxed: TrainState) -> TrainState:
        # Initialisation needs no activation constraints: out_shardings place the state.
        init, args = self._initializer(self.task)
        make_state = self._state_maker(init, self.mask)
        place = jax.jit(
            lambda key, *args: unbox(make_state(key, *args)),
            out_shardings=self.state_shardings,
            compiler_options=initialisation_compiler_options(self.mesh),
        )
        return place(jax.random.key(self.seed), *args)

    def _restore(self, boxed: TrainState) -> TrainState:
        """The last checkpoint placed on this mesh (converted when its param layout differs)."""
        metadata = self.manager.state_metadata()
        saved_scaled = is_loss_scaled(metadata["opt_state"])
        if saved_scaled != self.loss_scaled:
            saved = "dynamic" if saved_scaled else "off"
            self.manager.close()
            raise ConfigError(
                f"this run's checkpoints were saved with train.loss_scale={saved} and this run's loss scaling is "
                f"{'on' if self.loss_scaled else 'off'} (train.loss_scale={self.loop.loss_scale}, compute dtype "
                f"{self.task.compute_dtype().name}); resume with train.loss_scale={saved}",
                key="train.loss_scale",
            )
        layout = self.task.restore_layout(metadata["params"])
        if layout is None:
            restored = self._restore_onto(abstract_with_shardings(unbox(boxed), self.state_shardings))
            state = restored.state
        else:
            saved_task, convert = layout
            saved_boxed, saved_shardings, _ = self._abstract_state(saved_task)
            restored = self._restore_onto(abstract_with_shardings(unbox(saved_boxed), saved_shardings))
            state = jax.jit(convert, out_shardings=self.state_shardings)(restored.state)
        self.data.restore(restored.extra["data"])
        self._skipped = restored.extra.get(_SKIPPED) or None
        return state

    def _restore_onto(self, target: TrainState) -> Any:
        """The last checkpoint restored onto ``target``'s shapes and shardings.

        Raises:
          DataError: its tree or shapes are not ``target``'s (another model, trainable mask or
            optimizer): orbax's account in one line, where a traceback was.
        """
        try:
            return self.manager.restore(target=target)
        except ValueError as error:
            step, directory = self.manager.latest_step(), self.manager.directory
            self.manager.close()
            lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
            paths = [line.rstrip(":") for line in lines[1:] if line.endswith(":")][:3]  # where trees differ
            account = " ".join([lines[0].split(". Truncating")[0], ", ".join(paths)]).strip()
            raise DataError(
                f"the checkpoint at step {step} in {directory} does not restore "
                f"into this run's train state (another model, trainable mask or optimizer?): {account}"
            ) from None

    # ----------------------------------------------------------------------------- the loop
    def add_hook(
        self, fn: Callable[[StepInfo], None], every: int | None = None, *, on_last: bool = False, on_stop: bool = False
    ) -> None:
        """Runs ``fn(StepInfo)`` after every ``every``-th step (and see :class:`Hook`), after
        the hooks registered before it."""
        self._hooks.append(Hook(fn, every, on_last, on_stop))

    def train(self) -> dict[str, Any]:
        """Runs the remaining steps; returns (and, on the main process, writes) the summary."""
        start = int(self.state.step)
        self.writer = MetricsWriter(
            self.run_dir, tensorboard=self.logging.tensorboard, enabled=self.is_main, resume_step=start
        )
        stop = StopRequest(start)
        bar = tqdm(
            total=self.loop.steps,
            initial=start,
            desc="train",
            unit="step",
            disable=not (self.is_main and self.logging.progress),
        )
        try:
            for step in range(start, self.loop.steps):
                batch = host_local_to_global(self.data.next(), self.mesh, self.task.batch_axes, self.rules)
                # The mesh and rules are current only around the trainer's own programs: hooks
                # (samples through the serving engine, user callbacks) run without an ambient mesh.
                with use_sharding(self.mesh, self.rules):
                    self.state, metrics = self._step_fn(self.state, batch, self.teacher)
                if "skipped" in metrics:  # counted on device: no host sync between log steps
                    skipped = metrics["skipped"]
                    self._skipped = skipped if self._skipped is None else self._skipped + skipped
                # One reading of the flag per step: a signal that lands later is honoured next step.
                stopping = stop.stopping(step + 1)
                info = StepInfo(step + 1, self.state, metrics, step + 1 == self.loop.steps, stopping, self)
                self._window.count_step()
                due = [hook for hook in self._hooks if hook.due(info)]
                # Throughput counts training steps only: the first step's compile and the
                # hooks' time are left out (waiting for the device first, so a step still
                # running is not counted as the hooks').
                if due and self._window.is_open:
                    jax.block_until_ready(self.state.step)
                    self._window.hooks_start()
                for hook in due:
                    hook.fn(info)
                bar.update(1)
                bar.set_postfix(_postfix(self.last_metrics), refresh=False)
                if due or not self._window.is_open:
                    jax.block_until_ready(self.state.step)
                    if self._window.measured or not self._window.is_open:
                        self._window.open()  # a log measured the last window: the next one starts
                    else:
                        self._window.hooks_end()
                if info.stopping:
                    break
            if start >= self.loop.steps:
                self._finish_resumed(start)
            self.manager.wait()
        finally:
            bar.close()
            stop.restore()
            self.writer.close()
            self.manager.close()
        return self._write_summary()

    def _finish_resumed(self, step: int) -> None:
        """A run resumed with no steps left (stopped after its final checkpoint, before its
        summary): the summary takes the metrics logged up to ``step``, and the end-of-run hooks
        that come after the checkpoint (samples, yours) run; evaluation too when the log has no
        ``val_loss``. Nothing is logged or checkpointed again."""
        if (self.run_dir / METRICS_FILE).is_file():
            for record in read_metrics(self.run_dir):
                self.last_metrics.update({k: v for k, v in record.items() if k in SUMMARY_METRICS})
        done = {self._log, self._save} | ({self._evaluate_hook} if "val_loss" in self.last_metrics else set())
        info = StepInfo(step, self.state, {}, is_last=True, stopping=False, trainer=self)
        for hook in self._hooks:
            if hook.on_last and hook.fn not in done:
                hook.fn(info)

    def _write_summary(self) -> dict[str, Any]:
        steps = int(self.state.step)
        summary = {
            "run_dir": str(self.run_dir),
            "steps": steps,
            "stopped_early": steps < self.loop.steps,
            "last_checkpoint": self.last_saved,
            **{key: self.last_metrics[key] for key in SUMMARY_METRICS if key in self.last_metrics},
            **self.results,
        }
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    # ----------------------------------------------------------------------------- built-in hooks
    def _log(self, info: StepInfo) -> None:
        """Pulls the step's metrics to the host, applies the NaN policy, adds throughput, writes."""
        values = scalar_metrics(jax.device_get(info.metrics))
        values.pop("skipped", None)
        if not values.pop("finite") and self.loop.on_nan == "stop":
            raise NonFiniteLossError(self._nan_message(info.step, values))
        if self._skipped is not None:  # every skipped step since the last log, this one included
            skipped, self._skipped = int(self._skipped), None
            values["skipped_steps"] = skipped
            if skipped:
                reason = "non-finite" if not self.loss_scaled else "non-finite or loss-scale overflow"
                self.writer.event(info.step, f"skipped {skipped} {reason} step(s) since the last log")
        window_steps, elapsed = self._window.measure()
        if window_steps and elapsed > 0:
            values["steps_per_second"] = window_steps / elapsed
            work = self.task.work_per_step()
            if "tokens" in work:
                values["tokens_per_second"] = work["tokens"] * window_steps / elapsed
            peak = peak_flops_per_device()
            if "flops" in work and peak:
                values["mfu"] = work["flops"] * window_steps / elapsed / (peak * jax.device_count())
        self.writer.write(info.step, values)
        self.last_metrics.update(values)

    def _evaluate_hook(self, info: StepInfo) -> None:
        val_loss = self.evaluate(info.state.params, info.state.model_state)
        if val_loss is not None:
            self.writer.write(info.step, {"val_loss": val_loss})
            self.last_metrics["val_loss"] = val_loss

    def evaluate(self, params: Any, model_state: Any = None) -> float | None:
        """The mean loss over ``task.eval_data()`` (``None`` when it yields no batch) of
        ``params`` with ``model_state`` (default: the run's current model state), placed on the
        run's mesh first where they sit elsewhere (weights read back from a checkpoint, host arrays)."""
        model_state = self.state.model_state if model_state is None else model_state
        shardings = (self.state_shardings.params, self.state_shardings.model_state)
        params, model_state = jax.device_put((params, model_state), shardings)  # no copy where already placed
        total, count = 0.0, 0.0
        for local in self.task.eval_data() or ():
            batch = host_local_to_global(local, self.mesh, self.task.batch_axes, self.rules)
            with use_sharding(self.mesh, self.rules):
                loss_sum, batch_count = jax.device_get(self._eval_fn(params, model_state, batch, self.teacher))
            total, count = total + float(loss_sum), count + float(batch_count)
        return total / count if count else None

    def _save(self, info: StepInfo) -> None:
        if self.loop.on_nan == "stop" and not bool(info.metrics["finite"]):
            values = scalar_metrics(jax.device_get(info.metrics))
            raise NonFiniteLossError(self._nan_message(info.step, values))
        extra = {"data": self.data.state()}
        if self._skipped is not None:  # counted since the last log, which a resume from here logs
            extra[_SKIPPED] = int(self._skipped)
        self.manager.save(info.step, info.state, extra=extra)
        self.last_saved = info.step

    def _nan_message(self, step: int, values: dict[str, float]) -> str:
        last = self.manager.latest_step()
        pointer = (
            f"the last good checkpoint is step {last} in {self.manager.directory}"
            if last is not None
            else "no checkpoint was saved yet"
        )
        return (
            f"non-finite loss or gradients at step {step} (loss={values['loss']}, grad_norm={values['grad_norm']}); "
            f"{pointer}. Resume it with train.on_nan=skip to skip such steps, or start a new run_dir with a lower "
            "optim.lr or a longer optim.schedule.warmup_steps (a resume keeps the run's optimizer settings)."
        )

    def optimizer_state_bytes(self) -> int:
        """Bytes of the optimizer state (only trainable parameters have any)."""
        return sum(leaf.nbytes for leaf in jax.tree.leaves(self.state.opt_state))

    def trainable_params(self) -> Any:
        """The parameters this run updates (``select(params, mask)``)."""
        return select(self.state.params, self.mask)


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Host metrics as scalars: a vector ``v`` of ``name`` becomes ``name/0``, ``name/1``, ..."""
    values = {}
    for name, value in metrics.items():
        array = np.asarray(value)
        if array.ndim == 0:
            values[name] = float(array)
        else:
            values.update({f"{name}/{index}": float(entry) for index, entry in enumerate(array.reshape(-1))})
    return values


def _postfix(values: dict[str, float]) -> dict[str, str]:
    postfix = {"loss": f"{values['loss']:.3f}"} if "loss" in values else {}
    if "tokens_per_second" in values:
        postfix["tok/s"] = f"{values['tokens_per_second']:,.0f}"
    if "mfu" in values:
        postfix["mfu"] = f"{100 * values['mfu']:.1f}%"
    return postfix


def initialisation_compiler_options(mesh: jax.sharding.Mesh) -> dict[str, int] | None:
    """XLA options for compiling a run's initial state on ``mesh``: on CPU, LLVM's level 2
    rather than XLA's default 3. A run compiles its initialisation once and runs it once, and each
    parameter's random draw is its own unrolled threefry, so level 3's passes took longer than the
    training step's whole compile (tiny preset: 4.0 s against 1.1 s at level 2, of a 32 s run);
    the parameters are the same bit for bit (tests/training/test_trainer.py). None elsewhere, and
    under JAX's ``jax_disable_most_optimizations`` (level 0), which the option would raise."""
    if mesh.devices.flat[0].platform != "cpu" or jax.config.read("jax_disable_most_optimizations"):
        return None
    return {"xla_backend_optimization_level": 2}


__all__ = ["Hook", "NonFiniteLossError", "StepInfo", "Trainer", "initialisation_compiler_options", "scalar_metrics"]

"""The ``lm`` kind: ``train(config)`` runs (or resumes) one LM run in ``config.run_dir``.

The run directory is the run's identity. It holds the resolved ``config.yaml``,
``metrics.jsonl`` (one JSON object per logged step), TensorBoard event files,
``checkpoints/`` and, at the end, ``summary.json`` and ``samples.txt``. A run killed at any
moment resumes (``resume=True``) from its last complete checkpoint and continues the same
trajectory. It may resume with runtime settings changed (``LMConfig.identity`` leaves them
out: mesh, kernel implementation, remat, scan, page size, process layout, logging), never
with the architecture or the optimisation changed.

The work itself is :class:`ember.training.trainer.Trainer` running :class:`LMTask`.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import jax

from ember.core.config import ConfigError, from_yaml, run_kind, to_yaml
from ember.core.distributed import initialize_distributed
from ember.core.files import write_text_atomic
from ember.core.sharding import logical_rules, make_mesh
from ember.training.lm.config import LMConfig, flatten_keys
from ember.training.lm.task import LMTask
from ember.training.task import Task
from ember.training.trainer import NonFiniteLossError, Trainer

__all__ = ["NonFiniteLossError", "check_resumable", "make_trainer", "train"]


def train(config: LMConfig, *, resume: bool = False) -> dict[str, Any]:
    """Trains (or resumes) the run described by ``config``; returns the summary it writes.

    Raises:
      ConfigError: a bad config, or a run directory that conflicts with ``resume``.
      NonFiniteLossError: the loss went NaN/Inf with ``train.on_nan=stop``.
    """
    return make_trainer(config, resume=resume).train()


def make_trainer(config: Any, *, resume: bool = False, task: Task | None = None, mesh: Any = None) -> Trainer:
    """The trainer of an LM run (``task`` defaults to ``LMTask(config)``), ready to ``train()``;
    add hooks to it first if you like. ``config``: an ``LMConfig``, or another kind's config
    with the same run sections (``FinetuneConfig`` with its ``FinetuneTask``). ``mesh``: the
    run's, when the caller built it already (default ``make_mesh(config.mesh)``, built before the
    task opens its data, so a mesh that does not fit the devices fails first)."""
    initialize_distributed(config.distributed)
    mesh = make_mesh(config.mesh) if mesh is None else mesh
    run_dir = Path(config.run_dir)
    if resume:
        check_resumable(run_dir, config)
    task = task or LMTask(config)
    trainer = Trainer(
        task,
        loop=config.train,
        optim=config.optim,
        checkpoint=config.checkpoint,
        logging=config.logging,
        run_dir=run_dir,
        mesh=mesh,
        rules=logical_rules(config.sharding.rules),
        seed=config.seed,
        resume=resume,
    )
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "config.yaml", to_yaml(config))
    return trainer


def check_resumable(run_dir: Path, config: Any, *, warn: bool = True) -> None:
    """A run directory's saved config may differ from ``config`` only in runtime settings.
    ``warn``: warn of the schedules a changed ``train.steps`` moves (False for a check made
    early, before the slow work, by a caller whose ``make_trainer`` checks and warns again).

    Raises:
      ConfigError: the saved run is of another kind (keyed ``kind``), naming the changed keys that
        define the run (the first is ``key``), or the saved config's own error where it no longer
        validates (a check added since it was written): that file is the one to edit, not the
        command line.
    """
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        return
    saved_kind = run_kind(run_dir)
    if saved_kind != config.kind:
        raise ConfigError(
            f"run_dir {run_dir} holds a run of kind {saved_kind!r}, and this config's kind is {config.kind!r}; "
            f"--resume continues a run of the same kind: use a new run_dir, or resume it with a {saved_kind!r} config",
            key="kind",
        )
    try:
        saved_config = from_yaml(type(config), saved_path.read_text())
    except ConfigError as error:
        raise ConfigError(
            f"{saved_path}, the saved config of the run being resumed, no longer validates: {error} "
            "(edit that file, or start a new run_dir)",
            key=error.key,
        ) from None
    saved, current = saved_config.identity(), config.identity()
    changed = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
    if changed:
        raise ConfigError(
            f"run_dir {run_dir} was started with a different config; changed keys: {', '.join(changed)}. "
            f"Use a new run_dir, or change only runtime settings: {', '.join(runtime_settings(config))}",
            key=changed[0],
        )
    if warn:
        _warn_if_schedules_move(saved_config, config)


def _warn_if_schedules_move(saved: Any, config: Any) -> None:
    """A resume may change ``train.steps`` (to extend a run), but what is laid out over the steps
    moves with it: a decaying learning rate's schedule and QAT's start. Warns, naming them."""
    before, after = saved.train.steps, config.train.steps
    if before == after:
        return
    moved = []
    schedule = getattr(getattr(config, "optim", None), "schedule", None)
    if schedule is not None and schedule.kind != "constant":
        moved.append(f"the {schedule.kind} learning-rate decay (optim.schedule), now to step {after}")
    qat = getattr(config, "qat", None)
    if qat is not None and qat.format:
        moved.append(f"QAT's start (qat.fraction {qat.fraction}), now step {qat.start_step(after)}")
    if moved:
        warnings.warn(
            f"train.steps changed from {before} to {after} on resume, and so did {'; '.join(moved)}: the resumed run "
            "follows the new schedule from its checkpoint on, not the one it was trained on",
            stacklevel=3,
        )


def runtime_settings(config: Any) -> list[str]:
    """The keys of ``config`` that its ``identity()`` leaves out (what a resume may change), in
    the config's order, but ``run_dir`` (the run itself); a section is named once when all of it is."""
    everything = [key for key in flatten_keys(dataclasses.asdict(config)) if key != "run_dir"]
    kept = config.identity()
    sections: dict[str, list[str]] = {}
    for key in everything:
        sections.setdefault(key.split(".")[0], []).append(key)
    settings = []
    for name, keys in sections.items():
        free = [key for key in keys if key not in kept]
        settings.extend([name] if free == keys else free)
    return settings

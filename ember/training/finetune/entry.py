"""The ``finetune`` kind for ``ember train``: the config schema and the function that runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ember.core.distributed import initialize_distributed
from ember.core.sharding import make_mesh
from ember.training.finetune.config import FinetuneConfig as CONFIG_SCHEMA
from ember.training.finetune.task import FinetuneTask
from ember.training.lm.trainer import check_resumable, make_trainer


def run(config: CONFIG_SCHEMA, *, resume: bool = False) -> dict[str, Any]:
    """Fine-tunes (or resumes) the run described by ``config``; returns its summary."""
    initialize_distributed(config.distributed)  # before the task loads the base onto a device
    mesh = make_mesh(config.mesh)  # a mesh that does not fit the devices fails before the base is loaded
    if resume:  # so does a run directory this config cannot resume (make_trainer checks again, and warns)
        check_resumable(Path(config.run_dir), config, warn=False)
    return make_trainer(config, resume=resume, task=FinetuneTask(config), mesh=mesh).train()


__all__ = ["CONFIG_SCHEMA", "run"]

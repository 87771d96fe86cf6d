"""The demo's model (configs/lm/tiny.yaml) trained on the stdlib corpus for 200 of its 1500
steps, once per test session: the trainer's learning test reads its summary, the linearising
tests and notebook-free checks take it as their softmax teacher."""

from pathlib import Path

import pytest

from ember.core.config import load_config
from ember.training.lm.config import LMConfig
from ember.training.lm.trainer import train
from tests.once_per_session import build_once
from tests.training.lm_runs import REPO
from tests.xla_settings import xla_optimizations

STEPS = 200


def tiny_stdlib_run(tmp_path_factory) -> Path:
    """The directory holding ``run/`` (the trained run) and ``cache/`` (an ``EMBER_CACHE`` with
    the stdlib corpus prepared)."""

    def build(directory: Path) -> None:
        overrides = [
            f"run_dir={directory / 'run'}",
            f"train.steps={STEPS}",
            f"train.eval_every={STEPS}",
            f"checkpoint.every={STEPS}",
            "logging.progress=false",
            "logging.tensorboard=false",
            "sample.prompts=[]",
        ]
        # 200 steps: run time outweighs compile time, so XLA's optimizations pay.
        with pytest.MonkeyPatch.context() as patch, xla_optimizations():
            patch.setenv("EMBER_CACHE", str(directory / "cache"))
            train(load_config(LMConfig, REPO / "configs" / "lm" / "tiny.yaml", overrides))

    return build_once(tmp_path_factory, "tiny-stdlib-run", build)

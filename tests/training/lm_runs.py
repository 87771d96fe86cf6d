"""Shared set-up of the LM trainer tests: a small model's overrides, configs in a temporary
run directory, ``ember train`` in a subprocess, and reading a run's metrics back."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ember.core.config import load_config, to_yaml
from ember.training.lm.config import LMConfig
from tests.xla_settings import subprocess_xla_flags

REPO = Path(__file__).resolve().parents[2]

# A 2-layer, width-64 byte model: small enough that a step compiles and runs in seconds. A
# constant learning rate keeps ``train.steps`` out of the compiled step (a decay schedule bakes the
# run's length in), so runs of different lengths on one mesh share one compilation through the
# session's compilation cache; test_lm_resume.py keeps a decaying schedule across its resumes.
SMALL = [
    "model.vocab_size=384",
    "model.d_model=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.mlp_dim=128",
    "model.max_seq_len=64",
    "model.attention_impl=xla",
    "train.batch_size=8",
    "train.seq_len=32",
    "train.log_every=1",
    "train.eval_every=1000",
    "train.eval_batches=0",
    "optim.lr=3e-3",
    "optim.schedule.kind=constant",
    "checkpoint.every=1000",
    "logging.progress=false",
    "logging.tensorboard=false",
    "sample.prompts=[]",
]


KILLED_RUN_STEPS = 8
"""The length of the run that tests/training/conftest.py's ``killed_run`` kills and the tests resume."""


def small_config(tmp_path, dataset, *overrides):
    return load_config(LMConfig, None, [*SMALL, f"data.dataset={dataset}", f"run_dir={tmp_path / 'run'}", *overrides])


def read_metrics(run_dir):
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {entry["step"]: entry for entry in lines if "loss" in entry}


def write_config(tmp_path, dataset, *overrides):
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(small_config(tmp_path, dataset, *overrides)))
    return path


def ember_train(*args, devices=2):
    """``ember train ARGS`` in a subprocess with ``devices`` host CPU devices."""
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=subprocess_xla_flags(f"--xla_force_host_platform_device_count={devices}"),
    )
    return subprocess.Popen(
        [sys.executable, "-m", "ember", "train", *map(str, args)],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def wait_for_logged_steps(run_dir, steps, timeout=600):
    """Polls ``run_dir/metrics.jsonl`` until it holds ``steps`` lines (or ``timeout`` passes:
    the callers' assertions then say what is missing). Generous, since a loaded machine can take
    minutes to start a run, and a kill before the first checkpoint fails the test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics_file = Path(run_dir) / "metrics.jsonl"
        if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= steps:
            return
        time.sleep(0.02)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

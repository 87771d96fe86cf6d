"""Fixtures of the training tests."""

import signal

import pytest

from ember.core.checkpoint import CheckpointManager
from ember.training.data import prepare_token_files, stdlib_documents
from tests.once_per_session import build_once
from tests.training.lm_runs import KILLED_RUN_STEPS, ember_train, read_metrics, wait_for_logged_steps, write_config


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """A small prepared dataset of real Python source (the first stdlib files)."""
    directory = tmp_path_factory.mktemp("data")
    documents = []
    for name, text in stdlib_documents():
        documents.append((name, text))
        if sum(len(t) for _, t in documents) > 400_000:
            break
    prepare_token_files(documents, directory, val_fraction=0.1)
    return directory


@pytest.fixture(scope="session")
def killed_run(tmp_path_factory, dataset):
    """``(config path, metrics of the uninterrupted run, run directory killed mid-run)``: a small
    LM run of ``KILLED_RUN_STEPS`` steps with a decaying learning rate, checkpointed every 3 steps,
    both run by ``ember train`` on 8 host devices (the mesh a test process has too), the second
    killed with kill -9 after step 4. Built once per session and only read by the tests (each
    resumes a copy): test_lm_trainer.py resumes it as it is, test_lm_resume.py with a runtime
    setting changed."""

    def run_and_kill(root):
        config_path = write_config(
            root,
            dataset,
            f"train.steps={KILLED_RUN_STEPS}",
            "checkpoint.every=3",
            "mesh.data=8",
            "checkpoint.async_save=false",
            "optim.schedule.kind=cosine",  # the resumed steps must continue the decay, not restart it
        )
        reference_dir, killed_dir = root / "reference", root / "killed"
        reference = ember_train(config_path, f"run_dir={reference_dir}", devices=8)
        killed = ember_train(config_path, f"run_dir={killed_dir}", devices=8)
        wait_for_logged_steps(killed_dir, 4)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
        assert reference.wait(timeout=300) == 0, reference.stdout.read()
        saved = CheckpointManager(killed_dir / "checkpoints").all_steps()
        assert saved and max(saved) < KILLED_RUN_STEPS, f"the kill should leave a partial run, found {saved}"

    root = build_once(tmp_path_factory, "lm-killed-run", run_and_kill)
    return root / "config.yaml", read_metrics(root / "reference"), root / "killed"

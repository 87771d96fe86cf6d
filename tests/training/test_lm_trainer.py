"""The LM trainer end to end: sharding-invariant losses, exact resume after kill -9,
two-process data parallelism, early config errors, NaN handling, learning on real text."""

import json
import re
import shutil
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

from ember.cli import main
from ember.core.checkpoint import CheckpointManager
from ember.core.config import from_yaml, load_config
from ember.core.errors import ConfigError
from ember.training.lm.config import LMConfig
from ember.training.lm.trainer import NonFiniteLossError, make_trainer, train
from tests.tolerances import assert_allclose
from tests.training.lm_runs import (
    KILLED_RUN_STEPS,
    ember_train,
    free_port,
    read_metrics,
    small_config,
    wait_for_logged_steps,
    write_config,
)
from tests.training.tiny_stdlib_run import tiny_stdlib_run

# Ten steps (twenty took 8 s more CPU for the four runs): the loss falls from 5.76 to 3.85 and the
# median parameter leaf moves by 63% of its norm (measured on data 8x1x1), far from the start.
MESH_STEPS = 10


@pytest.mark.slow
def test_loss_is_the_same_on_every_mesh_and_with_grad_accumulation(tmp_path, dataset):
    variants = {
        "data 8x1x1": ["mesh.data=8"],
        "fsdp 1x8x1": ["mesh.data=1", "mesh.fsdp=8"],
        "2x2x2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
        "accum 4": ["mesh.data=8", "train.grad_accum=4"],
    }
    losses = {}
    for name, overrides in variants.items():
        config = small_config(tmp_path / name.replace(" ", "_"), dataset, f"train.steps={MESH_STEPS}", *overrides)
        summary = train(config)
        metrics = read_metrics(config.run_dir)
        assert sorted(metrics) == list(range(1, MESH_STEPS + 1)) and summary["steps"] == MESH_STEPS
        losses[name] = np.array([metrics[step]["loss"] for step in range(1, MESH_STEPS + 1)])
    assert losses["data 8x1x1"][-1] < losses["data 8x1x1"][0]  # it learns
    for name, curve in losses.items():
        # Sharding changes the order of float32 reductions; 10 Adam steps amplify that a little.
        assert_allclose(curve, losses["data 8x1x1"], dtype=np.float32, scale=20, err_msg=name)


@pytest.mark.slow
def test_kill_9_then_resume_reproduces_the_uninterrupted_run(killed_run, tmp_path, capsys):
    """``ember train --resume`` on a run killed with kill -9 (tests/training/conftest.py's
    ``killed_run``, on 8 devices like this process) logs each step once, with the losses of the
    run that was never interrupted, bit for bit."""
    config_path, expected, killed_dir = killed_run
    run_dir = tmp_path / "killed"
    shutil.copytree(killed_dir, run_dir)
    assert main(["train", str(config_path), f"run_dir={run_dir}", "--resume"]) == 0, capsys.readouterr().err
    got = read_metrics(run_dir)
    steps = list(range(1, KILLED_RUN_STEPS + 1))
    assert sorted(got) == sorted(expected) == steps, "each step appears exactly once after the resume"
    for step in steps:
        assert got[step]["loss"] == expected[step]["loss"], f"step {step}"


@pytest.mark.slow
def test_two_processes_train_like_one_and_resume_after_kill_9_on_a_new_port(tmp_path, dataset):
    config_path = write_config(
        tmp_path, dataset, "train.steps=6", "mesh.data=-1", "checkpoint.async_save=false", "checkpoint.every=2"
    )
    # One process with 4 devices against two processes with 2 devices each: the same mesh size.
    single = ember_train(config_path, f"run_dir={tmp_path / 'single'}", devices=4)
    assert single.wait(timeout=300) == 0, single.stdout.read()

    def workers(port, *flags):
        return [
            ember_train(
                config_path,
                f"run_dir={tmp_path / 'multi'}",
                f"distributed.coordinator_address=127.0.0.1:{port}",
                "distributed.num_processes=2",
                f"distributed.process_id={process_id}",
                *flags,
                devices=2,
            )
            for process_id in range(2)
        ]

    killed = workers(free_port())
    wait_for_logged_steps(tmp_path / "multi", 3)
    for worker in killed:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=60)
    saved = CheckpointManager(tmp_path / "multi" / "checkpoints").all_steps()
    assert saved and max(saved) < 6, f"the kill should leave a partial run, found checkpoints {saved}"
    # Rank 1 resumes against rank 0's config.yaml (process_id 0) and both meet on another port. The
    # end-of-run samples (a runtime setting) read weights sharded over both processes: rank 0 died
    # in jax.device_put before they were gathered.
    resumed = workers(free_port(), "--resume", "sample.prompts=[def]", "sample.max_tokens=4")
    outputs = [w.communicate(timeout=300)[0] for w in resumed]
    assert all(w.returncode == 0 for w in resumed), outputs
    assert (tmp_path / "multi" / "samples.txt").read_text().startswith("--- 'def'\ndef")
    a = CheckpointManager(tmp_path / "single" / "checkpoints").restore()
    b = CheckpointManager(tmp_path / "multi" / "checkpoints").restore()
    assert a.step == b.step == 6
    for x, y in zip(jax.tree.leaves(a.state["params"]), jax.tree.leaves(b.state["params"])):
        # The cross-process all-reduce sums in a different order than the single-process one.
        assert_allclose(y, x, scale=10, err_msg="parameters after 6 steps")


@pytest.mark.slow
def test_a_signal_to_one_of_two_processes_stops_both_after_one_step_with_a_checkpoint(tmp_path, dataset):
    """SIGTERM (a preemption notice) to rank 1 only. Before, rank 1 alone stopped and began its
    checkpoint while rank 0 went on to the next step: each waited for the other in a collective, and
    rank 0 hung (killed after 60 s) while rank 1 aborted, with no checkpoint written. JAX's
    preemption service now names one step after which both save and stop."""
    config_path = write_config(tmp_path, dataset, "train.steps=100000", "checkpoint.every=100000", "mesh.data=-1")
    port, run_dir = free_port(), tmp_path / "run"
    workers = [
        ember_train(config_path, f"run_dir={run_dir}", f"distributed.coordinator_address=127.0.0.1:{port}",
                    "distributed.num_processes=2", f"distributed.process_id={rank}", devices=2)
        for rank in range(2)
    ]  # fmt: skip
    try:
        wait_for_logged_steps(run_dir, 3)
        workers[1].send_signal(signal.SIGTERM)
        outputs = [worker.communicate(timeout=120)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    assert [worker.returncode for worker in workers] == [0, 0], [output[-3000:] for output in outputs]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = CheckpointManager(run_dir / "checkpoints", read_only=True).all_steps()
    assert summary["stopped_early"] and steps == [summary["steps"]] == [summary["last_checkpoint"]]
    assert max(read_metrics(run_dir)) == summary["steps"] >= 3


@pytest.mark.parametrize(
    "overrides, message",
    [
        # 6 rows on 2 processes x 2 devices: the data axis (4) does not divide the batch, so the batch is
        # replicated over it, and each process's 3 rows cannot fill it: both ranks died in
        # make_array_from_process_local_data with a ValueError traceback at the first step.
        (
            ("train.batch_size=6", "mesh.data=-1"),
            "the global batch of 6 rows does not split over the mesh's batch axes",
        ),
        # Tensor parallelism across the processes (mesh.data=1, mesh.tensor=4): the batch is split over
        # no axis, so each process's devices hold all 8 rows while it reads 4. The error told the user
        # to make train.batch_size (8) a multiple of the batch axes' product (1).
        (
            ("mesh.data=1", "mesh.tensor=-1"),
            "the global batch of 8 rows cannot be fed by 2 processes on this mesh: each process reads its own 4 "
            "rows, but this process's devices hold 8 (the batch is split over no mesh axis; mesh.tensor=4 spans "
            "processes); the axes the batch is split over (mesh.data x mesh.fsdp x mesh.expert by default) must "
            "span the processes, their product a multiple of 2, and the others stay within one process's 2 devices",
        ),
    ],
    ids=["batch-not-divided", "tensor-axis-across-processes"],
)
def test_a_batch_the_processes_cannot_feed_is_a_config_error(tmp_path, dataset, overrides, message):
    """2 processes x 2 devices, a mesh whose batch rows the processes cannot each feed their own share of."""
    config_path = write_config(tmp_path, dataset, *overrides)
    port = free_port()
    workers = [
        ember_train(config_path, f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
                    f"distributed.process_id={rank}", devices=2)
        for rank in range(2)
    ]  # fmt: skip
    for worker in workers:
        output = worker.communicate(timeout=300)[0]
        assert worker.returncode == 2, output[-3000:]
        assert f"ember train: {message}" in output


def test_bad_configs_fail_before_compiling(tmp_path, dataset, capsys):
    config_path = write_config(tmp_path, dataset)
    assert main(["train", str(config_path), "train.stpes=3"]) == 2
    assert "unknown config key 'train.stpes'" in capsys.readouterr().err
    assert main(["train", str(config_path), "optim.lr=fast"]) == 2
    assert "config key 'optim.lr' (from command-line overrides) expects float, got 'fast'" in capsys.readouterr().err
    assert main(["train", str(config_path), "mesh.data=3"]) == 2
    assert "mesh.data=3" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_sharding_rules_are_checked_with_the_config(tmp_path):
    """A bad sharding rule fails when the config loads (what the launcher promises), as a bad
    mesh key does: it was only checked when the trainer was built, after the task had opened its
    data (and, for finetune, grpo and linearize runs, loaded the base model)."""
    for override, message in (
        ("sharding.rules={batches: [data]}", "unknown logical axis 'batches' in sharding rules; valid: batch, seq"),
        ("sharding.rules={batch: [gpu]}", "sharding rule for 'batch' names mesh axis 'gpu'; valid: data, fsdp"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)) as info:
            load_config(LMConfig, None, [f"run_dir={tmp_path / 'run'}", override])
        assert info.value.key == f"sharding.rules.{'batches' if 'batches' in override else 'batch'}"
    assert load_config(LMConfig, None, ["sharding.rules={vocab: []}"]).sharding.rules == {"vocab": []}


def test_an_expert_axis_that_does_not_divide_the_experts_fails_with_the_config(tmp_path):
    """mesh.expert=8 with 4 experts: the expert-parallel dispatch raised (an EmberError naming no key)
    only when the first training step was traced, after the model had been initialised."""
    moe = ["model.mlp_pattern=[moe]", "model.moe.num_experts=4", "mesh.data=1", f"run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=re.escape("mesh.expert=8 does not divide model.moe.num_experts=4")) as info:
        load_config(LMConfig, None, [*moe, "mesh.expert=8"])
    assert info.value.key == "mesh.expert"
    assert load_config(LMConfig, None, [*moe, "mesh.expert=4"]).mesh.expert == 4
    assert load_config(LMConfig, None, ["model.moe.num_experts=4", "mesh.expert=8"]).mesh.expert == 8  # dense: data


def test_nan_stops_with_pointer_to_last_checkpoint_or_is_skipped(tmp_path, dataset):
    config = small_config(
        tmp_path,
        dataset,
        "train.steps=6",
        "optim.lr=1e30",
        "optim.clip_norm=0",
        "checkpoint.every=1",
        "mesh.data=8",
        "optim.schedule.kind=constant",
    )
    with pytest.raises(
        NonFiniteLossError,
        match=r"non-finite loss or gradients at step \d \(loss=.*\); the last good checkpoint is step \d.*"
        r"Resume it with train\.on_nan=skip.*start a new run_dir with a lower optim\.lr",
    ):
        train(config)
    skipping = small_config(
        tmp_path / "skip",
        dataset,
        "train.steps=4",
        "optim.lr=1e30",
        "optim.clip_norm=0",
        "train.on_nan=skip",
        "mesh.data=8",
        "optim.schedule.kind=constant",
    )
    summary = train(skipping)
    assert summary["steps"] == 4
    events = [json.loads(line) for line in (tmp_path / "skip" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("non-finite step(s) since the last log" in str(entry.get("event", "")) for entry in events)
    # step 1's loss is finite; its update at lr 1e30 is not, nor is any step after it (each skipped)
    assert [entry["skipped_steps"] for entry in events if "loss" in entry] == [0, 1, 1, 1]


def test_run_directory_contents_and_resume_guard(tmp_path, dataset, monkeypatch):
    config = small_config(
        tmp_path,
        dataset,
        "train.steps=3",
        "mesh.data=8",
        "logging.tensorboard=true",
        "train.eval_batches=1",
        "train.eval_every=3",
        "sample.prompts=['def ']",
        "sample.max_tokens=8",
    )
    summary = train(config)
    run_dir = Path(config.run_dir)
    assert from_yaml(LMConfig, (run_dir / "config.yaml").read_text()) == config
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == [1, 2, 3] and all(np.isfinite(m["loss"]) for m in metrics.values())
    assert list(run_dir.glob("events.out.tfevents.*")) or list(run_dir.glob("**/events.out.tfevents.*"))
    assert summary["val_loss"] > 0 and len(summary["samples"]) == 1
    assert (run_dir / "samples.txt").read_text().startswith("--- 'def '")
    with pytest.raises(ConfigError, match="already holds checkpoints; pass --resume"):
        train(config)
    changed = small_config(tmp_path, dataset, "train.steps=5", "mesh.data=8", "optim.lr=1e-3")
    with pytest.raises(ConfigError, match=re.escape("changed keys: optim.lr")):
        train(changed, resume=True)
    longer = small_config(
        tmp_path,
        dataset,
        "train.steps=5",
        "mesh.data=8",
        "logging.tensorboard=true",
        "train.eval_batches=1",
        "train.eval_every=3",
        "sample.prompts=['def ']",
        "sample.max_tokens=8",
    )
    # Killed while a resume rewrites config.yaml: before, the file was left half written, and no
    # later resume (nor 'ember generate --checkpoint') could read the run.
    write_text = Path.write_text

    def killed_midway(path, text, *args, **kwargs):
        if "config.yaml" not in path.name:
            return write_text(path, text, *args, **kwargs)
        write_text(path, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_text", killed_midway)
        with pytest.raises(KeyboardInterrupt):
            make_trainer(longer, resume=True)
    assert from_yaml(LMConfig, (run_dir / "config.yaml").read_text()) == config
    assert train(longer, resume=True)["steps"] == 5
    assert sorted(read_metrics(run_dir)) == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_tiny_preset_learns_far_below_the_unigram_entropy(tmp_path_factory, monkeypatch):
    """The demo's config on the real stdlib corpus, on a shorter budget (200 of its 1500 steps)."""
    from ember.training.data import TokenDataset, stdlib_corpus_dir

    root = tiny_stdlib_run(tmp_path_factory)
    monkeypatch.setenv("EMBER_CACHE", str(root / "cache"))
    validation = np.asarray(TokenDataset.open(stdlib_corpus_dir()).val)
    counts = np.bincount(validation)
    probabilities = counts[counts > 0] / counts.sum()
    unigram_entropy = float(-(probabilities * np.log(probabilities)).sum())
    summary = json.loads((root / "teacher" / "summary.json").read_text())
    print(f"unigram entropy {unigram_entropy:.3f} nats, validation loss after 200 steps {summary['val_loss']:.3f}")
    assert summary["steps"] == 200 and 3.0 < unigram_entropy < 3.5
    # Measured: 1.90 nats after 200 steps against a unigram entropy of 3.19 (the full 1500-step
    # demo reaches 1.25). The bound leaves ~0.5 nats of margin.
    assert summary["val_loss"] < unigram_entropy - 0.8


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_then_exits_cleanly(tmp_path, dataset):
    config_path = write_config(tmp_path, dataset, "train.steps=100000", "checkpoint.every=100000", "mesh.data=2")
    run_dir = tmp_path / "terminated"
    process = ember_train(config_path, f"run_dir={run_dir}")
    wait_for_logged_steps(run_dir, 3)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output
    assert "received SIGTERM: saving a checkpoint" in output
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = CheckpointManager(run_dir / "checkpoints").all_steps()
    assert (
        summary["stopped_early"] and steps == [summary["steps"]] and summary["last_checkpoint"] == summary["steps"] >= 3
    )
    assert max(read_metrics(run_dir)) == summary["steps"]

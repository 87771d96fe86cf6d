"""Runtime settings are not a run's identity: a run killed with kill -9 resumes with any one of
them changed (kernel implementation, remat, scan, page size, mesh, logging) and continues
its trajectory; changing the architecture is refused, naming the key. The killed run is
tests/training/conftest.py's ``killed_run``. The multi-process case (another rank, a new
coordinator port) is in test_lm_trainer.py."""

import shutil

import numpy as np
import pytest

from ember.core.config import load_config, to_yaml
from ember.core.errors import ConfigError
from ember.training.lm.config import LMConfig
from ember.training.lm.trainer import check_resumable, train
from tests.tolerances import assert_allclose
from tests.training.lm_runs import KILLED_RUN_STEPS, read_metrics, small_config

# change -> whether the resumed trajectory must equal the uninterrupted one bit for bit. Where
# the arithmetic legitimately differs (Pallas kernel vs XLA, sharded reductions, scan vs
# unrolled fusion, recomputation under remat) it must agree to f32 tolerance.
RUNTIME_CHANGES = {
    "attention_impl xla -> interpret": (["model.attention_impl=interpret"], False),
    "remat none -> full": (["model.remat=full"], False),
    "scan_layers true -> false": (["model.scan_layers=false"], False),
    "page_size 16 -> 8": (["model.page_size=8"], True),
    "mesh data 8 -> data 2 x fsdp 4": (["mesh.data=2", "mesh.fsdp=4"], False),
    "logging": (["logging.tensorboard=true", "logging.progress=true"], True),
}


def resume_copy(killed_run, tmp_path, *changes):
    config_path, _, killed_dir = killed_run
    run_dir = tmp_path / "run"
    shutil.copytree(killed_dir, run_dir)
    return train(load_config(LMConfig, config_path, [f"run_dir={run_dir}", *changes]), resume=True), run_dir


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNTIME_CHANGES))
def test_resume_with_a_runtime_setting_changed_continues_the_trajectory(killed_run, tmp_path, name):
    changes, exact = RUNTIME_CHANGES[name]
    summary, run_dir = resume_copy(killed_run, tmp_path, *changes)
    expected, got = killed_run[1], read_metrics(run_dir)
    assert summary["steps"] == KILLED_RUN_STEPS and sorted(got) == list(range(1, KILLED_RUN_STEPS + 1))
    expected_losses = np.array([expected[step]["loss"] for step in range(1, KILLED_RUN_STEPS + 1)])
    got_losses = np.array([got[step]["loss"] for step in range(1, KILLED_RUN_STEPS + 1)])
    if exact:
        np.testing.assert_array_equal(got_losses, expected_losses)
    else:
        # A few Adam steps after the resume amplify float32 reordering a little.
        assert_allclose(got_losses, expected_losses, dtype=np.float32, scale=20, err_msg=name)


@pytest.mark.slow
def test_resume_with_an_architecture_key_changed_is_refused_by_name(killed_run, tmp_path):
    for change, key in [
        ("model.mlp_dim=256", "model.mlp_dim"),
        ("model.precision=pure_bf16", "model.precision"),
        ("train.freeze=['^embed/']", "train.freeze"),
    ]:
        with pytest.raises(ConfigError, match=f"changed keys: {key}") as error:
            resume_copy(killed_run, tmp_path / key, change)
        assert error.value.key == key


def test_resume_guard_compares_the_architecture_only(tmp_path, dataset):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = small_config(tmp_path, dataset, "mesh.data=8")
    (run_dir / "config.yaml").write_text(to_yaml(config))
    runtime = [
        "distributed.process_id=1",
        "distributed.num_processes=2",
        "distributed.coordinator_address=10.0.0.1:1234",
        "model.attention_impl=interpret",
        "model.quantized_impl=xla",
        "model.remat=dots",
        "model.scan_layers=false",
        "model.page_size=8",
        "model.precision=bf16",
        "mesh.data=2",
        "mesh.fsdp=4",
        "logging.progress=true",
        "train.grad_accum=2",
        "train.on_nan=skip",  # what the non-finite loss error tells a run stopped by one to resume with
        "checkpoint.every=7",
        "train.steps=99",
        "sample.max_tokens=3",
    ]
    for change in runtime:
        check_resumable(run_dir, small_config(tmp_path, dataset, "mesh.data=8", change))  # accepted
    for change, key in [
        ("model.d_model=128", "model.d_model"),
        ("model.precision=pure_bf16", "model.precision"),
        ("model.rope.theta=500000", "model.rope.theta"),
        ("optim.lr=1e-3", "optim.lr"),
        ("data.seed=5", "data.seed"),
        ("train.aux_loss_weights={balance: 0.1}", "train.aux_loss_weights.balance"),
    ]:
        with pytest.raises(ConfigError, match=f"changed keys: {key}") as error:
            check_resumable(run_dir, small_config(tmp_path, dataset, "mesh.data=8", change))
        assert error.value.key == key


def test_resume_guard_lists_the_settings_that_may_change(tmp_path):
    # Before, every kind's message listed the LM's "model.attention_impl / remat / scan_layers /
    # page_size" (a fine-tuning config has no model section: its keys are base_model.*) and left
    # out settings a resume accepts, such as train.grad_accum.
    from ember.training.finetune.config import FinetuneConfig
    from ember.training.launcher import shipped_configs_dir

    path, required = shipped_configs_dir() / "finetune" / "lora.yaml", ["base_model.path=base", "data.train=t.jsonl"]
    (tmp_path / "config.yaml").write_text(to_yaml(load_config(FinetuneConfig, path, required)))
    with pytest.raises(ConfigError, match=r"changed keys: adapter\.rank") as error:
        check_resumable(tmp_path, load_config(FinetuneConfig, path, [*required, "adapter.rank=4"]))
    allowed = str(error.value).split("runtime settings")[1]
    for key in (
        "base_model.attention_impl",
        "base_model.quantized_impl",
        "base_model.remat",
        "train.grad_accum",
        "mesh",
        "checkpoint",
    ):
        assert key in allowed, (key, allowed)
    assert " model." not in allowed, allowed


def test_a_saved_config_that_no_longer_validates_names_the_saved_file(tmp_path):
    # A full fine-tuning run saved before export.peft was refused for it: its config.yaml holds
    # peft: true. Before, the resume raised the bare check ("export.peft writes a LoRA adapter
    # ..."), read as a fault of the command line, which cannot change the saved file.
    from ember.training.finetune.config import FinetuneConfig
    from ember.training.launcher import shipped_configs_dir

    path = shipped_configs_dir() / "finetune" / "lora.yaml"
    config = load_config(FinetuneConfig, path, ["base_model.path=base", "data.train=t.jsonl", "method=full"])
    (tmp_path / "config.yaml").write_text(to_yaml(config).replace("peft: null", "peft: true"))
    with pytest.raises(ConfigError, match=r"config\.yaml, the saved config of the run being resumed") as error:
        check_resumable(tmp_path, config)
    assert error.value.key == "export.peft" and "edit that file" in str(error.value)


def test_resume_guard_refuses_a_run_directory_of_another_kind(tmp_path):
    # Before, the saved config was read with this run's schema: resuming an LM config into a
    # fine-tuning run's directory said "unknown config key 'base_model' ... Did you mean 'model'?",
    # a key the user's own config does not have.
    from ember.training.finetune.config import FinetuneConfig
    from ember.training.launcher import shipped_configs_dir

    path, required = shipped_configs_dir() / "finetune" / "lora.yaml", ["base_model.path=base", "data.train=t.jsonl"]
    finetune = load_config(FinetuneConfig, path, [*required, f"run_dir={tmp_path}"])
    lm = load_config(LMConfig, None, [f"run_dir={tmp_path}"])
    for saved, resumed in [(finetune, lm), (lm, finetune)]:
        (tmp_path / "config.yaml").write_text(to_yaml(saved))
        with pytest.raises(ConfigError, match=f"holds a run of kind '{saved.kind}'.*kind is '{resumed.kind}'") as error:
            check_resumable(tmp_path, resumed)
        assert error.value.key == "kind"


def test_a_resume_that_changes_train_steps_warns_of_the_schedules_it_moves(tmp_path):
    """train.steps may change on resume (to extend a run), but a decaying learning rate and QAT's
    start are laid out over it: before, they moved without a word (a run resumed inside QAT with
    more steps trained in full precision again)."""
    import warnings

    def config(*overrides):
        return load_config(LMConfig, None, ["data.dataset=d", f"run_dir={tmp_path}", *overrides])

    (tmp_path / "config.yaml").write_text(to_yaml(config("train.steps=100", "qat.format=int8")))
    with pytest.warns(UserWarning, match=r"train\.steps changed from 100 to 200 on resume.*cosine learning-rate decay"
                      r".*QAT's start \(qat\.fraction 0\.2\), now step 160") as caught:  # fmt: skip
        check_resumable(tmp_path, config("train.steps=200", "qat.format=int8"))
    assert len(caught) == 1
    (tmp_path / "config.yaml").write_text(to_yaml(config("train.steps=100", "optim.schedule.kind=constant")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing laid out over the steps: nothing to say
        check_resumable(tmp_path, config("train.steps=200", "optim.schedule.kind=constant"))
        check_resumable(tmp_path, config("train.steps=100", "optim.schedule.kind=constant"))


@pytest.mark.parametrize(
    "kind, shipped, required, change, saved_in",
    [
        ("finetune", "finetune/lora.yaml", ["data.train=t.jsonl"], "adapter.rank=4", "."),
        ("grpo", "rl_lm/grpo_arithmetic.yaml", [], "adapter.rank=4", "."),
        ("linearize", "linearize/tiny.yaml", [], "linear.window=8", "."),
        ("linearize", "linearize/tiny.yaml", [], "linear.window=8", "attention_transfer"),
    ],
)
def test_a_run_that_cannot_resume_is_refused_before_the_base_is_loaded(
    tmp_path, monkeypatch, kind, shipped, required, change, saved_in
):
    """These kinds checked the run directory only in make_trainer, after loading the base model
    (for a Hugging Face base, possibly many GB; linearize also evaluated the teacher first)."""
    import importlib

    from ember.training.launcher import KINDS, shipped_configs_dir

    entry = importlib.import_module(KINDS[kind])
    for module in ("ember.training.finetune.task", "ember.training.rl_lm.task", "ember.training.linearize.entry"):
        monkeypatch.setattr(importlib.import_module(module), "load_base", lambda *_: pytest.fail("base loaded"))
    path, overrides = shipped_configs_dir() / shipped, ["base_model.path=base", f"run_dir={tmp_path}", *required]
    saved = load_config(entry.CONFIG_SCHEMA, path, overrides)
    saved = saved.stage("transfer") if saved_in != "." else saved
    (tmp_path / saved_in).mkdir(exist_ok=True)
    (tmp_path / saved_in / "config.yaml").write_text(to_yaml(saved))
    with pytest.raises(ConfigError, match="was started with a different config"):
        entry.run(load_config(entry.CONFIG_SCHEMA, path, [*overrides, change]), resume=True)


def test_a_finished_transfer_stage_is_reused_only_with_the_config_it_ran(tmp_path, monkeypatch):
    """ember linearize --resume took a finished attention-transfer stage's weights without comparing
    its config: a resume with transfer.optim.lr changed went on to stage 2, and run_dir/config.yaml
    recorded the new lr for weights trained with the old one."""
    import json

    from ember.training.launcher import shipped_configs_dir
    from ember.training.linearize import entry

    monkeypatch.setattr(entry, "load_base", lambda *_: pytest.fail("base loaded"))
    path, overrides = shipped_configs_dir() / "linearize" / "tiny.yaml", ["base_model.path=base", f"run_dir={tmp_path}"]
    stage = tmp_path / "attention_transfer"
    stage.mkdir()
    (stage / "config.yaml").write_text(to_yaml(load_config(entry.CONFIG_SCHEMA, path, overrides).stage("transfer")))
    (stage / "summary.json").write_text(json.dumps({"stopped_early": False, "steps": 60}))
    with pytest.raises(ConfigError, match=r"changed keys: .*transfer\.optim\.lr"):
        entry.run(load_config(entry.CONFIG_SCHEMA, path, [*overrides, "transfer.optim.lr=0.01"]), resume=True)

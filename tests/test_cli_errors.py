"""Every failure a user can cause prints one line naming the problem, exits with code 2 and
shows no traceback, whichever ``ember`` command it is; flags stand anywhere among arguments.

One failure of each command runs as an ``ember`` subprocess (what a user sees: the process's
exit status and all it writes to stderr); the others run in this process through ``main``, held
to what a subprocess would show. All from fixtures built once: a prepared dataset, an LM config
and run directories that conflict with it. Most fail before anything compiles.
"""

import dataclasses
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from ember.cli import main
from ember.core.checkpoint import CheckpointManager
from ember.core.config import load_config, to_yaml
from ember.training.data import prepare_token_files, stdlib_documents
from ember.training.lm.config import LMConfig
from ember.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
RL_CONFIGS = REPO / "configs" / "rl"

# A 1-layer, width-32 byte model: the runs that train (non-finite loss, the resumed run) compile in
# seconds. A constant learning rate keeps train.steps out of the compiled step, so the run resumed
# to a later step compiles no step of its own.
TINY_LM = [
    "model.vocab_size=384",
    "model.d_model=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.mlp_dim=64",
    "model.max_seq_len=32",
    "model.attention_impl=xla",
    "train.batch_size=8",
    "train.seq_len=16",
    "train.log_every=1",
    "train.eval_every=1000",
    "train.eval_batches=0",
    "optim.schedule.kind=constant",
    "checkpoint.every=1000",
    "checkpoint.async_save=false",
    "logging.progress=false",
    "logging.tensorboard=false",
    "sample.prompts=[]",
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A directory with a dataset, an LM config on it, run directories holding a checkpoint
    (``existing``), one started with a wider model (``wider``), one with no checkpoint
    (``untrained``), one with metrics (``plotted``), an RL run's config alone (``policy``) and a
    5-byte text (``short.txt``)."""
    root = tmp_path_factory.mktemp("cli_errors")
    documents = []
    for name, text in stdlib_documents():
        documents.append((name, text))
        if sum(len(t) for _, t in documents) > 50_000:
            break
    prepare_token_files(documents, root / "data", val_fraction=0.1)
    config = load_config(LMConfig, None, [*TINY_LM, f"data.dataset={root / 'data'}", f"run_dir={root / 'run'}"])
    (root / "lm.yaml").write_text(to_yaml(config))
    for name, changes in (("existing", {}), ("wider", {"d_model": 64})):
        saved = dataclasses.replace(
            config, run_dir=str(root / name), model=dataclasses.replace(config.model, **changes)
        )
        with CheckpointManager(root / name / "checkpoints", async_save=False) as manager:
            manager.save(1, {"params": {"w": np.ones(2, np.float32)}})
        (root / name / "config.yaml").write_text(to_yaml(saved))
    (root / "plotted").mkdir()
    (root / "plotted" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5}) + "\n")
    (root / "untrained").mkdir()
    (root / "untrained" / "config.yaml").write_text(to_yaml(config))
    (root / "policy").mkdir()
    (root / "policy" / "config.yaml").write_text("kind: rl\n")
    (root / "short.txt").write_text("def f")
    return root


def train(*args):
    return ["train", "{root}/lm.yaml", *args]


# (command line, a piece of the one-line message); "{root}" is the workspace. One failure of each
# command (train's LM and RL configs apart) runs as a subprocess, as a user would run it: its
# import, JAX's start-up and the exit status of ``python -m ember`` are part of what is checked.
SUBPROCESS_FAILURES = {
    "non-finite loss": (
        train(
            "run_dir={root}/nan", "train.steps=3", "optim.lr=1e30", "optim.clip_norm=0", "optim.schedule.kind=constant"
        ),
        "non-finite loss or gradients at step",
    ),
    "rl bad value": (
        ["train", str(RL_CONFIGS / "ppo_cartpole.yaml"), "ppo.num_envs=0"],
        "ppo.num_envs must be a positive integer, got 0",
    ),
    "eval bad episodes": (["eval", "{root}/policy", "--episodes", "0"], "--episodes must be a positive integer"),
    "generate bad option": (
        ["generate", "--checkpoint", "{root}/existing", "--prompt", "hi", "--top-p", "0"],
        "--top-p: top_p must be a number in (0, 1], got 0.0 (float)",
    ),
    "export no checkpoint": (["export", "{root}/untrained", "{root}/artifact"], "no complete checkpoint"),
    "plot no metrics": (["plot", "{root}/existing"], "has no metrics.jsonl"),
}

# More of the same, run in this process (each subprocess pays JAX's import again: 1-3 s).
IN_PROCESS_FAILURES = {
    "lm unknown key": (train("train.stpes=3"), "unknown config key 'train.stpes'"),
    "lm wrong type": (train("optim.lr=fast"), "config key 'optim.lr' (from command-line overrides) expects float"),
    "lm bad model value": (train("model.num_layers=0"), "model.num_layers must be a positive integer, got 0"),
    "mesh does not fit": (train("mesh.data=3"), "mesh mesh.data=3 x mesh.fsdp=1"),
    # Before the base model is loaded (it was loaded first: here the missing base was reported instead).
    "finetune mesh does not fit": (
        [
            "train",
            str(REPO / "configs" / "finetune" / "lora.yaml"),
            "base_model.path={root}/nowhere",
            "data.train={root}/nowhere.jsonl",
            "run_dir={root}/finetune",
            "mesh.data=3",
        ],
        "mesh mesh.data=3 x mesh.fsdp=1",
    ),
    "grpo mesh does not fit": (
        [
            "train",
            str(REPO / "configs" / "rl_lm" / "grpo_arithmetic.yaml"),
            "base_model.path={root}/nowhere",
            "run_dir={root}/grpo",
            "mesh.data=3",
        ],
        "mesh mesh.data=3 x mesh.fsdp=1",
    ),
    "linearize mesh does not fit": (
        [
            "linearize",
            "{root}/nowhere",
            "{root}/linearized_mesh",
            "--config",
            str(REPO / "configs" / "linearize" / "tiny.yaml"),
            "mesh.data=3",
        ],
        "mesh mesh.data=3 x mesh.fsdp=1",
    ),
    "existing run without --resume": (train("run_dir={root}/existing"), "already holds checkpoints; pass --resume"),
    "train list with a config": (["train", "--list", "{root}/lm.yaml"], "--list lists the shipped configs and takes"),
    "linearize a config of another kind": (
        ["linearize", "{root}/existing", "{root}/linearized", "--config", "{root}/lm.yaml"],
        "lm.yaml is a kind: lm config; ember linearize takes a kind: linearize one",
    ),
    "resume with another architecture": (train("run_dir={root}/wider", "--resume"), "changed keys: model.d_model."),
    "generate missing prompts": (
        ["generate", "--checkpoint", "{root}/existing", "--prompts", "{root}/nowhere.jsonl"],
        "--prompts: no such file",
    ),
    "lm malformed override": (train("train.steps"), "malformed override 'train.steps'"),
    "missing config file": (["train", "{root}/nowhere.yaml"], "config file not found"),
    "missing dataset": (train("run_dir={root}/no_data", "data.dataset={root}/nowhere"), "not a prepared dataset"),
    "optim clip_norm": (train("optim.clip_norm=-1"), "optim.clip_norm must be a finite number >= 0 (0 turns"),
    "optim nan lr": (train("optim.lr=.nan"), "optim.lr must be a finite number > 0, got nan"),
    "checkpoint keep": (train("checkpoint.keep=0"), "checkpoint.keep must be a positive integer, got 0"),
    "sample no tokens": (train("sample.max_tokens=0"), "sample.max_tokens must be a positive integer, got 0"),
    "sample negative temperature": (
        train("sample.temperature=-1"),
        "sample.temperature must be a finite number >= 0 (0 = greedy), got -1.0",
    ),
    "sample top_k": (train("sample.top_k=-5"), "sample.top_k must be an integer >= 0 (0 = off), got -5"),
    "sample top_p": (train("sample.top_p=7"), "sample.top_p must be a number in (0, 1], got 7.0"),
    "sample empty prompt": (train("sample.prompts=['']"), "sample.prompts must not contain empty strings"),
    "sample prompt too long": (
        train("run_dir={root}/long_prompt", f"sample.prompts=['{'x' * 40}']"),
        "sample.prompts[0] has 40 tokens, more than the model's max_seq_len=32",
    ),
    "rl unknown env": (
        ["train", str(RL_CONFIGS / "ppo_cartpole.yaml"), "env.id=CartPol-v1"],
        "env.id: unknown environment 'CartPol-v1'. Did you mean 'CartPole-v1'?",
    ),
    "rl algo cannot train env": (
        ["train", str(RL_CONFIGS / "dqn_cartpole.yaml"), "env.id=Pendulum-v1"],
        "algo 'dqn' needs discrete actions",
    ),
    "rl multi-agent option": (
        ["train", str(RL_CONFIGS / "ippo_simple_spread.yaml"), "ppo.normalize_rewards=true"],
        "ppo.normalize_rewards is not supported for multi-agent training",
    ),
    "rl flatten a multi-agent env": (
        ["train", str(RL_CONFIGS / "ippo_simple_spread.yaml"), "env.flatten_observation=true"],
        "env.flatten_observation: FlattenObservation: SimpleSpread() is a multi-agent environment",
    ),
    "rl dict observations": (
        ["train", str(RL_CONFIGS / "dqn_cartpole.yaml"), "env.id=KeyDoorMaze-v0"],
        "algo 'dqn' needs observations that are one array; env.id 'KeyDoorMaze-v0' gives Dict(",
    ),
    "rl torso does not fit the observations": (
        ["train", str(RL_CONFIGS / "ppo_cartpole.yaml"), "env.id=Breakout-MinAtar"],
        "ppo.policy.torso 'mlp' takes observations of 1 dimension(s) ([obs_dim]); env.id 'Breakout-MinAtar' gives",
    ),
    "rl resume": (["train", str(RL_CONFIGS / "ppo_cartpole.yaml"), "run_dir={root}/rl", "--resume"], "cannot --resume"),
    "eval no run dir": (["eval", "{root}/nowhere"], "nowhere is neither an Ember run directory"),
    "eval an RL option with an LM": (
        ["eval", "{root}/existing", "--text", "{root}/short.txt", "--episodes", "5", "--gif", "{root}/x.gif"],
        "--episodes, --gif apply to RL run directories; ",
    ),
    "eval an LM option with an RL run": (
        ["eval", "{root}/policy", "--text", "{root}/short.txt"],
        "--text applies to language models; ",
    ),
    "eval missing text": (["eval", "{root}/existing", "--text", "{root}/nowhere.txt"], "--text: no such file: "),
    "eval text shorter than a window": (
        ["eval", "{root}/existing", "--text", "{root}/short.txt", "--seq-len", "16"],
        "short.txt has 5 tokens, fewer than one window of 17; give a longer text with --text",
    ),
    "eval window past the model's context": (
        ["eval", "{root}/existing", "--text", "{root}/short.txt"],
        "seq_len (128) exceeds the model's max_seq_len (32); give --seq-len 32 or less",
    ),
    "eval bad max windows": (["eval", "{root}/existing", "--max-windows", "0"], "--max-windows must be a positive"),
    "generate bad budget": (
        ["generate", "--checkpoint", "{root}/existing", "--prompt", "hi", "--token-budget", "0"],
        "--token-budget must be a positive integer",
    ),
    "generate out is a directory": (
        ["generate", "--checkpoint", "{root}/existing", "--prompts", "{root}/in.jsonl", "--out", "{root}"],
        " is a directory; give the path of the JSONL file to write",
    ),
    "generate weights that do not fit the config": (
        ["generate", "--checkpoint", "{root}/existing", "--prompt", "hi"],
        'existing do not fit the model its config describes: Could not find parameter named "embedding"',
    ),
    "export weights that do not fit the config": (
        ["export", "{root}/wider", "{root}/wider_artifact"],
        'wider do not fit the model its config describes: Could not find parameter named "embedding"',
    ),
    "generate artifact with step": (
        ["generate", "--artifact", "{root}/artifact", "--prompt", "hi", "--step", "1"],
        "--step applies to --checkpoint, not to an exported --artifact",
    ),
    "generate artifact with max context": (
        ["generate", "--artifact", "{root}/artifact", "--prompt", "hi", "--max-context", "16"],
        "--max-context applies to --checkpoint, not to an exported --artifact",
    ),
    "generate artifact with num slots": (
        ["generate", "--artifact", "{root}/artifact", "--prompt", "hi", "--num-slots", "4"],
        "--num-slots applies to --checkpoint, not to an exported --artifact",
    ),
    "plot unknown metric": (["plot", "{root}/plotted", "--metrics", "reward"], "no values for metric(s) reward"),
    "data missing file": (["data", "prepare", "{root}/nowhere.txt", "--out", "{root}/d"], "not a file: "),
    "data out is a file": (["data", "prepare", "{root}/lm.yaml", "--out", "{root}/lm.yaml"], "File exists"),
    "train kind not a name": (train("kind=[lm]"), "unknown config kind ['lm']; known kinds:"),
    "rl env param of the wrong type": (
        ["train", str(RL_CONFIGS / "ppo_cartpole.yaml"), "env.params.max_steps_in_episode=abc"],
        "env.params.max_steps_in_episode: CartPole-v1: parameter max_steps_in_episode expects int",
    ),
    "envs bad max steps": (
        ["envs", "show", "CartPole-v1", "--out", "{root}/x.gif", "--max-steps", "0"],
        "--max-steps must be >= 1",
    ),
}


def expand(argv, root):
    return [arg.format(root=root) for arg in argv]


TRAINS = {"non-finite loss"}  # compiles and runs a step: marked slow


@pytest.mark.parametrize(
    "case",
    [pytest.param(case, marks=pytest.mark.slow) if case in TRAINS else case for case in sorted(SUBPROCESS_FAILURES)],
)
def test_user_error_prints_one_line_and_exits_2(case, workspace):
    argv, expected = SUBPROCESS_FAILURES[case]
    argv = expand(argv, workspace)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "ember", *argv], capture_output=True, text=True, env=env, cwd=workspace, timeout=300
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[0].startswith(f"ember {argv[0]}: ") and expected in lines[0], lines[0]


# The warnings a Python process hides by default (DeprecationWarning is shown only when raised
# by ``__main__``: in ``python -m ember`` that is the one line calling ``main``).
HIDDEN_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


@pytest.mark.parametrize("case", sorted(IN_PROCESS_FAILURES))
def test_user_error_in_process_prints_one_line_and_returns_2(case, workspace, capfd, caplog, monkeypatch):
    """What a subprocess would print on stderr is checked here too: all this process writes to
    file descriptor 2 (XLA's C++ messages included), the warnings Python shows by default (pytest
    records them instead) and log records at WARNING and up (which logging's last-resort handler
    would print; pytest's handlers take them)."""
    argv, expected = IN_PROCESS_FAILURES[case]
    argv = expand(argv, workspace)
    monkeypatch.chdir(workspace)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(argv)  # an exception other than an EmberError would propagate out of main
    stderr = capfd.readouterr().err
    assert code == 2, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[0].startswith(f"ember {argv[0]}: ") and expected in lines[0], lines[0]
    assert [str(w.message) for w in caught if not issubclass(w.category, HIDDEN_WARNINGS)] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_usage_errors_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as info:
        main(["eval", "runs/x", "--episodes", "many"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "ember eval: argument --episodes: invalid int value: 'many' (see 'ember eval --help')"
    ]


@pytest.mark.slow  # two short trainings
def test_flags_stand_anywhere_among_the_overrides(workspace, capsys):
    """``ember train CONFIG k=v --resume k=v``: both overrides apply and the run resumes."""
    config, run_dir = workspace / "lm.yaml", workspace / "resumed"
    assert main(["train", str(config), f"run_dir={run_dir}", "train.steps=1"]) == 0
    assert main(["train", str(config), f"run_dir={run_dir}", "--resume", "train.steps=2"]) == 0
    capsys.readouterr()
    assert [record["step"] for record in read_metrics(run_dir) if "loss" in record] == [1, 2]
    assert load_config(LMConfig, run_dir / "config.yaml").train.steps == 2

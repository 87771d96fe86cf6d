"""`ember train` on an RL config, `ember eval` and `ember plot` on the run directory it writes."""

import json
from pathlib import Path

import numpy as np
from PIL import Image

from ember.cli import main
from ember.core.config import load_config
from ember.training.metrics import read_metrics
from ember.training.rl.config import RLConfig
from tests.tolerances import assert_allclose

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "rl" / "ppo_cartpole.yaml"


def test_train_eval_plot_round_trip(tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", "ppo.total_timesteps=2560", "ppo.policy.hidden_sizes=[16]", "eval.episodes=8"]
    assert main(["train", str(CONFIG), *overrides]) == 0
    capsys.readouterr()

    config = load_config(RLConfig, run_dir / "config.yaml")
    assert config.ppo.total_timesteps == 2560 and config.ppo.policy.hidden_sizes == (16,)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [512 * (u + 1) for u in range(5)]
    assert all(np.isfinite(r["loss"]) for r in records)
    # episodes ended in the first update of CartPole from a random policy (~20 steps long)
    assert records[0]["episodes"] > 0 and records[0]["episode_length"] == records[0]["episode_return"]
    assert any((run_dir / "tensorboard").iterdir())

    saved = json.loads((run_dir / "eval.json").read_text())
    assert saved["episodes"] == 8 and 1.0 <= saved["mean_return"] <= 500.0
    # the checkpointed policy, evaluated again with the same seed, gives the same returns
    assert main(["eval", str(run_dir), "--episodes", "8", "--seed", str(config.seed + 1), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert_allclose(again["mean_return"], saved["mean_return"])

    gif = tmp_path / "episode.gif"
    assert main(["eval", str(run_dir), "--episodes", "1", "--gif", str(gif)]) == 0
    frames = int(capsys.readouterr().out.split("(")[-1].split()[0])
    with Image.open(gif) as image:
        assert frames > 1 and 1 <= image.n_frames <= frames  # Pillow merges identical consecutive frames

    assert main(["plot", str(run_dir), "--metrics", "episode_return", "--out", str(tmp_path / "curves.png")]) == 0
    with Image.open(tmp_path / "curves.png") as image:
        assert image.format == "PNG" and image.size[0] > 100


def test_train_rejects_unknown_keys_with_a_suggestion(tmp_path, capsys):
    assert main(["train", str(CONFIG), f"run_dir={tmp_path}", "ppo.num_env=8"]) == 2
    assert "ppo.num_envs" in capsys.readouterr().err

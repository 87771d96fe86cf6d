"""`ember train` on an RL config, `ember eval` and `ember plot` on the run directory it writes."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image

import ember.envs
from ember.cli import main
from ember.core.checkpoint import CheckpointManager
from ember.core.config import load_config, to_yaml
from ember.core.errors import ConfigError, EmberError
from ember.envs.wrappers import TimeLimit
from ember.training.metrics import read_metrics
from ember.training.rl import config as rl_config
from ember.training.rl import eval_command, multi_agent_ppo
from ember.training.rl import evaluate as evaluate_module
from ember.training.rl import experiment as runner
from ember.training.rl.agent_view import stack_agents
from ember.training.rl.config import RLConfig
from ember.training.rl.evaluate import evaluate
from ember.training.rl.experiment import evaluate_params, load_run
from ember.training.rl.ppo import make_act, make_policy
from tests.tolerances import assert_allclose

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "rl"
CONFIG = CONFIGS / "ppo_cartpole.yaml"


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
    assert load_run(run_dir)[2] is None  # no observation statistics saved without normalize_observations

    gif = tmp_path / "episode.gif"
    assert main(["eval", str(run_dir), "--episodes", "1", "--gif", str(gif)]) == 0
    frames = int(capsys.readouterr().out.split("(")[-1].split()[0])
    with Image.open(gif) as image:
        assert frames > 1 and 1 <= image.n_frames <= frames  # Pillow merges identical consecutive frames

    assert main(["plot", str(run_dir), "--metrics", "episode_return", "--out", str(tmp_path / "curves.png")]) == 0
    with Image.open(tmp_path / "curves.png") as image:
        assert image.format == "PNG" and image.size[0] > 100


def test_a_rerun_replaces_a_stopped_attempts_metrics_and_finishes_a_stopped_evaluation(tmp_path, monkeypatch):
    """Into the run_dir of an attempt stopped before its checkpoint, a run appended its metrics to
    the stopped attempt's (each update logged twice); a run stopped in its final evaluation could
    not be rerun ("already holds a finished run") and had no eval.json. Now the first starts afresh
    and the second evaluates the saved policy, with this config only."""
    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", "ppo.total_timesteps=1024", "ppo.policy.hidden_sizes=[8]", "eval.episodes=2"]
    config = load_config(RLConfig, CONFIG, overrides)
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 512, "update": 1}\n{"step": 1024, "update": 2}\n')

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(runner, "evaluate_params", stopped)
        with pytest.raises(KeyboardInterrupt):
            runner.run_experiment(config, progress=False)
    assert [r["step"] for r in read_metrics(run_dir)] == [512, 1024]
    assert "loss" in read_metrics(run_dir)[0] and not (run_dir / "eval.json").exists()

    other = load_config(RLConfig, CONFIG, [*overrides, "seed=7"])
    with pytest.raises(EmberError, match="another config"):
        runner.run_experiment(other, progress=False)
    summary = runner.run_experiment(config, progress=False)
    assert json.loads((run_dir / "eval.json").read_text())["mean_return"] == summary["mean_return"]
    assert [r["step"] for r in read_metrics(run_dir)] == [512, 1024]  # evaluated, not trained again
    with pytest.raises(EmberError, match="already holds a finished run"):
        runner.run_experiment(config, progress=False)


def test_train_rejects_unknown_keys_with_a_suggestion(tmp_path, capsys):
    assert main(["train", str(CONFIG), f"run_dir={tmp_path}", "ppo.num_env=8"]) == 2
    assert "ppo.num_envs" in capsys.readouterr().err


def test_every_algo_a_config_accepts_is_one_the_runner_trains():
    assert set(runner.ALGORITHMS) == set(rl_config.ALGORITHMS) == set(rl_config.SECTION_OF)
    config = RLConfig()
    for algo, section in rl_config.SECTION_OF.items():
        assert runner.ALGORITHMS[algo].section(config) is getattr(config, section)


def test_train_rejects_settings_of_the_section_algo_does_not_read(tmp_path, capsys):
    assert main(["train", str(CONFIG), f"run_dir={tmp_path}", "algo=dqn", "ppo.normalize_observations=true"]) == 2
    assert "algo 'dqn' reads the dqn: section, not ppo:" in capsys.readouterr().err


def test_observation_statistics_are_saved_and_evaluated_frozen(tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = [
        f"run_dir={run_dir}",
        "ppo.normalize_observations=true",
        "ppo.num_steps=32",
        "ppo.total_timesteps=1024",
        "ppo.update_epochs=2",
        "ppo.policy.hidden_sizes=[16]",
        "eval.episodes=4",
    ]
    assert main(["train", str(CONFIGS / "ppo_pendulum.yaml"), *overrides]) == 0
    capsys.readouterr()
    saved = json.loads((run_dir / "eval.json").read_text())

    config, params, stats = load_run(run_dir)
    assert config.ppo.normalize_observations
    # shared by the 16 envs through NormalizeReward (the config normalises rewards too): their
    # resets and 2 updates of 32 steps
    assert_allclose(stats.count, 1e-4 + 16 * (1 + 2 * 32))
    # the restored policy evaluates as the in-process one did (eval.json, same seed) ...
    assert main(["eval", str(run_dir), "--episodes", "4", "--seed", str(config.seed + 1), "--json"]) == 0
    assert_allclose(json.loads(capsys.readouterr().out)["mean_return"], saved["mean_return"])
    # ... which is the policy on observations normalised by hand with the frozen statistics
    env, env_params = ember.envs.make(config.env.id)
    raw_act = make_act(make_policy(config.ppo, env, env_params), params)
    mean, std = np.asarray(stats.mean), np.sqrt(np.asarray(stats.var) + 1e-8)
    returns, _ = evaluate(
        lambda obs, key: raw_act((obs - mean) / std, key), env, env_params, jax.random.key(config.seed + 1), 4
    )
    assert_allclose(returns.mean(), saved["mean_return"], scale=10)  # float32 sums of 200 rewards
    unnormalised = evaluate_params(config, params, 4, seed=config.seed + 1)
    assert not np.isclose(unnormalised["mean_return"], saved["mean_return"])
    # evaluating wrote nothing back
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), load_run(run_dir)[2], stats)

    # a second evaluation of the restored policy reuses the program 'ember eval' compiled (equal
    # configs give one environment object; parameters are traced)
    compiled = evaluate_module._run._cache_size()
    evaluate_params(config, params, 4, seed=config.seed + 2, obs_stats=stats)
    assert evaluate_module._run._cache_size() == compiled

    # a checkpoint without statistics (saved before they existed) under a config asking for them
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    with CheckpointManager(old / "checkpoints") as manager:
        manager.save(1, {"params": params})
    with pytest.raises(EmberError, match="obs_stats"):
        load_run(old)


def test_multi_agent_observation_statistics_are_saved_and_evaluated_frozen(tmp_path, capsys):
    """A mappo run with ``ppo.normalize_observations`` (refused before) saves the agents'
    statistics, and ``ember eval`` applies them frozen: the saved policy evaluates as the plain
    policy on observations normalised by hand."""
    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", "ppo.normalize_observations=true", "ppo.num_envs=4", "ppo.num_steps=16",
                 "ppo.total_timesteps=128", "ppo.num_minibatches=2", "ppo.update_epochs=1",
                 "ppo.policy.hidden_sizes=[8]", "eval.episodes=4"]  # fmt: skip
    assert main(["train", str(CONFIGS / "mappo_simple_spread.yaml"), *overrides]) == 0
    capsys.readouterr()
    saved = json.loads((run_dir / "eval.json").read_text())
    config, params, stats = load_run(run_dir)
    # every agent's observations (3 agents in 4 environments: reset and 2 updates of 16 steps);
    # simple_spread has no global state
    assert_allclose(stats.agents.count, 1e-4 + 4 * 3 * (1 + 2 * 16))
    assert stats.agents.mean.shape == (18,) and stats.global_state is None
    assert main(["eval", str(run_dir), "--episodes", "4", "--seed", str(config.seed + 1), "--json"]) == 0
    assert_allclose(json.loads(capsys.readouterr().out)["mean_return"], saved["mean_return"])
    env, env_params = ember.envs.make_from_config(config.env)
    plain = multi_agent_ppo.make_act(multi_agent_ppo.make_policy(config.ppo, env, env_params), params, env.agents)
    mean, std = np.asarray(stats.agents.mean), np.sqrt(np.asarray(stats.agents.var) + 1e-8)
    returns, _ = evaluate(
        lambda obs, key: plain({agent: (o - mean) / std for agent, o in obs.items()}, key),
        env,
        env_params,
        jax.random.key(config.seed + 1),
        4,
    )
    assert_allclose(returns.mean(), saved["mean_return"], scale=10)
    assert not np.isclose(evaluate_params(config, params, 4, seed=config.seed + 1)["mean_return"], saved["mean_return"])

    # the documented checkpoint format with a global state (SMAX's) restores, and one without
    # statistics under a config asking for them is refused
    for name, obs_stats in [("state", {"agents": {"mean": mean, "var": std, "count": 5.0},
                                       "global_state": {"mean": mean[:7], "var": std[:7], "count": 2.0}}),
                            ("old", None)]:  # fmt: skip
        other = tmp_path / name
        other.mkdir()
        (other / "config.yaml").write_text((run_dir / "config.yaml").read_text())
        with CheckpointManager(other / "checkpoints") as manager:
            manager.save(1, {"params": params} | ({"obs_stats": obs_stats} if obs_stats else {}))
    restored = load_run(tmp_path / "state")[2]
    np.testing.assert_array_equal(restored.agents.mean, mean)
    np.testing.assert_array_equal(restored.global_state.var, std[:7])
    assert float(restored.global_state.count) == 2.0
    with pytest.raises(EmberError, match="obs_stats"):
        load_run(tmp_path / "old")


def test_record_episode_of_a_multi_agent_run(rng):
    """``ember eval RUN_DIR --gif`` of an ippo/mappo run: the episode ends with ``"__all__"``."""
    overrides = ["env.params.max_steps_in_episode=5", "ppo.policy.hidden_sizes=[8]"]
    config = load_config(RLConfig, CONFIGS / "ippo_simple_spread.yaml", overrides)
    env, env_params = ember.envs.make_from_config(config.env)
    reset = jax.jit(env.reset)  # one compile for both resets: eager ones compile op by op
    _, state = reset(jax.random.split(jax.random.key(7))[0], env_params)  # record_episode's reset
    obs = stack_agents(jax.tree.map(lambda o: o[None], reset(rng, env_params)[0]), env.agents)
    params = multi_agent_ppo.make_policy(config.ppo, env, env_params).init(rng, obs, obs)
    frames = runner.record_episode(config, params, seed=7)
    assert frames.shape[0] == 5  # one frame per step, up to the time limit
    np.testing.assert_array_equal(frames[0], jax.jit(env.render)(state, env_params))
    # another recording of the policy (another seed, the parameters perturbed) runs the same program
    compiled = evaluate_module._record._cache_size()
    perturbed = jax.tree.map(lambda p: p + 0.1, params)
    assert runner.record_episode(config, perturbed, seed=8).shape == frames.shape
    assert evaluate_module._record._cache_size() == compiled


def test_record_episode_of_an_environment_without_render_is_a_config_error(tmp_path, monkeypatch, capsys):
    """``ember eval RUN_DIR --gif`` of a gymnax-source run raised a bare NotImplementedError,
    after evaluating; the CLI now refuses before it evaluates."""
    config = load_config(RLConfig, CONFIG, ["env.source=gymnax", "ppo.policy.hidden_sizes=[8]"])
    with pytest.raises(ConfigError, match="no render") as raised:
        runner.record_episode(config, None, seed=0)
    assert raised.value.key == "env.source"
    (tmp_path / "config.yaml").write_text(to_yaml(config))
    with CheckpointManager(tmp_path / "checkpoints") as manager:
        manager.save(1, {"params": {"w": np.zeros(2, np.float32)}})
    monkeypatch.setattr(eval_command, "evaluate_params", lambda *args, **kwargs: pytest.fail("evaluated first"))
    assert main(["eval", str(tmp_path), "--gif", str(tmp_path / "out.gif")]) == 2
    assert "has no render" in capsys.readouterr().err


def test_evaluate_runs_episodes_to_a_longer_time_limit_wrapper(rng):
    env, params = ember.envs.make("Pendulum-v1", max_steps_in_episode=4)  # Pendulum never terminates

    def act(obs, key):
        return jax.random.uniform(key, (obs.shape[0], 1), minval=-2.0, maxval=2.0)

    for limit in (9, 2):  # the wrapper's limit applies whether it is longer or shorter than the params'
        _, lengths = evaluate(act, TimeLimit(env, limit), params, rng, num_episodes=3)
        np.testing.assert_array_equal(lengths, [limit] * 3)

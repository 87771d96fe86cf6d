"""``ember envs list`` / ``ember envs show`` and ``save_gif`` (frames read back with Pillow)."""

import re

import jax
import numpy as np
import pytest
from PIL import Image

import ember.envs
from ember.cli import main
from ember.core.registry import Registry
from ember.envs import registry
from ember.envs.mpe.simple_spread import SimpleSpread


def test_envs_list_prints_every_registered_id(capsys):
    assert main(["envs", "list"]) == 0
    assert capsys.readouterr().out.split() == ember.envs.registered()


def test_envs_show_writes_the_episode_as_a_gif(tmp_path, capsys):
    out = tmp_path / "cartpole.gif"
    assert main(["envs", "show", "CartPole-v1", "--out", str(out), "--seed", "3", "--max-steps", "60"]) == 0
    printed = capsys.readouterr().out
    env, params = ember.envs.make("CartPole-v1")
    _, first_state = jax.jit(env.reset)(jax.random.fold_in(jax.random.key(3), 0), params)
    written = int(re.search(r"wrote (\d+) frames", printed).group(1))
    assert 1 < written < 60, "a random policy drops the pole well before 60 steps"
    with Image.open(out) as gif:
        # Pillow stores a run of identical frames once, its duration the run's (GIF counts centiseconds).
        durations = []
        for index in range(gif.n_frames):
            gif.seek(index)
            durations.append(gif.info["duration"])
        assert sum(durations) == written * min(durations)
        gif.seek(0)
        np.testing.assert_array_equal(np.asarray(gif.convert("RGB")), jax.jit(env.render)(first_state, params))
    assert main(["envs", "show", "CartPol-v1", "--out", str(out)]) == 2
    assert "Did you mean 'CartPole-v1'" in capsys.readouterr().err


class SpreadEndingAtStep3(SimpleSpread):
    """simple_spread whose episodes terminate (not truncate) after 3 steps."""

    def step_env(self, noise, state, actions, params):
        obs, next_state, rewards, _, info = super().step_env(noise, state, actions, params)
        return obs, next_state, rewards, state.time + 1 >= 3, info


def test_envs_show_ends_a_multi_agent_episode_at_its_termination(tmp_path, capsys, monkeypatch):
    environments = Registry("environment")
    environments.register("MPE-ends-at-3", SpreadEndingAtStep3)
    monkeypatch.setattr(registry, "ENVIRONMENTS", environments)
    out = tmp_path / "spread.gif"
    assert main(["envs", "show", "MPE-ends-at-3", "--out", str(out), "--max-steps", "10"]) == 0
    # terminated["__all__"] after step 3, well before the time limit (25) and --max-steps
    assert "wrote 3 frames" in capsys.readouterr().out


def test_save_gif_rejects_bad_frames(tmp_path, rng):
    frames = np.asarray(jax.random.randint(rng, (3, 8, 8, 3), 0, 256)).astype(np.uint8)
    path = ember.envs.save_gif(frames, tmp_path / "noise.gif", fps=10)
    with Image.open(path) as gif:
        assert gif.n_frames == 3 and gif.size == (8, 8)
    with pytest.raises(ValueError, match="uint8"):
        ember.envs.save_gif(frames.astype(np.float32), tmp_path / "x.gif")
    with pytest.raises(ValueError, match="time, height, width, 3"):
        ember.envs.save_gif(frames[0], tmp_path / "x.gif")
    # A GIF whatever the path's suffix: before, "episode" (no suffix) raised Pillow's "unknown file
    # extension" and "episode.png" wrote an animated PNG.
    for name in ("episode", "episode.png"):
        written = ember.envs.save_gif(frames, tmp_path / name)
        assert written.read_bytes()[:6] == b"GIF89a"

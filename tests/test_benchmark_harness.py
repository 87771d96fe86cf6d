"""benchmarks/harness.py: timing and the results file."""

import json

import jax
import jax.numpy as jnp

from benchmarks import harness


def test_time_fn_and_results_file(tmp_path, monkeypatch):
    f = jax.jit(lambda x: (x @ x).sum())
    seconds = harness.time_fn(f, jnp.ones((64, 64)), repeats=3)
    assert 0 < seconds < 5
    assert harness.device_label() == "cpu" and not harness.on_gpu() and not harness.on_tpu()
    assert not harness.on_accelerator()
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    path = harness.write_results("unit", {"rows": [{"seconds": seconds}]})
    record = json.loads(path.read_text())
    assert path.name == "unit-cpu.json"
    assert (
        record["device"] == "cpu" and record["system"]["backend"] == "cpu" and record["rows"][0]["seconds"] == seconds
    )
    assert record["date"][:2] == "20"

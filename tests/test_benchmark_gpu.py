"""benchmarks/gpu.py, the GPU session's one command, run at toy sizes on CPU (kernels in the
Pallas interpreter) so that it cannot rot between GPU sessions."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import gpu, harness, triton_compile, triton_lowering
from benchmarks.device_checks import (
    GPU_CHECK_SIZES,
    KERNEL_CHECKS,
    RELATIVE_ERROR_LIMITS,
    TOY_CHECK_SIZES,
    KernelCheck,
    Problem,
    run_check,
)
from tests.once_per_session import build_once
from tests.xla_settings import subprocess_xla_flags

REPO = Path(__file__).resolve().parents[1]


# Both differ from the toy preset's (configs/models/tiny.yaml: no remat, layers unrolled). The
# scanned step compiles faster at toy sizes (2.9 s against 4.6 s for the measurement).
TRAIN_OVERRIDES = ("remat=dots", "scan_layers=true")


@pytest.fixture(scope="module")
def toy_record(tmp_path_factory):
    """The JSON record of one ``python -m benchmarks.gpu --toy`` run (once per session), its
    training step given :data:`TRAIN_OVERRIDES`. A subprocess, so it gets one CPU device and
    XLA's backend optimizations off (compile time dominates at toy sizes and they buy nothing
    there; tests/xla_settings.py)."""

    def run(results_dir):
        flags = subprocess_xla_flags("--xla_backend_optimization_level=0")
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
        command = [sys.executable, "-m", "benchmarks.gpu", "--toy", "--results-dir", str(results_dir), "--seed", "11"]
        command += ["--train-overrides", *TRAIN_OVERRIDES]
        done = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    files = list(build_once(tmp_path_factory, "gpu-toy-results", run).iterdir())
    assert [f.name for f in files] == ["gpu-cpu.json"]
    return json.loads(files[0].read_text())


def test_every_kernel_passes_its_device_check_with_compared_values(toy_record):
    checks = toy_record["device_value_checks"]
    assert set(checks) == {f"{check.name} float32" for check in KERNEL_CHECKS}
    for name, record in checks.items():
        assert record["passed"], (name, record.get("error"))
        errors = record["relative_errors"]
        assert errors and record["max_relative_error"] == max(errors.values()), name
        # Interpreted kernels in float32 agree with their references to rounding, not exactly.
        assert all(0.0 <= e < 1e-5 for e in errors.values()), (name, errors)
        assert 0.0 < record["max_relative_error"], name
    flash = checks["flash_attention[causal,segments] float32"]["relative_errors"]
    assert set(flash) == {"out", "dq", "dk", "dv"}
    ssd = checks["ssd[groups,D,dt_bias,state] float32"]["relative_errors"]
    assert {"out[0]", "out[1]", "dx", "dB", "dC", "dA", "ddt"} <= set(ssd)


def test_every_measurement_gives_rows_and_every_goal_a_ratio(toy_record):
    rows = toy_record["rows"]
    for measurement in gpu.MEASUREMENTS:
        produced = [r for r in rows if r["measurement"] == measurement.name]
        if measurement.name.startswith("dense_sweep"):  # the toy sizes sweep no further lengths
            assert produced == []
            continue
        assert produced, measurement.name
        for row in produced:
            assert not [k for k in row if k in ("error", "skipped") or k.endswith("_error")], row
    dense = next(r for r in rows if r["section"] == "dense")
    assert dense["ours_fwd_tflops"] > 0 and dense["fwd_speedup_vs_xla"] > 0 and dense["xla_rel_diff"] < 1e-5
    goals = toy_record["goals"]
    assert len(goals) == 7 + 2 * len([b for b in gpu.TOY_SIZES.quantized_decode[2] if b <= 16])  # + int8/int4 decode
    for name, goal in goals.items():
        if name.endswith("_mfu"):  # no peak FLOP/s is known for a CPU
            assert goal["value"] is None and goal["met"] is None
        else:
            assert goal["value"] > 0 and goal["met"] == (goal["value"] >= goal["target"]), name


def test_a_failing_kernel_records_its_error_and_does_not_raise():
    def broken(sizes, dtype, gen):
        raise RuntimeError("Triton lowering failed: unsupported op")

    record = run_check(KernelCheck("broken", broken), TOY_CHECK_SIZES, "float32", seed=0)
    assert record["passed"] is False
    assert record["error"] == "RuntimeError: Triton lowering failed: unsupported op"
    assert "broken" in record["traceback"] and record["limit"] == RELATIVE_ERROR_LIMITS["float32"]


@pytest.mark.parametrize("factor, expected", [(1.01, 0.01), (np.nan, math.inf)])
def test_a_wrong_or_non_finite_kernel_fails_its_check(factor, expected):
    def wrong(sizes, dtype, gen):
        scale = jnp.where(jnp.arange(64) == 3, factor, 1.01)
        return Problem(lambda x: x * scale, lambda x: x, {"x": jnp.asarray(gen.standard_normal(64), dtype)})

    record = run_check(KernelCheck("wrong", wrong), TOY_CHECK_SIZES, "float32", seed=0)
    assert record["passed"] is False and set(record["relative_errors"]) == {"out", "dx"}
    for error in record["relative_errors"].values():
        assert error == expected if math.isinf(expected) else math.isclose(error, expected, rel_tol=1e-4)


def test_goals_without_rows_are_unmeasured():
    goals = gpu.goals([], gpu.TOY_SIZES)
    assert all(goal["value"] is None and goal["met"] is None for goal in goals.values())
    assert np.isclose(goals[next(k for k in goals if k.startswith("flash_fwd"))]["target"], 0.8)


@pytest.mark.parametrize(
    "check, kernels",
    [
        ("flash_attention[causal,segments]", 3),  # forward, dq, dk/dv
        ("grouped_matmul[group_offset,empty,skewed,tail_rows]", 3),  # gmm, gmm against rhs^T, tgmm
        # state pass, outputs; state gradient pass, dv, dq/dk
        ("linear_attention[normalize,decay,state,segments]", 5),
    ],
)
def test_kernels_lower_to_triton_without_a_gpu(check, kernels):
    """The Pallas-to-Triton lowering of a kernel's forward and backward runs on CPU. (Only
    the kernels passing Triton compiler parameters here: on jax 0.10 the others lower through
    Mosaic GPU; ``python -m benchmarks.triton_lowering`` on jax 0.11 checks all.)"""
    sizes = dataclasses.replace(GPU_CHECK_SIZES, dtypes=("bfloat16",))
    results = triton_lowering.lower_all(sizes, only=(check,))
    assert results == {f"{check} bfloat16": {"lowered": True, "triton_kernels": kernels}}


def test_benchmark_shapes_lower_with_the_launch_options_compiled_without_spills():
    """The calls the GPU command times lower to Triton kernels here (jax 0.10 too), with the
    warps and stages ``python -m benchmarks.triton_compile --benchmark-shapes`` compiled for
    sm_90 without register spills (2026-11-27); a change of defaults shows up here."""
    launches = {}
    with triton_lowering.pretend_gpu():
        for label, fn, args in triton_compile.benchmark_shapes():
            with triton_compile.captured_kernels() as kernels:
                jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
            launches.setdefault(label.split(" ")[0], set()).update(
                (kernel.name, kernel.num_warps, kernel.num_stages) for kernel in kernels
            )
    assert launches["flash"] == {
        ("flash_attention_forward", 8, 2),
        ("flash_attention_dq", 8, 2),
        ("flash_attention_dkv", 8, 2),
    }
    assert launches["linear"] == {
        ("linear_attention_state_pass", 8, 2),
        ("linear_attention_outputs", 4, 1),
        ("linear_attention_state_gradient_pass", 8, 2),
        ("linear_attention_value_gradients", 8, 1),
        ("linear_attention_query_key_gradients", 8, 2),
    }
    assert launches["grouped"] == {
        ("grouped_matmul", 8, 4),
        ("grouped_matmul_transposed_rhs", 8, 4),
        ("grouped_matmul_tgmm", 8, 4),
    }
    assert launches["ragged"] == {("ragged_paged_attention", 4, 3)}
    # decode steps' 16-row tiles on 4 warps, prefills' 64-row tiles on 8
    assert launches["quantized"] == {
        (f"quantized_matmul_{fmt}", warps, 3) for fmt in ("int8", "int4", "nf4") for warps in (4, 8)
    }


def test_kept_results_carry_their_origin_and_refuse_another_device():
    previous = dict(
        device="h200",
        toy=False,
        date="2026-11-26T23:59:00+00:00",
        seed=7,
        device_value_checks={
            "ssd bfloat16": {"passed": True, "max_relative_error": 0.007},
            "older bfloat16": {"passed": True, "checked_on": "2026-11-25T10:00:00+00:00", "checked_with_seed": 3},
        },
        hopper_value_checks={"hopper bfloat16": {"passed": False}},
        rows=[{"measurement": "ssd", "fwd_ms": 1.0}, {"section": "flash_tiles", "skipped": "budget: 15 s left"}],
    )
    kept = gpu.kept_results(previous, "h200")
    assert kept["device_value_checks"] == {
        "ssd bfloat16": {
            "passed": True,
            "max_relative_error": 0.007,
            "checked_on": "2026-11-26T23:59:00+00:00",
            "checked_with_seed": 7,
        },
        # A check kept once already keeps the date and seed of the run that made it.
        "older bfloat16": {"passed": True, "checked_on": "2026-11-25T10:00:00+00:00", "checked_with_seed": 3},
    }
    assert kept["hopper_value_checks"]["hopper bfloat16"]["checked_on"] == "2026-11-26T23:59:00+00:00"
    assert kept["rows"] == [{"measured_on": "2026-11-26T23:59:00+00:00", "measurement": "ssd", "fwd_ms": 1.0}]
    with pytest.raises(ValueError, match="h100"):
        gpu.kept_results(previous, "h100")
    with pytest.raises(ValueError, match="toy"):
        gpu.kept_results(dict(previous, toy=True), "h200")


def test_a_partial_run_keeps_the_rows_it_does_not_repeat(tmp_path):
    """--keep-from: the measurements this run times replace the earlier record's rows; the
    others' rows and every check stand, marked with the earlier run's date. Given a folder,
    it reads the file of this run's device, and keeps nothing where there is none."""
    device = harness.device_label()
    previous = dict(
        device=device,
        toy=False,
        date="2026-11-26T23:59:00+00:00",
        seed=7,
        device_value_checks={"ssd bfloat16": {"passed": True}},
        rows=[{"measurement": "ceilings", "section": "ceilings", "stale": True}, {"measurement": "ssd", "fwd_ms": 1.0}],
    )
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / f"gpu-{device}.json").write_text(json.dumps(previous))
    assert gpu.previous_record(tmp_path / "results", "another-device") is None
    out = tmp_path / "out"
    gpu.main(
        [
            "--toy",
            "--skip",
            "checks",
            "--only",
            "ceilings",
            "--results-dir",
            str(out),
            "--keep-from",
            str(tmp_path / "results"),
        ]
    )
    record = json.loads((out / f"gpu-{device}.json").read_text())
    assert record["device_value_checks"]["ssd bfloat16"]["checked_on"] == previous["date"]
    ceilings = [row for row in record["rows"] if row["measurement"] == "ceilings"]
    assert ceilings and not any(row.get("stale") or "measured_on" in row for row in ceilings)
    assert [row for row in record["rows"] if row["measurement"] == "ssd"] == [
        {"measured_on": previous["date"], "measurement": "ssd", "fwd_ms": 1.0}
    ]


def test_only_runs_the_named_measurements_in_order_and_unknown_names_are_refused(tmp_path, capsys):
    gpu.main(["--toy", "--skip", "checks", "--only", "hopper_backward", "ceilings", "--results-dir", str(tmp_path)])
    record = json.loads((tmp_path / "gpu-cpu.json").read_text())
    measured = [row["measurement"] for row in record["rows"]]
    assert list(dict.fromkeys(measured)) == ["hopper_backward", "ceilings"]  # as named, not gpu.MEASUREMENTS' order
    assert record["device_value_checks"] == {}
    # Off the GPU the Hopper backward's rows say why nothing was timed.
    backward = [row for row in record["rows"] if row["section"] == "hopper_backward"]
    assert [row["causal"] for row in backward] == [True, False]
    assert all("sm90 GPU only" in row["hopper_backward_not_run"] for row in backward)
    with pytest.raises(SystemExit):
        gpu.main(["--toy", "--only", "flash_tile"])
    assert "unknown measurement(s) ['flash_tile']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu.main(["--toy", "--train-overrides", "remat=dots", "rematt=full"])
    assert "--train-overrides: ['rematt'] are not ModelConfig fields" in capsys.readouterr().err


def test_the_training_step_runs_with_the_overrides_it_is_given(toy_record):
    (row,) = [row for row in toy_record["rows"] if row["section"] == "train_step"]
    assert (row["remat"], row["scan_layers"]) == ("dots", True)
    assert row["ember_ms"] > 0

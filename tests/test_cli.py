"""The ``ember`` command: dispatcher, --version, info."""

import json
import re
import subprocess
import sys

import jax

import ember
from ember.cli import COMMANDS, main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "ember", *args], capture_output=True, text=True, timeout=120)


def test_version_and_help_do_not_import_jax():
    code = (
        "import sys; from ember.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit: pass\n"
        "print('jax' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines() == [f"ember {ember.__version__}", "False"]
    help_text = run_cli("--help").stdout
    for name in COMMANDS:
        assert name in help_text


def test_unknown_command_suggests(capsys):
    assert main(["inf"]) == 2
    assert "unknown command 'inf'. Did you mean 'info'?" in capsys.readouterr().err


def test_info_reports_backend_devices_and_pallas(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["jax"] == jax.__version__ and info["backend"] == "cpu"
    assert info["device_count"] == jax.device_count() == len(info["devices"])
    assert set(info["pallas"]) == {"triton (GPU)", "mosaic_gpu (Hopper+)", "mosaic_tpu (TPU)"}
    assert not any(status["usable_here"] for status in info["pallas"].values())  # CPU-only here
    assert info["kernels"]["flash_attention"] == {"gpu": True, "tpu": True, "auto_here": "xla"}
    assert info["kernels"]["short_conv"] == {"gpu": False, "tpu": False, "auto_here": "xla"}
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"jax        {jax.__version__}" in text and "impl='interpret_tpu'" in text
    assert "pallas kernels (auto on cpu):" in text
    assert re.search(r"grouped_matmul +gpu, tpu +auto: xla", text)
    assert re.search(r"short_conv +none \(XLA only\) +auto: xla", text)


def test_peak_flops_known_for_accelerators_and_none_on_cpu():
    from types import SimpleNamespace

    from ember.core.system_info import peak_flops_per_device

    assert peak_flops_per_device() is None  # CPU: no MFU is reported
    assert peak_flops_per_device(SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")) == 989e12
    assert peak_flops_per_device(SimpleNamespace(device_kind="TPU v5 lite")) == 197e12
    # Before, "NVIDIA L40S" matched "l4" (121 TFLOP/s: MFU three times too high) and the PCIe H100
    # the SXM part's 989.
    assert peak_flops_per_device(SimpleNamespace(device_kind="NVIDIA L40S")) == 362e12
    assert peak_flops_per_device(SimpleNamespace(device_kind="NVIDIA L40")) == 181e12
    assert peak_flops_per_device(SimpleNamespace(device_kind="NVIDIA L4")) == 121e12
    assert peak_flops_per_device(SimpleNamespace(device_kind="NVIDIA H100 PCIe")) == 756e12


def test_train_list_prints_paths_that_ember_train_accepts(tmp_path, monkeypatch, capsys):
    # Before, the paths were relative to the checkout ("configs/lm/tiny.yaml") wherever the
    # command ran: outside the checkout 'ember train <a listed path>' said "config file not found".
    from pathlib import Path

    from ember.training.launcher import shipped_configs_dir

    for directory, relative in ((tmp_path, False), (shipped_configs_dir().parent, True)):
        monkeypatch.chdir(directory)
        assert main(["train", "--list"]) == 0
        printed = capsys.readouterr().out.splitlines()
        paths = [line.split()[0] for line in printed]
        assert "lm/tiny.yaml" in {"/".join(Path(path).parts[-2:]) for path in paths}
        assert all(Path(path).is_file() for path in paths), paths
        assert all(not Path(path).is_absolute() for path in paths) == relative, paths
        # One column of kinds, also past 40 characters of path (before, those pushed theirs right).
        assert len({line.index(" kind=") for line in printed}) == 1, printed


def test_output_read_by_a_closed_pipe_is_not_an_error_of_the_user():
    # 'ember train --list | head -1': the reader leaves early. Before, the command printed
    # "ember train: [Errno 32] Broken pipe" and exited with code 2, as for a mistake of the user's.
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    result = subprocess.run(
        [sys.executable, "-m", "ember", "train", "--list"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )
    os.close(write_end)
    assert result.stderr == "" and result.returncode == 1, (result.returncode, result.stderr)

"""``ember serve`` as a user runs it: a process serving a run directory to an OpenAI client until
Ctrl-C, and its options refused before any model loads."""

import os
import re
import signal
import subprocess
import sys

import openai
import pytest

from ember.cli import main
from ember.core.tokenizer import ByteTokenizer
from ember.models.config import ModelConfig
from tests.serving.greedy_reference import greedy_reference
from tests.serving.run_dirs import write_run_dir

CONFIG = ModelConfig(vocab_size=257, d_model=32, num_layers=1, num_heads=2, mlp_dim=64, page_size=4, max_seq_len=32)


def test_a_served_run_answers_an_openai_client_until_sigterm(tmp_path):
    """SIGTERM, a service manager's stop, as Ctrl-C (which pytest-xdist's workers ignore, and so
    the processes they start)."""
    params = write_run_dir(tmp_path, CONFIG)
    command = [sys.executable, "-m", "ember", "serve", "--checkpoint", str(tmp_path), "--port", "0", "--quiet",
               "--num-slots", "2", "--token-budget", "8", "--served-model-name", "tiny"]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "EMBER_API_KEY": "k1"})
    try:
        lines = []
        while not (match := re.search(r"ember serve: tiny at (http://\S+/v1)", lines[-1] if lines else "")):
            lines.append(process.stderr.readline())
            assert lines[-1] or process.poll() is None, "".join(lines)
        client = openai.OpenAI(base_url=match.group(1), api_key="k1", max_retries=0, timeout=120)  # $EMBER_API_KEY
        assert [model.id for model in client.models.list()] == ["tiny"]
        answer = client.completions.create(model="tiny", prompt="Hi", max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        expected = greedy_reference(CONFIG, params, 32)([list(ByteTokenizer().encode("Hi"))], [6])[0]
        assert answer.choices[0].text == ByteTokenizer().decode(expected)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
        process.stderr.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], r"--port must be in \[0, 65535\], got 70000"),
        (["--num-slots", "0"], "--num-slots must be a positive integer"),
        (["--mesh", "fsdp=2"], "--mesh fsdp=2: mesh.fsdp=2: serving splits only the model"),
    ],
)
def test_a_bad_option_is_refused_before_anything_loads(tmp_path, capsys, flags, message):
    assert main(["serve", "--checkpoint", str(tmp_path / "absent"), *flags]) == 2
    assert re.search(message, capsys.readouterr().err)

"""``ember generate`` on an Ember run directory, an exported artifact (in a subprocess that
cannot import ``ember.models``) and a Hugging Face directory (against ``transformers``)."""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from ember.cli import main
from ember.core.chat import chat_prompt_tokens
from ember.core.tokenizer import ByteTokenizer
from ember.models.config import ModelConfig
from ember.serving.batch_io import output_record, with_chat_prompts
from ember.serving.cli import read_prompts
from ember.serving.engine import Engine
from ember.serving.export import export_program
from tests.hf_peers import random_hf_model
from tests.pipes import pipe_holding
from tests.serving.greedy_reference import greedy_reference, log_prob_reference
from tests.serving.random_weights import random_weights
from tests.serving.run_dirs import write_run_dir
from tests.tolerances import assert_allclose

REPO = Path(__file__).resolve().parents[2]
CONFIG = ModelConfig(vocab_size=257, d_model=64, num_layers=2, num_heads=4, mlp_dim=128, page_size=8, max_seq_len=40)
CHAT = [{"role": "user", "content": "Hi"}]  # 26 tokens with plain_chat's turn and generation prompt
ENGINE_FLAGS = ["--num-slots", "3", "--token-budget", "4", "--no-progress"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """An Ember LM run directory as the trainer leaves it: config.yaml + checkpoints/."""
    path = tmp_path_factory.mktemp("run")
    return path, write_run_dir(path, CONFIG)


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def read_records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_interrupted_batch_keeps_the_records_it_finished(run_dir, tmp_path, monkeypatch):
    """Records are written in input order as they finish: an interrupt while the last request
    runs leaves the first line's record and the rejected line's in --out. Before, --out was
    written once at the end, and an interrupted batch lost every result."""
    path, _ = run_dir
    lines = [json.dumps({"prompt": "Hi", "max_tokens": 1}), "{not json", json.dumps({"prompt": "Hello"})]
    prompts, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    taken = Engine.result

    def result(engine, request_id):  # the second request's result is taken as an interrupt comes
        if request_id > 0:
            raise KeyboardInterrupt
        return taken(engine, request_id)

    monkeypatch.setattr(Engine, "result", result)
    with pytest.raises(KeyboardInterrupt):
        main(["generate", "--checkpoint", str(path), "--prompts", str(prompts), "--out", str(out), *ENGINE_FLAGS])
    first, rejected = read_records(out)
    assert first["id"] == 1 and len(first["tokens"]) <= 1 and first["finish_reason"] in ("length", "stop")
    assert rejected["id"] == 2 and "malformed JSON" in rejected["error"]


@pytest.mark.slow  # two engines, an export and a subprocess that recompiles
def test_generate_jsonl_from_a_run_directory_then_from_its_artifact(run_dir, tmp_path, rng):
    path, params = run_dir
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    tokens = generator.integers(0, 256, size=int(generator.integers(3, 20))).tolist()
    prompts = write_lines(
        tmp_path / "in.jsonl",
        [
            json.dumps({"id": "a", "prompt": "Hello", "max_tokens": 6}),
            json.dumps({"prompt_tokens": tokens, "max_tokens": 5, "stop": ["zz"]}),
            "{not json",
            "",
            json.dumps({"prompt": "", "max_tokens": 3}),
            json.dumps({"id": 9, "prompt_tokens": [1, 257]}),
            json.dumps({"prompt": "x", "max_tokens": 0}),
            json.dumps({"prompt_tokens": list(range(41))}),
            json.dumps({"prompt": "abc", "temperature": 0.8, "seed": 5, "max_tokens": 7}),
            json.dumps({"id": "chat", "messages": CHAT, "max_tokens": 4}),
            json.dumps({"messages": []}),
        ],
    )
    out = tmp_path / "out.jsonl"
    assert (
        main(["generate", "--checkpoint", str(path), "--prompts", str(prompts), "--out", str(out), *ENGINE_FLAGS]) == 0
    )
    records = read_records(out)
    assert [r["id"] for r in records] == ["a", 2, 3, 5, 9, 7, 8, 9, "chat", 11]
    chat = chat_prompt_tokens(CHAT, ByteTokenizer())
    expected = greedy_reference(CONFIG, params, 40)([list(b"Hello"), tokens, chat], [6, 5, 4])
    assert records[0]["tokens"] == expected[0] and records[0]["text"] == ByteTokenizer().decode(expected[0])
    assert records[0]["finish_reason"] in ("length", "stop")
    # Greedy up to an EOS or the stop string "zz", which end the output early.
    assert records[1]["tokens"] == expected[1][: len(records[1]["tokens"])]
    assert "line 3: malformed JSON" in records[2]["error"]
    assert "line 5" in records[3]["error"] and "empty" in records[3]["error"]
    assert "line 6" in records[4]["error"] and "257" in records[4]["error"]
    assert "line 7" in records[5]["error"] and "max_tokens" in records[5]["error"]
    assert "line 8" in records[6]["error"] and "41 tokens" in records[6]["error"]
    assert len(records[7]["tokens"]) <= 7 and "error" not in records[7]
    # The conversation is prompted as a chat model fine-tuned on it was trained (ember.core.chat).
    assert records[8]["tokens"] == expected[2][: len(records[8]["tokens"])] and "text" in records[8]
    assert records[9]["error"].startswith("line 11: messages must be a non-empty list")

    artifact = tmp_path / "artifact"
    assert main(["export", str(path), str(artifact), "--num-slots", "2", "--token-budget", "4"]) == 0
    script = (
        "import sys; sys.modules['ember.models'] = None\n"  # any import of ember.models now fails
        "from ember.cli import main\n"
        f"code = main(['generate', '--artifact', {str(artifact)!r}, '--prompts', {str(prompts)!r}, "
        f"'--out', {str(tmp_path / 'artifact.jsonl')!r}, '--no-progress'])\n"
        "assert not any(name.startswith('ember.models.') for name in sys.modules), 'model code was imported'\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_records(tmp_path / "artifact.jsonl") == records


def test_a_request_line_may_score_its_prompt(run_dir, tmp_path):
    """``prompt_logprobs`` with ``max_tokens`` 0 scores a text: the record holds the
    log-probability of each prompt token after the first and, with ``top_logprobs``, the most
    likely alternatives as ``[token, logprob]`` pairs."""
    path, params = run_dir
    asked = {"prompt": "Hello there", "max_tokens": 0, "prompt_logprobs": True, "top_logprobs": 1}
    prompts = write_lines(tmp_path / "in.jsonl", [json.dumps(asked)])
    out = tmp_path / "out.jsonl"
    assert (
        main(["generate", "--checkpoint", str(path), "--prompts", str(prompts), "--out", str(out), *ENGINE_FLAGS]) == 0
    )
    (record,) = read_records(out)
    text = list(b"Hello there")
    rows = log_prob_reference(CONFIG, params, 40)([text])[0]
    assert (record["tokens"], record["finish_reason"]) == ([], "length")
    assert_allclose(record["prompt_logprobs"], [rows[p, text[p + 1]] for p in range(len(text) - 1)], dtype=np.float32)
    assert [token for ((token, _),) in record["prompt_top_logprobs"]] == np.argmax(rows[:-1], axis=-1).tolist()


@pytest.mark.parametrize("flags", [[], ["--no-prefix-caching"]])
def test_a_batch_of_one_prompt_prefills_it_once_unless_told_not_to(run_dir, tmp_path, monkeypatch, flags):
    """Four request lines of one prompt: the engine computes its full pages once (prefix caching),
    or, with ``--no-prefix-caching``, four times; the records are the same."""
    path, _ = run_dir
    engines = []
    init = Engine.__init__
    monkeypatch.setattr(Engine, "__init__", lambda self, *a, **kw: engines.append(self) or init(self, *a, **kw))
    prompts = write_lines(tmp_path / "in.jsonl", [json.dumps({"prompt": "Once upon a time", "max_tokens": 2})] * 4)
    out = tmp_path / "out.jsonl"
    assert (
        main(
            ["generate", "--checkpoint", str(path), "--prompts", str(prompts), "--out", str(out), *ENGINE_FLAGS, *flags]
        )
        == 0
    )
    records = read_records(out)
    assert len({json.dumps(r["tokens"]) for r in records}) == 1
    # Three copies x the prompt's first page of 8 tokens (the second page holds its last token).
    assert engines[0].scheduler.pages.hit_tokens == (0 if flags else 3 * 8)


def test_single_prompt_text_mode_prints_the_text(run_dir, capsys):
    path, params = run_dir
    # One compiled bucket (a single token per step) keeps this start-up short.
    code = main(
        [
            "generate",
            "--checkpoint",
            str(path),
            "--prompt",
            "Once",
            "--max-tokens",
            "4",
            "--token-budget",
            "1",
            "--num-slots",
            "1",
            "--no-progress",
        ]
    )
    assert code == 0
    expected = greedy_reference(CONFIG, params, 40)([list(b"Once")], [4])[0]
    # EOS (256) would end generation early without being printed.
    expected = expected[: expected.index(256)] if 256 in expected else expected
    assert capsys.readouterr().out == ByteTokenizer().decode(expected) + "\n"
    # A rejected --prompt is the command's error, named by the option (it said "line 1:").
    too_long = ["--prompt", "x" * 50, "--max-context", "40"]
    assert main(["generate", "--checkpoint", str(path), *too_long, "--token-budget", "1", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().endswith("--prompt: the prompt has 50 tokens, more than the context of 40")


def test_mesh_serves_on_replicas_each_split_over_devices_with_the_same_text(run_dir, tmp_path, monkeypatch):
    """``--mesh data=2,tensor=2`` serves a batch on two engines at once, each with the run's model
    split over two devices of its own (its cache in their shards), and writes the single
    device's greedy texts in input order."""
    from ember.serving import cli

    path, params = run_dir
    engines = []
    monkeypatch.setattr(
        cli, "build_engine", lambda args, build=cli.build_engine: engines.append(build(args)) or engines[-1]
    )
    lines = [json.dumps({"prompt": text}) for text in ("Once", "Twice", "A")]
    prompts = write_lines(tmp_path / "in.jsonl", [*lines, json.dumps({"messages": CHAT})])  # the replicas' tokenizer
    flags = ["--max-tokens", "4", "--token-budget", "2", "--num-slots", "1", "--no-progress"]
    out = tmp_path / "out.jsonl"
    args = ["generate", "--checkpoint", str(path), "--prompts", str(prompts), "--out", str(out), *flags]
    assert main([*args, "--mesh", "data=2,tensor=2"]) == 0
    chat = chat_prompt_tokens(CHAT, ByteTokenizer())
    expected = greedy_reference(CONFIG, params, 40)([list(b"Once"), list(b"Twice"), list(b"A"), chat], [4] * 4)
    expected = [tokens[: tokens.index(256)] if 256 in tokens else tokens for tokens in expected]  # EOS unprinted
    assert [record["text"] for record in read_records(out)] == [ByteTokenizer().decode(t) for t in expected]
    replicas = engines[0].engines
    for engine, devices in zip(replicas, (jax.devices()[:2], jax.devices()[2:4])):
        pages = engine.program.kv["block_0"]["k_pages"]
        assert list(pages.sharding.mesh.devices.flat) == devices and engine.tokens_generated > 0
        assert pages.addressable_shards[0].data.shape[3] == CONFIG.kv_heads // 2


@pytest.mark.parametrize(
    ("source", "mesh", "message"),
    [
        ("--checkpoint", "fsdp=2,tensor=2", "--mesh fsdp=2,tensor=2: mesh.fsdp=2: serving splits only the model"),
        ("--checkpoint", "data=3,tensor=4", "mesh.data=3 replicas of 4 device(s) each need 12 devices; there are 8"),
        ("--checkpoint", "tensors=2", "unknown config key 'tensors'"),
        ("--artifact", "tensor=2", "--mesh applies to --checkpoint: an exported --artifact runs on one device"),
    ],
)
def test_a_mesh_serving_cannot_use_is_refused_before_anything_loads(source, mesh, message, tmp_path, capsys):
    code = main(["generate", source, str(tmp_path), "--prompt", "Once", "--mesh", mesh, "--no-progress"])
    assert code == 2 and message in capsys.readouterr().err


@pytest.mark.slow  # imports torch + transformers and compiles an engine
def test_generate_matches_transformers_greedy_on_a_tiny_llama(tmp_path, rng):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = random_hf_model(hf_config, seed=int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    model.save_pretrained(tmp_path / "llama")
    generator = np.random.default_rng(int(jax.random.randint(jax.random.fold_in(rng, 1), (), 0, 2**31 - 1)))
    prompts = [generator.integers(0, 97, size=int(n)).tolist() for n in generator.integers(2, 20, size=4)]
    lines = write_lines(tmp_path / "in.jsonl", [json.dumps({"prompt_tokens": p, "max_tokens": 12}) for p in prompts])
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(tmp_path / "llama"),
                "--prompts",
                str(lines),
                "--out",
                str(out),
                *ENGINE_FLAGS,
            ]
        )
        == 0
    )
    records = read_records(out)
    for prompt, record in zip(prompts, records):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False).numpy()[
                0, len(prompt) :
            ]
        assert record["tokens"] == expected.tolist() and record["finish_reason"] == "length"
        assert "text" not in record  # no tokenizer in the directory


def test_export_names_the_engine_size_option_it_rejects(run_dir, tmp_path, capsys):
    """``ember generate`` named the option; ``ember export`` said only "max_context must be ..."."""
    path, _ = run_dir
    assert main(["export", str(path), str(tmp_path / "artifact"), "--max-context", "1000"]) == 2
    assert "--max-context: max_context must be in [1, max_seq_len=" in capsys.readouterr().err


def test_prompt_lines_split_at_newlines_only(tmp_path):
    """JSON allows U+2028, U+2029 and U+0085 unescaped in a string (``json.dumps(...,
    ensure_ascii=False)`` writes them so): they are text of the prompt, not line ends."""
    text = "one\u2028two\u2029three\x85four"
    lines = [json.dumps({"prompt": text, "max_tokens": 2}, ensure_ascii=False), json.dumps({"prompt_tokens": [1]})]
    args = argparse.Namespace(prompt=None, prompts=str(write_lines(tmp_path / "in.jsonl", lines)))
    parsed = read_prompts(args, {})
    assert [(line.request_id, line.prompt, line.error) for line in parsed] == [(1, text, None), (2, [1], None)]
    assert parsed[0].params.max_tokens == 2


def test_request_lines_with_messages_are_prompted_as_chat_fine_tuning_trained(tmp_path):
    """A third prompt form, a conversation: checked when parsed, prompted with the engine's
    tokenizer (ember.core.chat); a bad one, or one without a tokenizer, is its line's error.
    Before, "messages" was an unknown sampling field and the line was refused."""
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    lines = [
        json.dumps({"id": "c", "messages": chat, "max_tokens": 3}),
        json.dumps({"prompt": "hi", "messages": chat}),
        json.dumps({"messages": [{"role": "bot", "content": "x"}]}),
        json.dumps({"prompt_tokens": [1]}),
    ]
    args = argparse.Namespace(prompt=None, prompts=str(write_lines(tmp_path / "in.jsonl", lines)))
    parsed = with_chat_prompts(read_prompts(args, {}), ByteTokenizer())
    assert parsed[0].prompt == chat_prompt_tokens(chat, ByteTokenizer()) and parsed[0].params.max_tokens == 3
    assert parsed[3].prompt == [1] and parsed[3].error is None
    errors = [output_record(line, None)["error"] for line in parsed[1:3]]
    assert errors[0].startswith("line 2: give exactly one of 'prompt' (text), 'prompt_tokens' (a list of token ids) or")
    assert errors[1] == "line 3: messages[0] has role 'bot'; roles: system, user, assistant"
    (untokenized,) = with_chat_prompts(parsed[:1], None)  # an artifact exported without a tokenizer
    assert output_record(untokenized, None)["error"].startswith('line 1: a conversation ("messages") needs a tokenizer')


def test_prompts_from_a_pipe(tmp_path):
    # `cat in.jsonl | ember generate --prompts /dev/stdin` (or `--prompts <(...)`): before, a pipe
    # was refused with "--prompts: no such file: /dev/stdin", as a path that is not there.
    with pipe_holding(tmp_path / "in.fifo", json.dumps({"prompt": "def ", "max_tokens": 3}) + "\n") as fifo:
        parsed = read_prompts(argparse.Namespace(prompt=None, prompts=str(fifo)), {})
    assert [(line.prompt, line.params.max_tokens, line.error) for line in parsed] == [("def ", 3, None)]
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_prompts(argparse.Namespace(prompt=None, prompts=str(tmp_path / "missing.jsonl")), {})


def test_a_prompts_file_that_is_not_utf8_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')  # Latin-1
    args = ["generate", "--checkpoint", str(tmp_path), "--prompts", str(tmp_path / "in.jsonl"), "--no-progress"]
    assert main(args) == 2
    assert "in.jsonl is not UTF-8 text (byte 15: invalid continuation byte)" in capsys.readouterr().err


def test_a_path_that_is_no_model_is_a_clear_error(tmp_path, capsys):
    prompts = write_lines(tmp_path / "in.jsonl", [json.dumps({"prompt": "hi"})])
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompts", str(prompts), "--no-progress"]) == 2
    assert "neither an Ember run directory" in capsys.readouterr().err


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """A one-layer model's artifact with one token bucket (exported, never compiled here)."""
    config = ModelConfig(vocab_size=257, d_model=16, num_layers=1, num_heads=2, mlp_dim=32, page_size=4, max_seq_len=8)
    path = tmp_path_factory.mktemp("artifact")
    export_program(
        config,
        random_weights(config, seed=3, spread=0.1),
        path,
        tokenizer=ByteTokenizer(),
        num_slots=2,
        token_buckets=(2,),
    )
    return path


def _torn_manifest(path):
    (path / "manifest.json").write_text("{")


def _torn_step(path):
    (path / "step_t2.jaxexport").write_bytes(b"garbage")


def _torn_params(path):
    (path / "params.npz").write_bytes((path / "params.npz").read_bytes()[:100])


def _manifest_without(key):
    def tear(path):
        manifest = json.loads((path / "manifest.json").read_text())
        del manifest[key]
        (path / "manifest.json").write_text(json.dumps(manifest))

    return tear


def _params_of_another_model(path):
    with np.load(path / "params.npz") as stored:
        leaves = {name: np.zeros((3,), stored[name].dtype) for name in stored.files}
    np.savez(path / "params.npz", **leaves)


@pytest.mark.parametrize(
    "tear, message",
    [
        (_torn_manifest, "manifest.json is not a readable part of an 'ember export' artifact \\(JSONDecodeError"),
        (_torn_step, "step_t2.jaxexport is not a readable part of an 'ember export' artifact"),
        (_torn_params, "params.npz is not a readable part of an 'ember export' artifact \\(BadZipFile"),
        (_params_of_another_model, "params.npz is not a readable part .* leaf_00000 has shape \\(3,\\); the exported"),
        (lambda path: (path / "params.npz").unlink(), "params.npz is missing: the artifact is incomplete"),
        (_manifest_without("eos_ids"), "manifest.json lacks eos_ids: export the artifact again"),
        (lambda path: (path / "manifest.json").write_text("[]"), "manifest.json holds a JSON list, not the object"),
    ],
)
def test_a_torn_artifact_is_a_one_line_error(artifact, tmp_path, capsys, tear, message):
    # Before, each but the missing file was a traceback (JSONDecodeError, struct.error, BadZipFile)
    # and params of another shape loaded, to fail when the step ran.
    torn = tmp_path / "torn"
    shutil.copytree(artifact, torn)
    tear(torn)
    assert main(["generate", "--artifact", str(torn), "--prompt", "hi", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and re.search(message, err), err

"""``ember quantize`` on a briefly trained tiny byte model: int8 within 1% of the float
validation loss, int4 GPTQ closer to float than int4 round-to-nearest, int8 greedy
generations equal to the float model's on most prompts, the output served as a checkpoint
and as an exported artifact; QAT then quantization loses less than float training then
quantization (both measured against the float-trained model); bad inputs fail with one line."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from ember.cli import main
from ember.core.errors import ConfigError
from ember.models.decoder import DecoderLM
from ember.models.quantization import QuantizeConfig
from ember.serving.loading import load_model
from ember.training.data import stdlib_documents
from ember.training.lm.trainer import train
from ember.training.quantization.ptq import EvalConfig, quantize_model
from tests.training.lm_runs import small_config

WINDOWS = EvalConfig(seq_len=64, calibration_windows=16, eval_windows=32)
PROMPTS = [
    "def __init__(self",
    "import os\nimport ",
    "class Foo",
    "    return ",
    "if __name__",
    "for i in ",
    "    def ",
    "# ",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset):
    """A 300-step tiny run, float and int4-QAT (the same seed and data; quantized, they are
    calibrated and validated on its train and validation splits), and a text file for the CLI."""
    root = tmp_path_factory.mktemp("quantize")
    runs = {}
    for name, extra in (("float", []), ("qat", ["qat.format=int4", "qat.group_size=64", "qat.fraction=0.5"])):
        runs[name] = root / name
        train(small_config(root, dataset, "train.steps=300", "checkpoint.every=300", f"run_dir={runs[name]}", *extra))
    documents = []
    for _, text in stdlib_documents():
        documents.append(text)
        if sum(map(len, documents)) > 900_000:
            break
    text = root / "text.txt"
    text.write_text("\n".join(documents[-40:]))
    return root, runs, text


@pytest.fixture(scope="module")
def quantized(trained):
    root, runs, _ = trained
    summaries = {}
    for fmt, method, group in (("int8", "rtn", None), ("int4", "rtn", 32), ("int4", "gptq", 32)):
        config = QuantizeConfig(format=fmt, method=method, group_size=group)
        summaries[fmt, method] = quantize_model(runs["float"], root / f"{fmt}_{method}", config, windows=WINDOWS)
    return summaries


def test_int8_is_within_one_percent_and_gptq_beats_round_to_nearest(quantized):
    int8 = quantized["int8", "rtn"]
    assert abs(int8["val_loss_delta"]) < 0.01 * int8["float_val_loss"], int8
    rtn, gptq = quantized["int4", "rtn"], quantized["int4", "gptq"]
    assert rtn["float_val_loss"] == gptq["float_val_loss"] == int8["float_val_loss"]
    closeness = {name: abs(s["val_loss_delta"]) for name, s in (("gptq", gptq), ("rtn", rtn))}
    assert closeness["gptq"] < closeness["rtn"], closeness
    assert int8["quantized_weights"] == 7  # the projections, each stacked over the 2 layers
    assert rtn["quantized_weight_bytes"] < int8["quantized_weight_bytes"] < int8["float_weight_bytes"]


def test_the_cli_prints_and_writes_both_losses(trained, capsys):
    root, runs, text = trained
    args = [
        "quantize",
        str(runs["float"]),
        str(root / "nf4"),
        "--format",
        "nf4",
        "--text",
        str(text),
        "--seq-len",
        "64",
    ]
    assert main([*args, "--eval-windows", "8", "--calibration-windows", "4"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((root / "nf4" / "summary.json").read_text())
    assert f"float {summary['float_val_loss']:.4f}, quantized {summary['quantized_val_loss']:.4f}" in out
    assert summary["format"] == "nf4" and summary["group_size"] == 64
    assert main(args) == 2  # the output directory exists now
    assert "exists and is not empty" in capsys.readouterr().err


def generate(tmp_path, source, *flags):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / f"out_{source.name}.jsonl"
    assert main(["generate", *flags, str(source), "--prompts", str(prompts), "--out", str(out),
                 "--max-tokens", "16", "--no-progress"]) == 0  # fmt: skip
    return [json.loads(line)["tokens"] for line in out.read_text().splitlines()]


def test_int8_generates_as_the_float_model_and_serves_exported(trained, quantized, tmp_path):
    root, runs, _ = trained
    float_tokens = generate(tmp_path, runs["float"], "--checkpoint")
    int8_tokens = generate(tmp_path, root / "int8_rtn", "--checkpoint")
    same = sum(a == b for a, b in zip(float_tokens, int8_tokens))
    assert same >= 6, (same, float_tokens, int8_tokens)
    artifact = tmp_path / "int4_artifact"
    assert main(["export", str(root / "int4_gptq"), str(artifact)]) == 0
    assert generate(tmp_path, artifact, "--artifact") == generate(tmp_path, root / "int4_gptq", "--checkpoint")


def test_qat_loses_less_to_int4_than_float_training(trained):
    """Against the float-trained model's validation loss, the QAT model quantized to int4 loses
    less than the float-trained model quantized to int4 (measured: 2.913 and 2.932 against
    2.929; the QAT model's own float weights reach 2.906 at this scale)."""
    root, runs, _ = trained
    config = QuantizeConfig(format="int4", group_size=64)
    summaries = {name: quantize_model(runs[name], root / f"qat_check_{name}", config, windows=WINDOWS) for name in runs}
    float_loss = summaries["float"]["float_val_loss"]
    losses = {name: s["quantized_val_loss"] - float_loss for name, s in summaries.items()}
    assert losses["qat"] < losses["float"], losses


def test_bad_sources_and_configs(trained, tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "neither an Ember run directory" in capsys.readouterr().err
    root, runs, _ = trained
    assert main(["quantize", str(runs["float"]), str(tmp_path / "out"), "--format", "int4", "--group-size", "48"]) == 2
    assert "quantize.group_size must be a power of two >= 16, got 48" in capsys.readouterr().err
    with pytest.raises(ConfigError) as error:
        small_config(tmp_path, root, "qat.format=int2")
    assert error.value.key == "qat.format"
    with pytest.raises(ConfigError) as error:
        small_config(tmp_path, root, "qat.fraction=0")
    assert error.value.key == "qat.fraction"


def test_a_hugging_face_model_quantizes_with_its_tokenizer(tmp_path):
    """A tiny random HF Llama with its own tokenizer: the output keeps the tokenizer, its int8
    logits stay close to ``transformers``' float ones, and it generates from a text prompt."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.training.finetune_setup import ANIMALS, write_base_model

    base = write_base_model(tmp_path / "hf")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"what does the {a} say ? {s} ." for a, s in ANIMALS.items()) * 40)
    windows = EvalConfig(seq_len=16, calibration_windows=8, eval_windows=8, batch_size=4)
    summary = quantize_model(
        base, tmp_path / "int8", QuantizeConfig(format="int8", method="gptq"), text=text, windows=windows
    )
    assert abs(summary["val_loss_delta"]) < 0.01 * summary["float_val_loss"]
    out = tmp_path / "int8"
    assert (out / "tokenizer.json").is_file() and "tokenizer: hf" in (out / "config.yaml").read_text()
    loaded = load_model(out)
    tokens = np.asarray([[1, 3, 4, 5, 10, 6, 7]])
    ember = np.asarray(DecoderLM(loaded.config).apply({"params": loaded.params}, jnp.asarray(tokens))[0])
    with torch.no_grad():
        reference = transformers.AutoModelForCausalLM.from_pretrained(base).eval()(torch.tensor(tokens)).logits.numpy()
    assert np.max(np.abs(ember - reference)) < 0.02 * np.max(np.abs(reference))
    assert list(loaded.tokenizer.encode("what does the cow say ?")) == tokens[0].tolist()  # the source's tokenizer
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "what does the cow say ?"}) + "\n")
    assert main(["generate", "--checkpoint", str(out), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
                 "--max-tokens", "4", "--no-progress"]) == 0  # fmt: skip
    assert len(json.loads((tmp_path / "o.jsonl").read_text())["tokens"]) >= 1

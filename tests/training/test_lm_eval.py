"""``ember eval MODEL`` on language models: the loss on a text equals ``transformers``' own over
the same windows, an Ember run's default text is its validation split (the number ``ember
quantize`` reports as ``float_val_loss``), ``--adapter`` gives the merged model's loss, bits per
byte count the bytes the predicted tokens spell. (Its one-line errors: tests/test_cli_errors.py.)"""

import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.cli import main
from ember.core.checkpoint import CheckpointManager
from ember.core.config import load_config, to_yaml
from ember.core.tokenizer import ByteTokenizer
from ember.models.decoder import DecoderLM
from ember.training.lm.config import LMConfig
from ember.training.lm.evaluate import read_documents, tokenized
from ember.training.lm.evaluate_command import figures_json
from tests.tolerances import assert_allclose
from tests.training.finetune_setup import ANIMALS, WORDS, write_base_model

SEQ_LEN = 8


def evaluate(capsys, *args):
    assert main(["eval", *map(str, args), "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny random Hugging Face Llama with its word-level tokenizer, and a text of its words."""
    root = tmp_path_factory.mktemp("lm_eval")
    base = write_base_model(root / "llama", seed=3)
    rng = np.random.default_rng(5)
    words = [w for pair in ANIMALS.items() for w in ("what", "does", "the", *pair, "?")]
    text = root / "text.txt"
    text.write_text(" ".join(rng.choice(words, size=200)))
    return base, text


def transformers_loss(model, windows):
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        return float(model(input_ids=torch.tensor(windows), labels=torch.tensor(windows)).loss)


def text_windows(base, text, count):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(base / "tokenizer.json")).encode(text.read_text()).ids  # <s> first
    return np.asarray(ids[: count * (SEQ_LEN + 1)]).reshape(count, SEQ_LEN + 1)


def test_the_loss_of_a_hugging_face_model_is_transformers_own(hf_model, capsys):
    transformers = pytest.importorskip("transformers")
    base, text = hf_model
    figures = evaluate(capsys, base, "--text", text, "--seq-len", SEQ_LEN, "--batch-size", 4, "--max-windows", 6)
    windows = text_windows(base, text, 6)  # two batches, the second of 2 windows
    model = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    assert_allclose(figures["loss"], transformers_loss(model, windows), dtype=np.float32)
    assert (figures["tokens"], figures["windows"]) == (6 * SEQ_LEN, 6)
    assert figures["perplexity"] == pytest.approx(math.exp(figures["loss"]))
    # Each predicted word covers itself and the space before it; the text's first word has none.
    spelled = sum(1 + len(WORDS[i]) for i in windows[:, 1:].reshape(-1)) - 1
    assert figures["bytes"] == spelled
    assert figures["bits_per_byte"] == pytest.approx(figures["loss"] * 6 * SEQ_LEN / math.log(2) / spelled)


def test_an_adapter_gives_the_loss_of_the_merged_model(hf_model, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base, text = hf_model
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    options = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    adapted = peft.get_peft_model(model, peft.LoraConfig(**options)).eval()
    with torch.no_grad():
        for name, value in adapted.named_parameters():
            if "lora_" in name:
                value.mul_(4.0)  # a change of the loss well past the tolerance
    adapted.save_pretrained(tmp_path / "adapter")
    windows = text_windows(base, text, 4)
    expected = transformers_loss(adapted.merge_and_unload(), windows)
    args = [base, "--text", text, "--seq-len", SEQ_LEN, "--max-windows", 4]
    figures = evaluate(capsys, *args, "--adapter", tmp_path / "adapter")
    assert_allclose(figures["loss"], expected, dtype=np.float32)
    assert abs(figures["loss"] - evaluate(capsys, *args)["loss"]) > 0.01


def test_an_ember_run_and_its_quantized_version_are_evaluated_on_its_validation_split(tmp_path, monkeypatch, capsys):
    """The losses 'ember quantize' reports (float_val_loss, quantized_val_loss) on the same windows."""
    from ember.models.variables import as_variables
    from ember.serving.loading import load_model
    from ember.training.lm.eval_windows import run_dataset
    from ember.training.quantization.ptq import EvalConfig, token_splits, validation_figures

    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    model = ["model.vocab_size=257", "model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.mlp_dim=64",
             "model.max_seq_len=32", "train.seq_len=16"]  # fmt: skip
    config = load_config(LMConfig, None, ["data.dataset=arithmetic", "data.arithmetic.max_operand=30", *model])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(config))
    params = DecoderLM(config.model).init(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))["params"]
    with CheckpointManager(run / "checkpoints", async_save=False) as manager:
        manager.save(5, {"params": nn.meta.unbox(params)})
    figures = evaluate(capsys, run, "--seq-len", 16, "--max-windows", 5, "--batch-size", 2)
    loaded = load_model(run)
    _, validation = token_splits(loaded, None, EvalConfig(seq_len=16, eval_windows=5), run_dataset(run))
    variables = as_variables(loaded.params)
    quantize_figures = validation_figures(DecoderLM(loaded.config), variables, variables, validation, 2)
    assert_allclose(figures["loss"], quantize_figures["float_val_loss"], dtype=np.float32)
    assert figures["text"].startswith("the validation split of ") and figures["tokens"] == 5 * 16
    assert figures["bytes"] == int(np.sum(validation[:, 1:] < 256))  # end-of-document tokens spell no bytes
    # Its quantized version is held to the same text: its source's validation split.
    from ember.models.quantization import QuantizeConfig
    from ember.training.quantization.ptq import quantize_model

    windows = EvalConfig(seq_len=16, calibration_windows=2, eval_windows=5, batch_size=2)
    summary = quantize_model(run, tmp_path / "int8", QuantizeConfig(format="int8"), windows=windows)
    quantized = evaluate(capsys, tmp_path / "int8", "--seq-len", 16, "--max-windows", 5, "--batch-size", 2)
    assert quantized["text"] == figures["text"]
    assert_allclose(quantized["loss"], summary["quantized_val_loss"], dtype=np.float32)


def test_a_jsonl_text_is_its_documents_each_ended_as_data_prepare_ends_them(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "h\u00e9llo"}) + "\n\n" + json.dumps({"text": "ab"}) + "\n")
    text = tokenized(read_documents(path), ByteTokenizer())
    np.testing.assert_array_equal(text.ids, [*"h\u00e9llo".encode(), 256, *b"ab", 256])
    np.testing.assert_array_equal(text.byte_ends, [1, 2, 3, 4, 5, 6, 6, 7, 8, 8])


def test_a_token_past_the_model_s_vocabulary_is_a_data_error(tmp_path):
    # JAX clamps an embedding lookup past the table and the loss of such a target is no loss of the text.
    from ember.core.errors import DataError
    from ember.models.config import ModelConfig
    from ember.serving.loading import LoadedModel
    from ember.training.lm.evaluate import evaluate_tokens

    path = tmp_path / "text.txt"
    path.write_text("\u0218" * 20)  # UTF-8 bytes 0xC8 0x98: 200 and 152
    loaded = LoadedModel(ModelConfig(vocab_size=200), None, ByteTokenizer(), (ByteTokenizer.eos_id,))
    with pytest.raises(DataError, match=r"text\.txt holds token id 200, past the model's vocab_size \(200\)"):
        evaluate_tokens(loaded, tokenized(read_documents(path), ByteTokenizer()), seq_len=8, batch_size=2)


def test_a_hugging_face_model_without_a_tokenizer_cannot_read_a_text(hf_model, tmp_path, capsys):
    # Before, AttributeError: 'NoneType' object has no attribute 'encode_offsets' (a traceback).
    import shutil

    base, text = hf_model
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(base / name, bare / name)
    assert main(["eval", str(bare), "--text", str(text), "--seq-len", "8"]) == 2
    assert "the model has no tokenizer (a Hugging Face directory without tokenizer.json)" in capsys.readouterr().err


def test_the_default_dataset_is_followed_back_through_quantized_and_fine_tuned_runs(tmp_path):
    from ember.training.lm.evaluate import lineage_dataset

    run, tuned, quantized = (tmp_path / name for name in ("run", "tuned", "quantized"))
    for path in (run, tuned, quantized):
        path.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(LMConfig, None, [f"data.dataset={tmp_path / 'data'}"])))
    (tuned / "config.yaml").write_text(f"kind: finetune\nbase_model:\n  path: {run}\n")
    (quantized / "config.yaml").write_text(f"kind: quantized\nsource: {tuned}\n")
    assert lineage_dataset(quantized) == lineage_dataset(tuned) == lineage_dataset(run) == tmp_path / "data"
    (tuned / "config.yaml").write_text(f"kind: finetune\nbase_model:\n  path: {tmp_path / 'gone'}\n")
    assert lineage_dataset(quantized) is None  # the stdlib corpus, then


def test_json_figures_are_strict_json_when_a_figure_is_no_finite_number():
    """A loss past ``exp``'s range has an infinite perplexity, a diverged model a NaN loss: JSON
    has neither (``json.dumps`` would write ``Infinity``, which strict readers such as ``jq`` refuse)."""
    text = figures_json({"loss": math.nan, "perplexity": math.inf, "bits_per_byte": None, "tokens": 3})
    assert json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text}")) == {
        "loss": None,
        "perplexity": None,
        "bits_per_byte": None,
        "tokens": 3,
    }

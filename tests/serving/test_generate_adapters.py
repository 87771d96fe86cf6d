"""``ember generate --checkpoint HF_DIR --adapter NAME=DIR ...`` with two PEFT adapters (random
non-zero weights, made by ``peft`` on a tiny random Llama built here): each request line's
tokens equal a full-recompute greedy loop over the ``peft`` model of its adapter (or the base
model), an unknown adapter is that line's error, and bad ``--adapter`` values fail first."""

import json
import shutil

import pytest

from ember.cli import main
from ember.serving.loading import load_model
from tests.training.finetune_setup import EOS, write_base_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
NEW_TOKENS = 6


def greedy(model, prompt):
    """Argmax of the full forward, one token at a time (the reference ``generate`` is not)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base_dir = write_base_model(root / "base", seed=4)
    models = {}
    for seed, (name, options) in enumerate(
        {
            "qv": dict(r=2, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
            "mlp": dict(r=4, lora_alpha=4, target_modules=["o_proj", "down_proj"], use_dora=True),
        }.items()
    ):
        torch.manual_seed(seed)
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager").eval()
        model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **options)).eval()
        with torch.no_grad():
            for param_name, value in model.named_parameters():
                if "lora_" in param_name:
                    value.mul_(8.0)  # strong enough to change the greedy tokens
        model.save_pretrained(root / name)
        models[name] = model
    models[None] = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager").eval()
    return root, base_dir, models


def test_each_line_generates_with_its_adapter(served, tmp_path):
    root, base_dir, models = served
    prompts = [[1, 3, 4, 5, 10, 6, 7], [1, 3, 4, 5, 12, 6], [1, 5, 14, 6, 7, 3], [1, 9, 8]]
    names = ["qv", None, "mlp", "qv"]
    lines = [
        {"prompt_tokens": p, "max_tokens": NEW_TOKENS, **({"adapter": n} if n else {})} for p, n in zip(prompts, names)
    ]
    lines.append({"prompt_tokens": [1, 3], "adapter": "missing"})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main(["generate", "--checkpoint", str(base_dir), "--adapter", f"qv={root / 'qv'}", "--adapter",
                 f"mlp={root / 'mlp'}", "--prompts", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out.jsonl"),
                 "--num-slots", "3", "--token-budget", "8", "--no-progress"])  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    for prompt, name, record in zip(prompts, names, records):
        assert record["tokens"] == greedy(models[name], prompt), name
    assert records[0]["tokens"] != greedy(models[None], prompts[0])
    assert "unknown adapter 'missing'" in records[-1]["error"]


def test_every_eos_id_of_config_json_is_loaded(served, tmp_path):
    """A ``config.json`` may list several ``eos_token_id``s (Llama-3-Instruct: three), and a
    ``generation_config.json``'s, where it names them, are the ones transformers' generate
    stops on."""
    _, base_dir, _ = served
    assert load_model(base_dir).eos_ids == (EOS,)
    model = tmp_path / "model"
    shutil.copytree(base_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": [EOS, 7, 9]}))
    (model / "generation_config.json").unlink(missing_ok=True)
    assert load_model(model).eos_ids == (EOS, 7, 9)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    assert load_model(model).eos_ids == (EOS, 7, 9)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 11]}))
    assert load_model(model).eos_ids == (EOS, 11)


@pytest.mark.parametrize(
    "value, message",
    [("qv", "takes NAME=DIR"), ("=x", "takes NAME=DIR"), ("a=/no/such/dir", "no such directory")],
)
def test_bad_adapter_options_fail_before_loading(served, tmp_path, capsys, value, message):
    _, base_dir, _ = served
    (tmp_path / "in.jsonl").write_text('{"prompt_tokens": [1]}\n')
    code = main(
        ["generate", "--checkpoint", str(base_dir), "--adapter", value, "--prompts", str(tmp_path / "in.jsonl")]
    )
    assert code == 2 and message in capsys.readouterr().err

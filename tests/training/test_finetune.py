"""``kind: finetune`` end to end on a tiny random Hugging Face Llama with its own tokenizer
(built here): a LoRA run keeps adapter-sized optimizer state (in bytes) and its base bit for
bit, lowers the completion loss far below the base model's, and exports an adapter that
``peft`` loads on the ``transformers`` model and a merged checkpoint ``transformers`` loads,
both with Ember's logits; full fine-tuning with optax's Muon learns too; bad configs name
their key."""

import dataclasses
import functools
import json
import re
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.cli import main
from ember.core.config import load_config
from ember.core.errors import ConfigError
from ember.core.tree import param_bytes, param_paths
from ember.models.adapters import adapter_leaves, without_adapters
from ember.models.config import RUNTIME_FIELDS, ModelConfig, MoEConfig, runtime_overrides
from ember.models.decoder import DecoderLM
from ember.models.quantization import quantize_params
from ember.serving.loading import load_model
from ember.training.finetune import FinetuneConfig, FinetuneTask
from ember.training.finetune.base import load_base
from ember.training.finetune.config import BaseModelConfig
from ember.training.lm.task import lm_loss
from ember.training.lm.trainer import make_trainer
from tests.tolerances import assert_allclose
from tests.training.finetune_setup import EOS, write_base_model, write_examples

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

COMMON = {
    "train": {"steps": 30, "batch_size": 8, "seq_len": 32, "log_every": 10, "eval_every": 1000, "eval_batches": 2},
    "logging": {"progress": False, "tensorboard": False},
    "checkpoint": {"every": 1000},
    "base_model": {"attention_impl": "xla"},
}
CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
ROUTER = {"load_balance": 0.01, "router_z": 0.0}
"""The router loss weights method mixlora requires."""


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    base = write_base_model(root / "base")
    (base / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # where transformers saves one now
    return base, write_examples(root / "train.jsonl"), root


def config_for(problem, name, **sections):
    base, train, root = problem
    values = {"kind": "finetune", "run_dir": str(root / name), "data": {"train": str(train), "eval": str(train)}}
    for key, value in [*COMMON.items(), *sections.items()]:  # a section's keys update COMMON's
        values[key] = {**values.get(key, {}), **value} if isinstance(value, dict) else value
    values["base_model"] = {**values["base_model"], "path": str(base)}
    return load_config(FinetuneConfig, values)


def mean_eval_loss(task, params):
    loss = jax.jit(lambda p, batch: lm_loss(p, batch, model=task.model))
    sums = [loss(params, b) for b in task.eval_data()]
    return float(sum(s.loss_sum for s in sums) / sum(s.count for s in sums))


@pytest.fixture(scope="module")
def lora_run(problem):
    config = config_for(
        problem,
        "lora",
        adapter={"rank": 4, "alpha": 8, "targets": ["q", "k", "v", "o", "gate", "up", "down"]},
        optim={"lr": 1e-2},
        # 40 steps, not COMMON's 30: after 30 the completion loss was 1.009 against the bound of 1.019
        # below (0.297 of the base's 3.40; seeds 0-2: 0.297, 0.283, 0.294), after 40 0.246, 0.247, 0.243.
        train={"steps": 40},
        export={"peft": True, "merged": True},
    )
    task = FinetuneTask(config)
    trainer = make_trainer(config, task=task)
    summary = trainer.train()
    return config, task, trainer, summary


def test_lora_state_is_adapter_sized_and_the_base_unchanged(lora_run):
    _, task, trainer, _ = lora_run
    params = jax.device_get(trainer.state.params)
    adapters = adapter_leaves(params)
    trained = {p: v for p, v in param_paths(adapters).items() if not p.endswith(("_lora_scale",))}
    # AdamW's two moments of every trained adapter leaf, plus its step counters (a few bytes).
    moments = 2 * sum(np.asarray(v).nbytes for v in trained.values())
    assert moments <= param_bytes(trainer.state.opt_state) <= moments + 64
    assert param_bytes(trainer.state.opt_state) < 0.25 * 2 * param_bytes(task.base_params)  # full AdamW's moments
    base = param_paths(without_adapters(params))
    for path, value in param_paths(task.base_params).items():
        np.testing.assert_array_equal(base[path], value, err_msg=path)


def test_lora_lowers_the_completion_loss_well_below_the_base_model(lora_run):
    _, task, trainer, summary = lora_run
    before = mean_eval_loss(task, task.base_params)
    after = mean_eval_loss(task, jax.device_get(trainer.state.params))
    assert after < 0.3 * before, (before, after)  # measured 3.40 -> 0.84 in 40 steps
    assert summary["exports"].keys() == {"adapter", "merged"}


def test_exports_load_in_peft_and_transformers_with_ember_logits(lora_run, problem):
    _, task, trainer, summary = lora_run
    tokens = np.asarray([[1, 3, 4, 5, 10, 6, 7, 18, 2]])
    ember = np.asarray(DecoderLM(task.model_config).apply({"params": trainer.state.params}, jnp.asarray(tokens))[0])
    base_model = transformers.AutoModelForCausalLM.from_pretrained(problem[0], attn_implementation="eager").eval()
    with torch.no_grad():
        peft_model = peft.PeftModel.from_pretrained(base_model, summary["exports"]["adapter"]).eval()
        assert_allclose(peft_model(torch.tensor(tokens)).logits.numpy(), ember, scale=10)  # 1e-4 in f32
        merged = transformers.AutoModelForCausalLM.from_pretrained(summary["exports"]["merged"]).eval()
        assert_allclose(merged(torch.tensor(tokens)).logits.numpy(), ember, scale=10)
    adapter_config = json.loads((trainer.run_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(problem[0])
    assert (trainer.run_dir / "merged" / "tokenizer.json").is_file()
    assert (trainer.run_dir / "merged" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    # The base's special token ids and generation config go with it (before: config.json had no
    # eos_token_id, so transformers took its class default and `ember generate` no end id at all).
    assert json.loads((trainer.run_dir / "merged" / "config.json").read_text())["eos_token_id"] == EOS
    assert load_model(trainer.run_dir / "merged").eos_ids == (EOS,)


def test_qlora_keeps_the_base_nf4_and_learns(problem):
    quantize = {"quantize": "nf4", "quantize_group_size": 16}
    config = config_for(
        problem,
        "qlora",
        base_model=quantize,
        adapter={"rank": 4, "alpha": 8, "targets": ["q", "k", "v", "o", "gate", "up", "down"]},
        optim={"lr": 1e-2},
    )
    task = FinetuneTask(config)
    trainer = make_trainer(config, task=task)
    summary = trainer.train()
    params = jax.device_get(trainer.state.params)
    store = jax.jit(quantize_params, static_argnums=1)  # one program, not one per weight shape
    stored = param_paths(store(task.base_params, config.base_model.quantization()))
    trained = param_paths(params)
    floats = param_paths(task.base_params)
    codes = [p for p in stored if p.endswith("/nf4")]
    assert len(codes) == 7
    for path in codes:  # two codes per byte, unchanged by training
        weight = floats[path.removesuffix("/nf4")]
        assert trained[path].dtype == np.uint8 and trained[path].nbytes == weight.size // 2
        for part in ("nf4", "absmax"):  # codes, bit for bit
            name = path.replace("/nf4", f"/{part}")
            np.testing.assert_array_equal(trained[name], stored[name], err_msg=name)
        for part in ("absmax_scale", "absmax_mean"):  # f32 (compiled apart from the run's: 1-ulp rounding)
            name = path.replace("/nf4", f"/{part}")
            assert_allclose(trained[name], stored[name], err_msg=name)
    weights = [p.removesuffix("/nf4") for p in codes]
    quantized = sum(v.nbytes for p, v in trained.items() if any(p.startswith(f"{w}/") for w in weights))
    dense = sum(floats[w].nbytes for w in weights)
    assert quantized < 0.2 * dense  # f32 weights -> 4-bit codes and 8-bit block scales
    before = mean_eval_loss(task, task.base_params)
    after = mean_eval_loss(task, params)
    assert after < 0.5 * before, (before, after)  # measured 3.40 -> 1.02 in 30 steps
    assert "adapter" in summary["exports"]


def test_qlora_runs_its_quantized_matmuls_with_base_model_quantized_impl(problem):
    """A QLoRA run picks its quantized matmul's implementation (before: no such key, every run
    took "auto", the Pallas kernel on a GPU); a value quantized_matmul does not take is refused."""
    base_model = {"quantize": "nf4", "quantize_group_size": 16, "quantized_impl": "interpret"}
    assert FinetuneTask(config_for(problem, "qimpl", base_model=base_model)).model.config.quantized_impl == "interpret"
    with pytest.raises(
        ConfigError, match=r"quantized_impl must be empty \(the base's\) or one of auto, pallas, interpret, xla"
    ) as error:
        config_for(problem, "bad", base_model={"quantize": "nf4", "quantized_impl": "interpret_tpu"})
    assert error.value.key == "base_model.quantized_impl"
    # The other runtime settings were first checked when the loaded base's config was rebuilt with
    # them: after reading the base, keyed without base_model.
    for name, value, allowed in [("attention_impl", "cuda", "interpret_tpu"), ("remat", "most", "dots_no_batch"),
                                 ("precision", "fp8", "pure_bf16")]:  # fmt: skip
        with pytest.raises(ConfigError, match=rf"base_model\.{name}.*{allowed}") as error:
            config_for(problem, "bad", base_model={name: value})
        assert error.value.key == f"base_model.{name}"


def test_base_model_runtime_settings_are_the_model_configs_runtime_fields():
    """What a base_model section sets on the loaded base, for fine-tuning (``overrides``) and for
    serving the run's directory (its config.yaml's section): the ModelConfig runtime fields it names,
    an empty one keeping the base's; ``quantize`` and ``path`` say what is loaded, not how it runs."""
    named = {field.name for field in dataclasses.fields(BaseModelConfig)} & RUNTIME_FIELDS
    assert named == {"attention_impl", "quantized_impl", "remat", "precision", "scan_layers"}
    chosen = BaseModelConfig(path="/base", remat="full", precision="bf16", scan_layers=False, quantize="nf4")
    assert chosen.overrides() == {"remat": "full", "precision": "bf16", "scan_layers": False}
    quantized = BaseModelConfig(path="/base", quantized_impl="xla")
    assert quantized.overrides() == {"quantized_impl": "xla", "scan_layers": True}
    section = {"path": "/base", "step": 3, "attention_impl": "", "remat": None, "quantized_impl": "interpret"}
    assert runtime_overrides(section) == {"quantized_impl": "interpret"}
    model = dataclasses.replace(ModelConfig(), **chosen.overrides())
    assert (model.remat, model.scan_layers, model.policy.compute_dtype) == ("full", False, jnp.bfloat16)


def test_full_finetuning_with_muon_learns(problem):
    config = config_for(problem, "full_muon", method="full", optim={"name": "muon", "lr": 2e-2},
                        train={"steps": 12}, export={"peft": False})  # fmt: skip
    task = FinetuneTask(config)
    trainer = make_trainer(config, task=task)
    trainer.train()
    assert mean_eval_loss(task, jax.device_get(trainer.state.params)) < 0.7 * mean_eval_loss(task, task.base_params)


@pytest.mark.parametrize(
    "sections, key",
    [
        ({"method": "qlora"}, "method"),
        ({"adapter": {"targets": ["experts"]}}, "adapter.targets"),
        ({"adapter": {"rank": 0}}, "adapter.rank"),
        ({"data": {"eval_fraction": 0.5}}, "data.eval_fraction"),
        ({"data": {"seed": -1}}, "data.seed"),
        ({"base_model": {"step": 3}}, "base_model.step"),  # a Hugging Face base has no steps; was keyed "step"
        ({"train": {"seq_len": 65}}, "train.seq_len"),  # past the base's max_position_embeddings 64: was accepted
        ({"base_model": {"quantize": "int3"}}, "base_model.quantize"),
        ({"base_model": {"quantize": "nf4", "quantize_group_size": 24}}, "base_model.quantize_group_size"),
        # A group size for a float base did nothing: the run fine-tuned in float without a word.
        ({"base_model": {"quantize_group_size": 32}}, "base_model.quantize_group_size"),
        ({"base_model": {"quantize": "nf4"}, "method": "full"}, "base_model.quantize"),
        ({"base_model": {"quantize": "nf4"}, "export": {"merged": True}}, "export.merged"),
        ({"method": "mixlora", "adapter": {"init": "lora_ga"}, "train": {"aux_loss_weights": ROUTER}}, "adapter.init"),
        # MixLoRA's plain LoRA is on attention only: other targets were dropped silently (a regex too).
        (
            {"method": "mixlora", "adapter": {"targets": ["q", "up"]}, "train": {"aux_loss_weights": ROUTER}},
            "adapter.targets",
        ),
        (
            {"method": "mixlora", "adapter": {"targets": ["attn/q/kernel$"]}, "train": {"aux_loss_weights": ROUTER}},
            "adapter.targets",
        ),
    ],
)
def test_bad_finetune_configs_name_their_key(problem, sections, key):
    with pytest.raises(ConfigError) as error:
        FinetuneTask(config_for(problem, "bad", **sections))
    assert error.value.key == key


def test_export_peft_is_for_method_lora_only(problem):
    """export.peft defaulted to true and was skipped without a word for methods full and mixlora;
    an explicit true there is now refused by name, while unset it stays on for lora only, so
    ``method=full`` over the shipped LoRA config still loads."""
    for method, extra in (("full", {}), ("mixlora", {"train": {"aux_loss_weights": ROUTER}})):
        refused = rf"export\.peft writes a LoRA adapter in PEFT format, for method lora only; method {method} has"
        with pytest.raises(ConfigError, match=refused) as error:
            config_for(problem, f"peft_{method}", method=method, export={"peft": True}, **extra)
        assert error.value.key == "export.peft"
        assert not config_for(problem, f"peft_{method}", method=method, **extra).exports_peft
    assert config_for(problem, "peft_lora").exports_peft
    assert not config_for(problem, "peft_off", export={"peft": False}).exports_peft
    lora_yaml = Path(__file__).resolve().parents[2] / "configs" / "finetune" / "lora.yaml"
    with pytest.warns(UserWarning, match=r"method full\) does not use adapter\.rank"):  # and no ConfigError
        shipped = load_config(
            FinetuneConfig, lora_yaml, [f"base_model.path={problem[0]}", "data.train=t.jsonl", "method=full"]
        )
    assert shipped.export.peft is None and not shipped.exports_peft


def test_adapters_peft_cannot_hold_are_refused_before_training_when_export_peft_is_on(problem):
    """LoRA on routed experts (a Mixtral-style base) with the default ``export.peft`` trained the
    whole run and only then failed in the export ("an adapter on moe/experts/down has no PEFT
    equivalent"); now the task refuses it up front, and trains it with ``export.peft`` off."""
    dense = load_base(config_for(problem, "moe_base").base_model)
    moe = dataclasses.replace(
        dense.config, mlp_pattern=("moe",), moe=MoEConfig(num_experts=2, top_k=1, expert_dim=8), moe_impl="xla"
    )
    shapes = jax.eval_shape(DecoderLM(moe).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    params = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), nn.meta.unbox(shapes))
    base = dataclasses.replace(dense, config=moe, params=params)
    lora = {"adapter": {"targets": ["q", "experts"]}}
    with pytest.raises(ConfigError, match=r"export\.peft: an adapter on moe/experts/\w+ has no PEFT") as error:
        FinetuneTask(config_for(problem, "moe_lora", **lora), base)
    assert error.value.key == "export.peft"
    FinetuneTask(config_for(problem, "moe_lora", export={"peft": False}, **lora), base)
    FinetuneTask(config_for(problem, "moe_lora", adapter={"targets": ["q", "v"]}), base)


def moe_base(problem, name, moe, *, random=True):
    """The fixture's tiny base with its MLPs replaced by ``moe``: random weights, or ones where only
    their shapes matter (``random=False`` compiles nothing)."""
    dense = load_base(config_for(problem, name).base_model)
    config = dataclasses.replace(dense.config, mlp_pattern=("moe",), moe=moe)
    init = functools.partial(DecoderLM(config).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    if random:
        params = jax.device_get(nn.meta.unbox(jax.jit(init)()["params"]))  # one program, not one per op
    else:
        params = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), nn.meta.unbox(jax.eval_shape(init)["params"]))
    return dataclasses.replace(dense, config=config, params=params)


def test_qlora_stores_an_moe_bases_routed_experts_nf4_and_learns(problem):
    """Mixtral's layout (every MLP routed) and Qwen2-MoE's (a shared expert beside them). Before,
    the routed experts could not be stored quantized: QLoRA refused the first ("entry 'gate'
    matches no float weight") and kept the second's experts float, most of an MoE's weights. Now
    they are stored nf4 like the other projections, read back as floats a layer at a time; the
    adapters on them train while their codes stay bit for bit."""
    lora = {"rank": 4, "alpha": 8, "targets": ["q", "v", "experts"], "dropout": 0.0}  # PEFT has no routed experts
    layouts = {
        "mixtral": MoEConfig(num_experts=2, top_k=1, expert_dim=16),
        "qwen2_moe": MoEConfig(num_experts=2, top_k=1, expert_dim=16, shared_experts=1, shared_expert_gate=True),
    }
    for name, moe in layouts.items():
        trains = name == "mixtral"  # one run: the adapters on the dequantized experts learn
        # Which weights are stored nf4 is a question of shapes: the layout that does not train is built
        # and quantized as shapes, compiling neither its init nor its quantization.
        base = moe_base(problem, f"qlora_{name}_base", moe, random=trains)
        train = {"steps": 3, "eval_batches": 0, "aux_loss_weights": ROUTER}
        config = config_for(problem, f"qlora_{name}", base_model={"quantize": "nf4", "quantize_group_size": 16},
                            adapter=lora, train=train, export={"peft": False})  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing is left float without a word
            task = FinetuneTask(config, base)
        quantize = functools.partial(quantize_params, config=config.base_model.quantization())
        store = jax.jit(quantize) if trains else functools.partial(jax.eval_shape, quantize)
        stored = param_paths(store(task.base_params))
        codes = {p.removesuffix("/nf4") for p in stored if p.endswith("/nf4")}
        experts = {p for p in codes if "/experts/" in p}
        assert {p.rsplit("/", 1)[-1] for p in experts} == {"gate", "up", "down"}, codes
        assert len(codes - experts) == 4 + 3 * (name == "qwen2_moe")  # q k v o, and the shared expert's MLP
        if trains:
            trainer = make_trainer(config, task=task)
            trainer.train()
            trained = param_paths(jax.device_get(trainer.state.params))
            for path in experts:
                np.testing.assert_array_equal(trained[f"{path}/nf4"], stored[f"{path}/nf4"], err_msg=path)
                moved = trained[f"{path}_lora_b"]
                assert np.abs(moved).max() > 0, path  # B starts at zero: three steps moved it


def test_a_base_stored_quantized_is_refused_by_name(problem, monkeypatch):
    """An 'ember quantize' output (or a QLoRA run) as base_model.path: its linear maps are packed
    codes. Before, method full built the task and crashed in the trainer's sharding
    (IndexError: tuple index out of range), and method lora said adapter.targets 'q' matched no
    parameter; fine-tuning, GRPO and linearising all load the base through load_base."""
    import ember.training.finetune.base as base_module
    from ember.models.quantization import QuantizeConfig

    dense = load_base(config_for(problem, "quantized_base").base_model)
    quantized = jax.jit(quantize_params, static_argnums=1)(dense.params, QuantizeConfig(format="int8"))
    monkeypatch.setattr(base_module, "load_model", lambda *args, **kwargs: dataclasses.replace(dense, params=quantized))
    refused = r"base model .* stores its weights quantized \(layers/block_0/attn/\w/kernel and 6 more"
    for method in ("full", "lora"):
        config = config_for(problem, f"quantized_base_{method}", method=method, export={"peft": method == "lora"})
        with pytest.raises(ConfigError, match=refused) as error:
            FinetuneTask(config)
        assert error.value.key == "base_model.path"


def test_a_merged_export_the_model_cannot_take_is_refused_before_training(problem):
    """``export.merged`` writes a Hugging Face checkpoint of the base's type (``llama`` for an
    Ember run) or ``export.model_type``; one that type cannot express (an MoE model as llama, the
    Llama base as qwen2, which has q/k/v biases) failed in the export after the last step."""
    dense = load_base(config_for(problem, "merge_base").base_model)
    moe = dataclasses.replace(dense.config, mlp_pattern=("moe",), moe=MoEConfig(num_experts=2, top_k=1, expert_dim=8))
    shapes = jax.eval_shape(DecoderLM(moe).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    moe_base = dataclasses.replace(dense, config=moe, params=jax.tree.map(lambda s: np.ones(s.shape, s.dtype),
                                                                         nn.meta.unbox(shapes)))  # fmt: skip
    for base, export, key, message in (
        (moe_base, {"merged": True}, "export.merged", r"llama checkpoint \(the base's type.*mlp placements"),
        (dense, {"merged": True, "model_type": "qwen2"}, "export.model_type", r"qwen2 checkpoint: qkv_bias=False"),
    ):
        with pytest.raises(ConfigError, match=message) as error:
            FinetuneTask(config_for(problem, "merge", adapter={"targets": ["q"]}, export=export), base)
        assert error.value.key == key
    FinetuneTask(config_for(problem, "merge", export={"merged": True, "model_type": "mistral"}), dense)


PADDED = 16


def greedy_ids(model, prompt, steps=4):
    """Full-recompute argmax continuation of ``prompt`` under ``model`` (a ``tokens -> logits``
    function), up to ``steps`` tokens; the end-of-sequence token ends it (the engine does not
    return it)."""
    tokens = list(prompt)
    for _ in range(steps):
        padded = np.zeros((1, PADDED), np.int32)  # one shape for every call: causal, so padding is unseen
        padded[0, : len(tokens)] = tokens
        token = int(np.argmax(np.asarray(model(padded))[0, len(tokens) - 1]))
        if token == EOS:
            break
        tokens.append(token)
    return tokens[len(prompt) :]


def serve_run(run_dir, prompts, tmp_path):
    """``ember generate --checkpoint RUN_DIR`` on token prompts; the records' tokens."""
    lines = [json.dumps({"prompt_tokens": p, "max_tokens": 4}) + "\n" for p in prompts]
    (tmp_path / "in.jsonl").write_text("".join(lines))
    args = ["generate", "--checkpoint", str(run_dir), "--prompts", str(tmp_path / "in.jsonl"), "--out"]
    args += [str(tmp_path / "out.jsonl"), "--no-progress", "--num-slots", "2", "--token-budget", "8"]
    assert main(args) == 0
    return [json.loads(line)["tokens"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]


def test_adapter_dropout_applies_in_training_steps_not_in_evaluation(problem):
    """``adapter.dropout`` drops the adapter's input in a training step only: the trainer's
    evaluation (``eval_step``, which passes no ``step``) sees the model PEFT's ``eval()`` would."""
    from ember.core.sharding import unbox
    from ember.training.train_step import call_loss, eval_step
    from tests.moved_adapters import moved

    config = config_for(problem, "dropout", adapter={"rank": 2, "targets": ["q", "v"], "dropout": 0.5})
    task = FinetuneTask(config)
    params = unbox(task.init_variables(jax.random.key(0), task.pretrained())["params"])
    params = moved(params, 0, 0.5)  # B away from zero, so dropping the adapter's input changes the loss
    batch = next(iter(task.eval_data()))
    without_dropout = jax.jit(lambda p, b: lm_loss(p, b, model=task.model))(params, batch)
    evaluated = jax.jit(lambda p, b: eval_step(p, {}, b, None, loss_fn=task.loss))(params, batch)
    assert_allclose(evaluated[0], without_dropout.loss_sum)
    trained = jax.jit(lambda p, b: call_loss(task.loss, p, b, {}, rng=jax.random.key(1), teacher=None, step=3))
    assert abs(float(trained(params, batch).loss_sum) - float(without_dropout.loss_sum)) > 1e-3


def test_a_lora_run_serves_from_its_directory_as_peft_does(lora_run, problem, tmp_path):
    _, _, trainer, summary = lora_run
    prompts = [[1, 3, 4, 5, 10, 6, 7], [1, 3, 4, 5, 13, 6, 7]]
    base = transformers.AutoModelForCausalLM.from_pretrained(problem[0], attn_implementation="eager").eval()
    peft_model = peft.PeftModel.from_pretrained(base, summary["exports"]["adapter"]).eval()

    def forward(tokens):
        with torch.no_grad():
            return peft_model(torch.tensor(tokens)).logits.numpy()

    assert serve_run(trainer.run_dir, prompts, tmp_path) == [greedy_ids(forward, p) for p in prompts]


def test_mixlora_finetune_learns_logs_its_router_and_serves(problem, tmp_path):
    config = config_for(
        problem,
        "mixlora",
        method="mixlora",
        mixlora={"num_experts": 4, "top_k": 2, "rank": 2},
        adapter={"rank": 2, "targets": ["q", "v"]},
        optim={"lr": 2e-2},
        train={"steps": 12, "aux_loss_weights": ROUTER},
        export={"peft": False},
    )
    task = FinetuneTask(config)
    trainer = make_trainer(config, task=task)
    trainer.train()
    params = jax.device_get(trainer.state.params)
    assert mean_eval_loss(task, params) < 0.5 * mean_eval_loss(task, task.base_params)  # measured 3.40 -> 1.30
    logged = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [entry for entry in logged if "loss" in entry][-1]
    assert "load_balance" in last and abs(sum(last[f"expert_load/{e}"] for e in range(4)) - 1) < 1e-5
    model = DecoderLM(task.model_config)
    prompts = [[1, 3, 4, 5, 11, 6, 7]]
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens)[0])
    expected = [greedy_ids(forward, p) for p in prompts]
    assert serve_run(trainer.run_dir, prompts, tmp_path) == expected


def test_mixlora_needs_router_loss_weights(problem):
    with pytest.raises(ConfigError) as error:
        config_for(problem, "bad", method="mixlora")
    assert error.value.key == "train.aux_loss_weights"


def test_a_resumed_lora_run_continues_the_same_trajectory(problem):
    """Stopped after 3 steps and resumed to 6, a run matches one that never stopped: the
    data iterator's position and the adapters' optimizer state come back exactly."""
    sections = dict(
        adapter={"rank": 2, "targets": ["q", "v"], "dropout": 0.1},
        optim={"lr": 1e-2, "schedule": {"kind": "constant"}},
        export={"peft": False},
    )
    whole = config_for(problem, "whole", train={"steps": 6, "log_every": 1}, **sections)
    make_trainer(whole, task=FinetuneTask(whole)).train()
    first = config_for(problem, "parts", train={"steps": 3, "log_every": 1}, **sections)
    make_trainer(first, task=FinetuneTask(first)).train()
    rest = config_for(problem, "parts", train={"steps": 6, "log_every": 1}, **sections)
    resumed = make_trainer(rest, resume=True, task=FinetuneTask(rest))
    resumed.train()

    def losses(run):
        lines = [json.loads(line) for line in (problem[2] / run / "metrics.jsonl").read_text().splitlines()]
        return {entry["step"]: entry["loss"] for entry in lines if "loss" in entry}

    assert losses("parts") == losses("whole") and len(losses("whole")) == 6


def test_a_lora_run_resumes_with_base_model_scan_layers_changed(problem):
    """base_model.scan_layers is a runtime setting (a resume may change it), but the fine-tuning
    task read a checkpoint only in its own layout: orbax refused the tree (params.layers
    missing) with a traceback. Resumed unscanned, the run continues the scanned trajectory."""
    sections = dict(adapter={"rank": 2, "targets": ["q", "v"]}, optim={"lr": 1e-2, "schedule": {"kind": "constant"}},
                    export={"peft": False}, train={"log_every": 1, "eval_batches": 0})  # fmt: skip

    def config(name, steps, *changes):
        values = {**sections, "train": {**sections["train"], "steps": steps}}
        return config_for(problem, name, **values, base_model={**COMMON["base_model"], **dict(changes)})

    whole = config("scan_whole", 4)
    make_trainer(whole, task=FinetuneTask(whole)).train()
    first = config("scan_parts", 2)
    make_trainer(first, task=FinetuneTask(first)).train()
    rest = config("scan_parts", 4, ("scan_layers", False))
    resumed = make_trainer(rest, resume=True, task=FinetuneTask(rest))
    assert "group_0" in resumed.state.params and int(resumed.state.step) == 2
    resumed.train()

    def losses(run):
        lines = [json.loads(line) for line in (problem[2] / run / "metrics.jsonl").read_text().splitlines()]
        return [entry["loss"] for entry in lines if "loss" in entry]

    assert len(losses("scan_parts")) == 4
    assert_allclose(np.array(losses("scan_parts")), np.array(losses("scan_whole")), dtype=np.float32, scale=20)


def test_lora_ga_gradient_batches_are_the_global_batches_on_every_process(problem, monkeypatch):
    """LoRA-GA's batches travel into the jitted initialisation as one argument, which JAX takes as
    the same on every process; each process passed its own rows, so in a multi-process run the
    processes initialised the adapters from different gradients."""
    config = config_for(problem, "ga", adapter={"init": "lora_ga", "ga_batches": 2})
    single = FinetuneTask(config).pretrained()["ga_batches"]
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    second_of_two = FinetuneTask(config).pretrained()["ga_batches"]
    assert single["tokens"].shape == (2, 8, 32)
    for name, value in single.items():
        np.testing.assert_array_equal(second_of_two[name], value, err_msg=name)


JOIN_FIRST = """
import sys
import jax
from jax._src import xla_bridge
from ember.core.config import load_config
from ember.training.launcher import KINDS
import importlib

def initialize(**_):  # stands in for jax.distributed.initialize, which refuses a started backend
    sys.exit(0 if not xla_bridge.backends_are_initialized() else 3)

jax.distributed.initialize = initialize
kind, base, data = sys.argv[1:]
entry = importlib.import_module(KINDS[kind])
values = {"kind": kind, "run_dir": data + "/run", "base_model": {"path": base},
          "data": {"train": data + "/train.jsonl"},
          "distributed": {"coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": 0}}
if kind == "linearize":
    values["data"] = {"dataset": data + "/no_dataset"}
if kind == "grpo":
    del values["data"]
entry.run(load_config(entry.CONFIG_SCHEMA, values))
sys.exit(4)
"""


@pytest.mark.parametrize("kind", ["finetune", "linearize", "grpo"])
def test_a_multi_process_run_joins_its_processes_before_loading_the_base(problem, kind):
    """jax.distributed.initialize must run before anything starts a JAX backend, but these kinds
    loaded the base model (onto a device) first and joined the processes only in make_trainer:
    every multi-process fine-tuning or linearising run died with jax's RuntimeError."""
    import os
    import subprocess
    import sys

    from tests.training.lm_runs import REPO

    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", JOIN_FIRST, kind, str(problem[0]), str(problem[2])], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def test_two_processes_fine_tune_and_export_the_adapter(problem, tmp_path):
    """The end-of-run export read the trained weights on the main process only (jax.device_get),
    which fails for weights sharded over several processes (FSDP across them): rank 0 died after
    training."""
    from ember.core.config import to_yaml
    from tests.training.lm_runs import ember_train, free_port

    config = config_for(problem, "unused", train={"steps": 2, "batch_size": 4, "seq_len": 16, "eval_batches": 0},
                        adapter={"rank": 2, "targets": ["q", "v"]}, checkpoint={"async_save": False})  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(config))
    port = free_port()
    workers = [
        ember_train(path, f"run_dir={tmp_path / 'run'}", f"distributed.coordinator_address=127.0.0.1:{port}",
                    "distributed.num_processes=2", f"distributed.process_id={rank}", "mesh.data=1",
                    "mesh.fsdp=-1", devices=2)
        for rank in range(2)
    ]  # fmt: skip
    outputs = [worker.communicate(timeout=300)[0] for worker in workers]
    assert all(worker.returncode == 0 for worker in workers), [out[-3000:] for out in outputs]
    adapter = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 2


def test_examples_cut_before_their_completion_are_counted_or_refused(problem, tmp_path):
    """An example longer than train.seq_len + 1 tokens is cut to its start: one whose completion
    lay past the cut trained nothing, and a file of only such examples trained a zero loss for
    the whole run, without a word."""
    long = {"prompt": "what does the cow say ? what does the dog say ?", "completion": " moo"}  # 12 + 2 tokens
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(long) + "\n" + json.dumps({**long, "prompt": "cow"}) + "\n")  # 2 + 2 tokens
    data = {"train": str(path), "eval": str(path)}
    with pytest.warns(UserWarning) as warned:
        FinetuneTask(config_for(problem, "cut", data=data, train={"seq_len": 8}))
    for name in ("train", "eval"):
        message = rf"data\.{name}: 1 of 2 examples are longer than train\.seq_len \+ 1 = 9 tokens .* 1 of them keep no"
        assert any(re.search(message, str(w.message)) for w in warned), [str(w.message) for w in warned]
    path.write_text(json.dumps(long) + "\n")
    with pytest.raises(ConfigError, match=r"cut to its first 9 tokens before any completion") as error:
        FinetuneTask(config_for(problem, "cut", data=data, train={"seq_len": 8}))
    assert error.value.key == "train.seq_len"


@pytest.mark.parametrize(
    "sections, unused",
    [
        ({"method": "full", "adapter": {"rank": 4, "dropout": 0.1}}, "adapter.rank, adapter.dropout"),
        ({"mixlora": {"top_k": 1}}, "mixlora.top_k"),
        ({"adapter": {"ga_gamma": 4.0}}, r"adapter.ga_gamma \(read by adapter.init lora_ga only\)"),
        ({"export": {"model_type": "mistral"}}, r"export.model_type \(read by export.merged only\)"),
    ],
)
def test_settings_the_method_never_reads_are_named_in_a_warning(problem, sections, unused):
    """method full trained every weight with the adapter section's dropout and rank silently
    dropped (likewise a mixlora section under method lora, LoRA-GA's keys under another init)."""
    with pytest.warns(UserWarning, match=rf"does not use {unused}: ignored"):
        config_for(problem, "unused", **sections)


def test_a_lora_run_as_base_model_is_a_config_error(lora_run, problem):
    """base_model.path may name an Ember run; a LoRA run's weights carry its adapters, which
    the fresh model's init does not have: a ValueError traceback (pytree structure) from box_like."""
    config = config_for(problem, "on_lora", method="full", export={"peft": False})  # lora: "q already has an adapter"
    config = dataclasses.replace(
        config, base_model=dataclasses.replace(config.base_model, path=str(lora_run[2].run_dir))
    )
    with pytest.raises(ConfigError, match=r"is a fine-tuning run with adapters.*run_dir/merged") as error:
        make_trainer(config, task=FinetuneTask(config))
    assert error.value.key == "base_model.path"


def test_a_merged_export_from_a_fine_tuned_run_carries_its_tokenizer(problem, tmp_path):
    """A run fine-tuned from another (full) run, an Ember directory without tokenizer files or config.json,
    wrote merged/ with neither tokenizer nor eos_token_id: load_model gave tokenizer None and no
    end-of-sequence id, transformers its class default eos 2."""
    import types

    from ember.training.finetune.export import export_hook

    first = config_for(problem, "first", method="full", train={"steps": 1}, export={"peft": False})
    make_trainer(first, task=FinetuneTask(first)).train()
    config = config_for(problem, "again", export={"peft": False, "merged": True}, adapter={"targets": ["q"]})
    config = dataclasses.replace(config, base_model=dataclasses.replace(config.base_model, path=first.run_dir))
    task = FinetuneTask(config)
    params = nn.meta.unbox(task.init_variables(jax.random.key(0), task.pretrained())["params"])
    trainer = types.SimpleNamespace(run_dir=tmp_path, is_main=True, results={})
    export_hook(task)(types.SimpleNamespace(state=types.SimpleNamespace(params=params), trainer=trainer))
    merged = load_model(tmp_path / "merged")
    assert merged.eos_ids == (EOS,) and merged.tokenizer.chat_template == CHAT_TEMPLATE
    assert (
        merged.tokenizer.encode("what does the cow say ?").tolist()
        == task.base.tokenizer.encode("what does the cow say ?").tolist()
    )
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["eos_token_id"] == EOS


def test_a_merged_export_of_a_byte_level_base_carries_a_tokenizer_that_encodes_as_it_does(tmp_path):
    """A base trained with Ember's byte tokenizer (an 'ember train' LM run) wrote merged/ with no
    tokenizer files: load_model gave tokenizer None, so neither 'ember generate --prompt' nor
    transformers' AutoTokenizer could read text for the exported model."""
    import types

    from ember.core.hf_tokenizer import load_hf_tokenizer
    from ember.core.tokenizer import ByteTokenizer
    from ember.training.finetune.export import _copy_tokenizer

    byte = ByteTokenizer()
    (tmp_path / "config.json").write_text("{}")  # what hf.save wrote
    _copy_tokenizer(types.SimpleNamespace(tokenizer=byte, eos_ids=(byte.eos_id,)), tmp_path / "no_hf", tmp_path)
    ours, theirs = load_hf_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.eos_id == theirs.eos_token_id == byte.eos_id and ours.bos_id is None
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == byte.eos_id
    rng = np.random.default_rng(0)
    for _ in range(20):
        text = "".join(map(chr, rng.choice([*range(9, 127), *range(160, 0x3000), *range(0x1F300, 0x1F400)], 40)))
        expected = byte.encode(text).tolist()
        assert ours.encode(text).tolist() == theirs(text)["input_ids"] == expected, text
        ids = rng.integers(0, byte.vocab_size, 30).tolist()  # invalid UTF-8 and the end-of-document id too
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == byte.decode(ids), ids


def test_a_fine_tuned_mamba2_base_exports_merged_as_mamba2(problem, tmp_path):
    """A Hugging Face Mamba-2 base: Ember reads and writes its checkpoints, but export.merged took
    only the attention models' types, so the run was refused before training ("cannot be written
    as a Hugging Face llama checkpoint (the base's type ...)", and export.model_type mamba2 was not
    a choice). Now merged/ is a mamba2 checkpoint that transformers loads with Ember's logits."""
    import types

    from ember.training.finetune.export import export_hook
    from tests.hf_peers import random_hf_model
    from tests.moved_adapters import moved
    from tests.training.finetune_setup import WORDS, write_tokenizer

    hf_config = transformers.Mamba2Config(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, head_dim=16, num_heads=4,
        n_groups=1, conv_kernel=4, chunk_size=16, bos_token_id=1, eos_token_id=EOS, pad_token_id=None,
    )  # fmt: skip
    random_hf_model(hf_config, seed=1).save_pretrained(tmp_path / "mamba2")
    write_tokenizer(tmp_path / "mamba2")
    lora = {"targets": ["o"], "rank": 2, "dropout": 0.0}  # the mixer's out_proj
    config = config_for(problem, "mamba2", adapter=lora, export={"peft": False, "merged": True})
    config = dataclasses.replace(
        config, base_model=dataclasses.replace(config.base_model, path=str(tmp_path / "mamba2"))
    )
    task = FinetuneTask(config)
    params = moved(nn.meta.unbox(task.init_variables(jax.random.key(0), task.pretrained())["params"]), 0, 0.3)
    trainer = types.SimpleNamespace(run_dir=tmp_path, is_main=True, results={})
    export_hook(task)(types.SimpleNamespace(state=types.SimpleNamespace(params=params), trainer=trainer))
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "mamba2"
    tokens = np.asarray([[1, 3, 4, 5, 10, 6, 7, 18, 2]])
    ember = np.asarray(DecoderLM(task.model_config).apply({"params": params}, jnp.asarray(tokens))[0])
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert_allclose(merged(torch.tensor(tokens)).logits.numpy(), ember, scale=10)
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mamba2").eval()
        assert not np.allclose(base(torch.tensor(tokens)).logits.numpy(), ember, atol=1e-3)  # the adapters count


def test_a_linearize_or_grpo_run_as_base_model_has_its_adapters_merged(problem, tmp_path, monkeypatch):
    """A linearising run (its stage-2 LoRA on q/k/v) or a GRPO LoRA run as base_model.path was
    refused, pointing at a merged export those runs do not write ("fine-tune its merged export (a
    run with export.merged true ...)"), so a linearised or GRPO-trained model could be neither
    fine-tuned, nor trained with GRPO again. Their adapters are now folded into the base; a
    fine-tuning run, which has a merged export, is still refused."""
    import ember.training.finetune.base as base_module
    from ember.models.adapters import LoraConfig, add_lora, merged_weights
    from tests.moved_adapters import moved

    dense = load_base(config_for(problem, "merge_on_load").base_model)
    adapted = moved(add_lora(dense.params, LoraConfig(rank=2, targets=("q", "v")), jax.random.key(0)), 0, 0.2)
    monkeypatch.setattr(base_module, "load_model", lambda *args, **kwargs: dataclasses.replace(dense, params=adapted))
    for kind in ("linearize", "grpo", "finetune"):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "config.yaml").write_text(f"kind: {kind}\n")
        config = config_for(problem, f"on_{kind}", method="full", export={"peft": False})
        config = dataclasses.replace(
            config, base_model=dataclasses.replace(config.base_model, path=str(tmp_path / kind))
        )
        if kind == "finetune":
            with pytest.raises(ConfigError, match="is a fine-tuning run with adapters"):
                FinetuneTask(config)
            continue
        task = FinetuneTask(config)
        expected = param_paths(merged_weights(adapted))
        assert param_paths(task.base_params).keys() == expected.keys()
        for path, value in param_paths(task.base_params).items():
            np.testing.assert_array_equal(value, expected[path], err_msg=path)

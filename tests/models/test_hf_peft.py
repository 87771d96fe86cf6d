"""PEFT interop against the real ``peft`` on tiny random ``transformers`` models (built here,
nothing downloaded): adapters trained (perturbed) in Ember and saved load with
``PeftModel.from_pretrained`` and give Ember's logits; PEFT adapters with random non-zero
weights (ranks, targets, rsLoRA, DoRA, per-module ranks and alphas) load into Ember and give
PEFT's logits; PiSSA adapters save against the original base; PEFT options and tensors Ember
does not implement are refused, not dropped."""

import dataclasses
import functools
import json
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ember.core.errors import DataError, PathNotFoundError
from ember.core.tree import param_paths
from ember.models import hf
from ember.models.adapters import LoraConfig, add_lora
from ember.models.adapters.lora_ga import lora_ga_init
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.hf.peft import load_peft_adapter, save_peft_adapter, with_adapter
from tests.hf_peers import random_hf_model
from tests.moved_adapters import moved
from tests.tolerances import assert_allclose

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

HF_CONFIG = dict(
    vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
TOKENS = np.random.default_rng(0).integers(0, 67, (2, 10))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(transformers model, its directory, Ember config, Ember params) of a tiny Qwen2 (q/k/v biases)."""
    model = random_hf_model(transformers.Qwen2Config(**HF_CONFIG), seed=3)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    config, params = hf.load(path, attention_impl="xla")
    return model, path, config, params


def ember_logits(config, params):
    return np.asarray(_forward(config, params))


@functools.partial(jax.jit, static_argnums=0)  # one program per tree: op by op a forward compiled ~40
def _forward(config, params):
    return DecoderLM(config).apply({"params": params}, jnp.asarray(TOKENS))[0]


def peft_logits(peft_model):
    with torch.no_grad():
        return peft_model(torch.tensor(TOKENS)).logits.numpy()


def trained(params, seed, scale=0.1):
    """Adapter factors and magnitudes moved away from their initial values, as training would."""
    return moved(params, seed, scale)


def fresh_hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


@pytest.mark.parametrize(
    "lora",
    [
        LoraConfig(rank=4, alpha=8, targets=("q", "k", "v", "o", "gate", "up", "down")),
        LoraConfig(rank=4, alpha=6, targets=("q", "v", "down"), rslora=True, dora=True, rank_pattern={"down": 2}),
        LoraConfig(rank=2, alpha=4, targets=("q", "up"), init="pissa"),
        LoraConfig(rank=2, alpha=4, targets=("v", "down"), init="lora_ga"),
    ],
    ids=["lora_all_targets", "dora_rslora_ranks", "pissa", "lora_ga"],
)
def test_ember_adapter_loads_in_peft_with_the_same_logits(base, lora, tmp_path):
    _, path, config, params = base

    @jax.jit  # one program: op by op the set-up compiled ~35
    def adapt(params):
        adapted = add_lora(params, lora, jax.random.key(1))
        if lora.init == "lora_ga":  # from a made-up gradient: the export only needs W changed and A0, B0 kept
            gradients = jax.tree.map(lambda x: jax.random.normal(jax.random.key(3), np.shape(x)), params)
            adapted = lora_ga_init(adapted, gradients)
        return trained(adapted, seed=2)

    adapted = adapt(params)
    expected = ember_logits(config, adapted)
    save_peft_adapter(tmp_path, config, adapted, base_model=str(path))
    peft_model = peft.PeftModel.from_pretrained(fresh_hf(path), tmp_path).eval()
    assert_allclose(peft_logits(peft_model), expected, scale=10)  # 1e-4 in f32
    assert not np.allclose(expected, ember_logits(config, params), atol=1e-3)
    # ...and back into Ember (PiSSA and LoRA-GA come back as rank-2r adapters on the original base).
    reloaded = with_adapter(params, load_peft_adapter(tmp_path, config))
    assert_allclose(ember_logits(config, reloaded), expected, scale=10)


@pytest.mark.parametrize(
    "options",
    [
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        dict(r=4, lora_alpha=5, target_modules=["q_proj", "o_proj", "up_proj"], use_rslora=True),
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["k_proj", "down_proj", "gate_proj"],
            use_dora=True,
            rank_pattern={"down_proj": 2},
            alpha_pattern={"gate_proj": 3},
        ),
        dict(r=2, lora_alpha=4, target_modules=["q_proj"], layers_to_transform=[1]),
    ],
    ids=["lora", "rslora", "dora_patterns", "one_layer"],
)
def test_peft_adapter_loads_in_ember_with_the_same_logits(base, options, tmp_path):
    _, path, config, params = base
    torch.manual_seed(5)
    peft_model = peft.get_peft_model(fresh_hf(path), peft.LoraConfig(init_lora_weights=False, **options)).eval()
    with torch.no_grad():  # DoRA's magnitudes away from ||W|| too
        for name, value in peft_model.named_parameters():
            if "lora_magnitude" in name:
                value.mul_(1 + 0.2 * torch.rand_like(value))
    peft_model.save_pretrained(tmp_path)
    expected = peft_logits(peft_model)
    for scan_layers in (True, False):
        layout = dataclasses.replace(config, scan_layers=scan_layers)
        layout_params = params if scan_layers else hf.load(path, attention_impl="xla", scan_layers=False)[1]
        adapted = with_adapter(layout_params, load_peft_adapter(tmp_path, layout))
        assert_allclose(ember_logits(layout, adapted), expected, scale=10)
    assert not np.allclose(expected, ember_logits(config, params), atol=1e-3)


def test_bad_adapter_directories_are_clear_errors(base, tmp_path):
    _, _, config, params = base
    with pytest.raises(PathNotFoundError, match=r"adapter_config\.json"):
        load_peft_adapter(tmp_path, config)
    with pytest.raises(DataError, match="no adapters"):
        save_peft_adapter(tmp_path, config, params)


def test_dora_with_dropout_in_training_matches_peft():
    """PEFT (and the DoRA authors' code) put DoRA's rescaling of the base output, ``(m / ||W +
    s A B|| - 1) x W``, on the adapter path, so in training it sees the dropped input. Ember
    rescaled the undropped ``x W`` instead (2.6 off PEFT's output here). PEFT's dropout module
    is replaced by the input Ember dropped (read off a second Ember adapter with ``A = I``, the
    same dropout RNG so the same mask)."""
    from ember.models.layers.projection import Projection

    d_in, d_out, rank, alpha = 8, 6, 2, 3.0
    shapes = [(d_in, d_out), (d_in, rank), (rank, d_out), (3, d_in), (d_in, d_in)]
    w, a, b, x, w2 = (np.random.default_rng(i).standard_normal(s).astype(np.float32) for i, s in enumerate(shapes))
    magnitude = np.linalg.norm(w + alpha / rank * a @ b, axis=0) * np.linspace(0.5, 1.5, d_out, dtype=np.float32)
    rngs = {"dropout": jax.random.key(4)}
    dora = {"kernel": w, "kernel_lora_a": a, "kernel_lora_b": b, "kernel_lora_scale": np.float32(alpha / rank),
            "kernel_lora_magnitude": magnitude, "kernel_lora_dropout": np.float32(0.5)}  # fmt: skip
    ember = np.asarray(Projection((d_out,), ("embed", "mlp")).apply({"params": dora}, x, rngs=rngs))
    eye = np.eye(d_in, dtype=np.float32)
    reader = {"kernel": w2, "kernel_lora_a": eye, "kernel_lora_b": eye, "kernel_lora_scale": np.float32(1.0),
              "kernel_lora_dropout": np.float32(0.5)}  # fmt: skip
    dropped = np.asarray(Projection((d_in,), ("embed", "mlp")).apply({"params": reader}, x, rngs=rngs)) - x @ w2
    assert 0 < np.mean(dropped == 0) < 1  # some of the input dropped, not all

    class Dropped(torch.nn.Module):
        def forward(self, _):
            return torch.tensor(dropped)

    layer = torch.nn.Sequential()
    layer.add_module("proj", torch.nn.Linear(d_in, d_out, bias=False))
    lora = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=["proj"], use_dora=True, lora_dropout=0.5)
    model = peft.get_peft_model(layer, lora)
    proj = model.base_model.model.proj
    with torch.no_grad():
        proj.base_layer.weight.copy_(torch.tensor(w.T))
        proj.lora_A["default"].weight.copy_(torch.tensor(a.T))
        proj.lora_B["default"].weight.copy_(torch.tensor(b.T))
        proj.lora_magnitude_vector["default"].weight.copy_(torch.tensor(magnitude))
    proj.lora_dropout["default"] = Dropped()
    with torch.no_grad():
        expected = model.train()(torch.tensor(x)).numpy()
    assert_allclose(ember, expected, scale=10)


def test_the_saved_config_carries_the_adapters_dropout(base, tmp_path):
    """adapter_config.json said lora_dropout 0.0 whatever rate the adapters trained with, so
    training on in PEFT (``is_trainable=True``) silently dropped nothing."""
    _, _, config, params = base
    adapted = add_lora(params, LoraConfig(rank=2, targets=("q",), dropout=0.05), jax.random.key(1))
    save_peft_adapter(tmp_path / "one", config, adapted)
    assert peft.LoraConfig.from_pretrained(tmp_path / "one").lora_dropout == 0.05
    mixed = add_lora(adapted, LoraConfig(rank=2, targets=("v",), dropout=0.2), jax.random.key(2))
    with pytest.raises(DataError, match=r"one lora_dropout for every module; these adapters use \[0.05, 0.2\]"):
        save_peft_adapter(tmp_path / "mixed", config, mixed)


def test_factors_whose_rank_is_not_the_config_s_r_are_named(tmp_path):
    """PEFT refuses an adapter whose factors' rank is not its ``r`` (or ``rank_pattern``
    entry) with a size mismatch; Ember loaded it, scaling by alpha / (the factors' rank)."""
    peft.LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj"]).save_pretrained(tmp_path)
    q_proj, draw = "base_model.model.model.layers.0.self_attn.q_proj", np.random.default_rng(1).standard_normal
    factors = {"lora_A.weight": draw((4, 64), np.float32), "lora_B.weight": draw((64, 4), np.float32)}
    save_file({f"{q_proj}.{name}": x for name, x in factors.items()}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(DataError, match=r"q_proj has rank-4 factors but adapter_config\.json gives it r=2"):
        load_peft_adapter(tmp_path, ModelConfig())
    settings = json.loads((tmp_path / "adapter_config.json").read_text())
    pattern = {**settings, "rank_pattern": {"q_proj": 4}}  # the module's own rank: loads
    (tmp_path / "adapter_config.json").write_text(json.dumps(pattern))
    assert load_peft_adapter(tmp_path, ModelConfig())


@pytest.mark.parametrize("case", ["use_dora_false", "no_magnitudes"])
def test_a_dora_flag_that_disagrees_with_the_tensors_is_named(base, case, tmp_path):
    """PEFT follows ``use_dora``: magnitudes under ``use_dora: false`` are ignored (plain LoRA),
    and ``use_dora: true`` without them takes ``||W||``. Ember followed the tensors instead and
    gave other logits (0.16 and 0.50 off PEFT's in a probe on this base, r=4 on q and v); now it
    refuses such a file."""
    _, path, config, _ = base
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], use_dora=True, init_lora_weights=False)
    peft.get_peft_model(fresh_hf(path), lora).save_pretrained(tmp_path)
    if case == "use_dora_false":
        settings = json.loads((tmp_path / "adapter_config.json").read_text())
        (tmp_path / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": False}))
    else:
        tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
        kept = {name: value for name, value in tensors.items() if not name.endswith("lora_magnitude_vector")}
        save_file(kept, str(tmp_path / "adapter_model.safetensors"))
    flag, has = ("False", "has") if case == "use_dora_false" else ("True", "has no")
    with pytest.raises(DataError, match=rf"use_dora={flag} but model\.layers\.0\.self_attn\.q_proj {has} lora_magn"):
        load_peft_adapter(tmp_path, config)


@pytest.mark.parametrize(
    "option",
    [
        dict(bias="lora_only"),
        dict(lora_bias=True),
        dict(modules_to_save=["lm_head"]),
        dict(layer_replication=[[0, 2]]),
        dict(trainable_token_indices=[3]),
    ],
    ids=lambda option: next(iter(option)),
)
def test_peft_options_ember_does_not_implement_are_named(option, tmp_path):
    """Options that change PEFT's computation are refused from adapter_config.json alone."""
    peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], **option).save_pretrained(tmp_path)
    q_proj, draw = "base_model.model.model.layers.0.self_attn.q_proj", np.random.default_rng(1).standard_normal
    factors = {"lora_A.weight": draw((4, 64), np.float32), "lora_B.weight": draw((64, 4), np.float32)}
    save_file({f"{q_proj}.{name}": x for name, x in factors.items()}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(DataError, match=f"{next(iter(option))}=.*Ember does not implement"):
        load_peft_adapter(tmp_path, ModelConfig())


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq"])
def test_adapters_whose_init_rewrites_the_base_are_named(init, tmp_path):
    """PEFT loads these by first rewriting the base (PiSSA: ``W - scale A0 B0``); Ember reading
    their factors onto the original base gave another model (0.45 off PEFT's logits for PiSSA)."""
    peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]).save_pretrained(tmp_path)
    config_file = tmp_path / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "init_lora_weights": init}))
    q_proj, draw = "base_model.model.model.layers.0.self_attn.q_proj", np.random.default_rng(1).standard_normal
    factors = {"lora_A.weight": draw((4, 64), np.float32), "lora_B.weight": draw((64, 4), np.float32)}
    save_file({f"{q_proj}.{name}": x for name, x in factors.items()}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(DataError, match=f"init_lora_weights='{init}'.*path_initial_model_for_weight_conversion"):
        load_peft_adapter(tmp_path, ModelConfig())
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "init_lora_weights": "gaussian"}))
    assert load_peft_adapter(tmp_path, ModelConfig())  # an init that leaves the base alone loads


def test_a_config_without_lora_alpha_takes_peft_s_default_and_bad_json_is_named(tmp_path):
    peft.LoraConfig(r=4, lora_alpha=2, target_modules=["q_proj"]).save_pretrained(tmp_path)
    settings = json.loads((tmp_path / "adapter_config.json").read_text())
    del settings["lora_alpha"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(settings))
    q_proj, draw = "base_model.model.model.layers.0.self_attn.q_proj", np.random.default_rng(1).standard_normal
    factors = {"lora_A.weight": draw((4, 64), np.float32), "lora_B.weight": draw((64, 4), np.float32)}
    save_file({f"{q_proj}.{name}": x for name, x in factors.items()}, str(tmp_path / "adapter_model.safetensors"))
    alpha = peft.LoraConfig.from_pretrained(tmp_path).lora_alpha
    (scale,) = [v for p, v in param_paths(load_peft_adapter(tmp_path, ModelConfig())).items() if p.endswith("scale")]
    assert alpha == 8 and float(np.asarray(scale).reshape(-1)[0]) == alpha / 4
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(DataError, match=r"adapter_config\.json is not a JSON file"):
        load_peft_adapter(tmp_path, ModelConfig())


def test_an_adapter_of_another_model_size_is_named(tmp_path):
    """Factors that do not fit the model (an adapter trained on another base) are refused by
    name, not failed on in a reshape."""
    peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]).save_pretrained(tmp_path)
    q_proj, draw = "base_model.model.model.layers.0.self_attn.q_proj", np.random.default_rng(1).standard_normal
    factors = {"lora_A.weight": draw((4, 48), np.float32), "lora_B.weight": draw((48, 4), np.float32)}
    save_file({f"{q_proj}.{name}": x for name, x in factors.items()}, str(tmp_path / "adapter_model.safetensors"))
    config = ModelConfig(d_model=32, num_heads=4, num_layers=1)
    with pytest.raises(
        DataError, match=r"q_proj has lora_A \[4, 48\] and lora_B \[48, 4\]; .* takes \[r, 32\] and \[32, r\]"
    ):
        load_peft_adapter(tmp_path, config)


@pytest.mark.parametrize(
    "module, reason",
    [
        ("mixer.in_proj", r"fused in_proj .* merge_and_unload\(\)"),
        ("self_attn.qkv_proj", r"it loads LoRA on model\.layers\.<i>\.\{self_attn\.q_proj, .*mlp\.down_proj"),
    ],
)
def test_an_adapter_for_a_module_ember_does_not_have_says_what_loads(module, reason, tmp_path):
    """PEFT's only Mamba-2 target is the fused in_proj, which Ember splits into five projections; the
    error said only 'is for a module Ember does not have', with neither why nor what to do."""
    peft.LoraConfig(r=4, lora_alpha=8, target_modules=[module.split(".")[-1]]).save_pretrained(tmp_path)
    stem, draw = f"base_model.model.model.layers.0.{module}", np.random.default_rng(1).standard_normal
    factors = {"lora_A.weight": draw((4, 64), np.float32), "lora_B.weight": draw((64, 4), np.float32)}
    save_file({f"{stem}.{name}": x for name, x in factors.items()}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(DataError, match=rf"is for a module Ember does not have.*{reason}"):
        load_peft_adapter(tmp_path, ModelConfig())


def test_adapter_tensors_ember_would_not_use_are_named(base, tmp_path):
    """LoRA on the embedding (``lora_embedding_A`` / ``_B``) is not read: refused, not dropped."""
    _, path, config, _ = base
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "embed_tokens"], init_lora_weights=False)
    peft.get_peft_model(fresh_hf(path), lora).save_pretrained(tmp_path)
    with pytest.raises(DataError, match=r"tensors Ember does not use: .*embed_tokens\.lora_embedding_A"):
        load_peft_adapter(tmp_path, config)


@pytest.mark.parametrize("layers", [{"q": 1, "v": 1}, {"q": 0, "v": 1}], ids=["q_v_on_layer_1", "q_on_0_v_on_1"])
def test_adapters_on_some_layers_load_in_peft_on_those_layers_only(base, layers, tmp_path):
    """adapter_config.json named the modules only (``q_proj``, ``v_proj``), so PEFT put adapters
    on every layer's: "Found missing adapter keys" for layer 0's, and zero adapters there that
    ``is_trainable=True`` would train. Now it says the layers (``layers_to_transform``) or, where
    the modules' layers differ, the modules' full names; the file reads back into Ember."""
    _, path, config, _ = base
    layout = dataclasses.replace(config, scan_layers=False)
    params = hf.load(path, attention_impl="xla", scan_layers=False)[1]
    targets = tuple(rf"group_{layer}/block_0/attn/{name}/kernel$" for name, layer in layers.items())
    adapted = trained(add_lora(params, LoraConfig(rank=2, alpha=4, targets=targets), jax.random.key(1)), seed=2)
    expected = ember_logits(layout, adapted)
    save_peft_adapter(tmp_path, layout, adapted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = peft.PeftModel.from_pretrained(fresh_hf(path), tmp_path).eval()
    assert not [w for w in caught if "missing adapter keys" in str(w.message)]
    modules = {f"model.layers.{layer}.self_attn.{name}_proj" for name, layer in layers.items()}
    lora_a = [name for name, _ in peft_model.named_modules() if name.endswith(".lora_A")]
    assert {name[len("base_model.model.") : -len(".lora_A")] for name in lora_a} == modules
    settings = json.loads((tmp_path / "adapter_config.json").read_text())
    if layers == {"q": 1, "v": 1}:
        assert (settings["target_modules"], settings["layers_to_transform"]) == (["q_proj", "v_proj"], [1])
    else:
        assert settings["target_modules"] == sorted(modules) and "layers_to_transform" not in settings
    assert_allclose(peft_logits(peft_model), expected, scale=10)
    assert_allclose(ember_logits(layout, with_adapter(params, load_peft_adapter(tmp_path, layout))), expected, scale=10)


def test_a_scanned_load_of_a_one_layer_adapter_saves_that_layer_only(base, tmp_path):
    """Loaded with ``scan_layers``, the layers without an adapter get zero ones (to stack); saving
    wrote them as adapters of every layer. Zero factors (no DoRA magnitude) are not written."""
    _, path, config, params = base
    one_layer = dict(target_modules=["q_proj"], layers_to_transform=[1], init_lora_weights=False)
    lora = peft.LoraConfig(r=2, lora_alpha=4, **one_layer)
    peft.get_peft_model(fresh_hf(path), lora).save_pretrained(tmp_path / "peft")
    save_peft_adapter(tmp_path / "ember", config, with_adapter(params, load_peft_adapter(tmp_path / "peft", config)))
    settings = json.loads((tmp_path / "ember" / "adapter_config.json").read_text())
    assert (settings["target_modules"], settings["layers_to_transform"]) == (["q_proj"], [1])
    saved, original = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("ember", "peft"))
    assert sorted(saved) == sorted(original)
    for name, value in original.items():
        np.testing.assert_array_equal(saved[name], value)


def test_tensors_for_layers_the_config_does_not_adapt_are_named(tmp_path):
    """PEFT adapts only ``layers_to_transform`` (an index or a list) and ignores factors for
    other layers; Ember loaded them by their names, another model than PEFT's."""
    peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], layers_to_transform=[1]).save_pretrained(tmp_path)
    q_proj, draw = "base_model.model.model.layers.0.self_attn.q_proj", np.random.default_rng(1).standard_normal
    factors = {"lora_A.weight": draw((4, 64), np.float32), "lora_B.weight": draw((64, 4), np.float32)}
    save_file({f"{q_proj}.{name}": x for name, x in factors.items()}, str(tmp_path / "adapter_model.safetensors"))
    config = ModelConfig(num_layers=2)
    with pytest.raises(DataError, match=r"layers\.0\.self_attn\.q_proj.*layers_to_transform=\[1\].*PEFT would ignore"):
        load_peft_adapter(tmp_path, config)
    settings = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**settings, "layers_to_transform": 0}))
    assert load_peft_adapter(tmp_path, config)


def test_adapters_on_a_mamba2_layer_are_refused_not_written_as_attention(tmp_path):
    """A Mamba-2 layer's output projection is ``attn/o/kernel`` in Ember, like attention's. An
    adapter on it (``targets: [o]`` on a hybrid or a Mamba-2 base) was written as
    ``model.layers.<i>.self_attn.o_proj`` with the mixer's shape: PEFT refused the directory
    (Target modules {'o_proj'} not found) and so did Ember's own loader (lora_A [4, 128], the
    model's o_proj takes [r, 64]). Now the export refuses it by name; the attention layer's
    adapters alone save and load back."""
    config = ModelConfig(
        vocab_size=32, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48, max_seq_len=32,
        block_pattern=("mamba2", "global"), mlp_pattern=("none", "dense"), attention_impl="xla", scan_layers=False,
    )  # fmt: skip
    # Jitted: op by op, the init and the adapters compiled ~120 programs.
    params = nn.meta.unbox(jax.jit(DecoderLM(config).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])

    def adapted_by(lora):
        return jax.jit(lambda p: trained(add_lora(p, lora, jax.random.key(1)), 0))(params)

    with pytest.raises(DataError, match=r"attn/o/kernel of a mamba2 layer has no PEFT equivalent"):
        save_peft_adapter(tmp_path / "o", config, adapted_by(LoraConfig(rank=2, targets=("o",))))
    adapted = adapted_by(LoraConfig(rank=2, targets=(r"block_1/attn/o/kernel$", "up")))
    save_peft_adapter(tmp_path / "attention", config, adapted)
    loaded = param_paths(load_peft_adapter(tmp_path / "attention", config))
    for path, value in loaded.items():
        assert_allclose(value, param_paths(adapted)[path], scale=1)
    assert {p.split("/attn/")[0] for p in loaded if "/attn/" in p} == {"group_0/block_1"}


def test_a_qwen3_adapter_loads_both_ways_with_peft_s_logits(tmp_path):
    """Qwen3's adapted modules are Llama's (``q_proj`` ... ``down_proj``); its QK-norm, between
    the adapted q/k projections and rotary embedding, is not adapted. Qwen3 was not loadable."""
    hf_config = transformers.Qwen3Config(**{**HF_CONFIG, "head_dim": 12})
    random_hf_model(hf_config, seed=4).save_pretrained(tmp_path / "base")
    config, params = hf.load(tmp_path / "base", attention_impl="xla")
    torch.manual_seed(6)
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "down_proj"], init_lora_weights=False)
    peft_model = peft.get_peft_model(fresh_hf(tmp_path / "base"), lora).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    expected = peft_logits(peft_model)
    adapted = with_adapter(params, load_peft_adapter(tmp_path / "adapter", config))
    assert_allclose(ember_logits(config, adapted), expected, scale=10)
    assert not np.allclose(expected, ember_logits(config, params), atol=1e-3)
    # ...and Ember's adapters (moved off their init) back into PEFT.
    ours = jax.jit(lambda p: trained(add_lora(p, LoraConfig(rank=2, targets=("k", "up")), jax.random.key(1)), 3))(
        params
    )
    save_peft_adapter(tmp_path / "ours", config, ours, base_model=str(tmp_path / "base"))
    peft_model = peft.PeftModel.from_pretrained(fresh_hf(tmp_path / "base"), tmp_path / "ours").eval()
    assert_allclose(peft_logits(peft_model), ember_logits(config, ours), scale=10)

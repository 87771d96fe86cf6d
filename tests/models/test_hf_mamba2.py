"""Hugging Face Mamba-2 parity: a tiny random ``transformers`` ``Mamba2ForCausalLM`` (two
groups, a clamped step size, built locally) gives Ember's logits after ``ember.models.hf.load``
at sequence lengths that are not multiples of the SSD chunk; ``save`` round-trips through
``transformers``; and ``ember generate --checkpoint <the HF dir>`` (the serving engine's
ragged decode path: chunked prefill, state slots, more prompts than slots) generates 64
greedy tokens equal to a full-recompute argmax loop over the ``transformers`` forward."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.cli import main
from ember.core.errors import ConfigError, DataError
from ember.models import hf
from ember.models.decoder import DecoderLM
from tests.hf_peers import random_hf_model
from tests.tolerances import assert_allclose

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CHUNK, NEW_TOKENS = 16, 64


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(hf_model, directory it was saved to, ember config, ember params)."""
    config = transformers.Mamba2Config(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        state_size=8,
        expand=2,
        head_dim=16,
        num_heads=4,
        n_groups=2,
        conv_kernel=4,
        chunk_size=CHUNK,
        time_step_limit=(0.0, 1.5),
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = random_hf_model(config, seed=21)
    path = tmp_path_factory.mktemp("mamba2")
    model.save_pretrained(path)
    ember_config, params = hf.load(path, attention_impl="xla")
    return model, path, ember_config, jax.tree.map(jnp.asarray, params)


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.array(tokens)), use_cache=False).logits.numpy()


def test_config_maps_the_architecture(pair):
    _, _, config, _ = pair
    assert config.block_pattern == ("mamba2",) and config.mlp_pattern == ("none",) and config.tie_embeddings
    ssm = config.ssm
    assert (ssm.state_size, ssm.n_groups, ssm.head_dim, ssm.heads(config.d_model)) == (8, 2, 16, 4)
    assert ssm.conv_kernel == 4 and ssm.chunk_size == CHUNK and ssm.time_step_limit == (0.0, 1.5)


def test_the_default_unclamped_step_size_limit_loads(tmp_path):
    """transformers writes the default ``time_step_limit`` ``(0, inf)`` as ``[0.0, {"__float__":
    "Infinity"}]`` in config.json; it loads as no clamp."""
    config = transformers.Mamba2Config(
        vocab_size=97, hidden_size=32, num_hidden_layers=1, head_dim=16, num_heads=4, n_groups=1
    )
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert hf.config_from_hf(written).ssm.time_step_limit == (0.0, float("inf")), written["time_step_limit"]


@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.001, float("inf")), (0.0, 1.5)])
def test_exported_step_size_limit_is_json_transformers_reads(pair, tmp_path, limit):
    """An infinite bound was written as a bare ``Infinity``, which is not JSON (strict parsers
    reject it; transformers writes ``{"__float__": "Infinity"}``)."""
    _, _, config, _ = pair
    config = dataclasses.replace(config, ssm=dataclasses.replace(config.ssm, time_step_limit=limit))
    text = json.dumps(hf.config_to_hf(config, "mamba2"), allow_nan=False)
    (tmp_path / "config.json").write_text(text)
    assert tuple(transformers.AutoConfig.from_pretrained(tmp_path).time_step_limit) == limit
    assert hf.config_from_hf(json.loads(text)).ssm.time_step_limit == limit


def test_logits_match_transformers(pair, rng):
    model, _, config, params = pair
    forward = jax.jit(DecoderLM(config).apply)
    for length in (CHUNK * 2 + 7, 5):  # not multiples of the chunk
        tokens = jax.random.randint(jax.random.fold_in(rng, length), (2, length), 0, config.vocab_size)
        ours, _ = forward({"params": params}, tokens)
        # The bar is 1e-4 on float32 logits.
        assert_allclose(ours, hf_logits(model, tokens), scale=10, err_msg=f"length {length}")


def test_save_round_trips_through_transformers(pair, tmp_path, rng):
    _, _, config, params = pair
    hf.save(tmp_path, config, params, model_type="mamba2")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = jax.random.randint(rng, (1, 21), 0, config.vocab_size)
    ours, _ = DecoderLM(config).apply({"params": params}, tokens)
    assert_allclose(ours, hf_logits(reloaded, tokens), scale=10)
    config_again, params_again = hf.load(tmp_path, attention_impl="xla")
    assert config_again == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params_again, params)


def full_recompute_greedy(model, prompt, max_tokens):
    """The trusted peer: the whole sequence through the ``transformers`` forward for every token."""
    sequence = list(prompt)
    for _ in range(max_tokens):
        sequence.append(int(np.argmax(hf_logits(model, [sequence])[0, -1])))
    return sequence[len(prompt) :]


@pytest.mark.slow  # compiles an engine in-process and runs 4 x 64 torch forwards
def test_ember_generate_matches_a_full_recompute_greedy_loop(pair, tmp_path, rng):
    model, path, _, _ = pair
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    prompts = [generator.integers(0, 97, size=int(n)).tolist() for n in generator.integers(2, 20, size=4)]
    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps({"prompt_tokens": p, "max_tokens": NEW_TOKENS}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    flags = ["--num-slots", "3", "--token-budget", "4", "--max-context", "96", "--no-progress"]
    assert main(["generate", "--checkpoint", str(path), "--prompts", str(lines), "--out", str(out), *flags]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(prompts)
    for prompt, record in zip(prompts, records):
        assert record["tokens"] == full_recompute_greedy(model, prompt, NEW_TOKENS)
        assert record["finish_reason"] == "length"


def test_unsupported_mamba2_configs_are_named(pair, tmp_path):
    _, path, config, params = pair
    hf_config = json.loads((path / "config.json").read_text())
    for field, value, match in (
        ("use_bias", True, "use_bias"),
        ("hidden_act", "gelu", "hidden_act"),
        ("num_heads", 3, "num_heads"),
    ):
        with pytest.raises(ConfigError, match=match):
            hf.config_from_hf({**hf_config, field: value})
    # Any power-of-two chunk computes the same function; others fall back to 64.
    assert hf.config_from_hf({**hf_config, "chunk_size": 100}).ssm.chunk_size == 64
    hybrid = dataclasses.replace(config, block_pattern=("mamba2", "global"), mlp_pattern=("none", "dense"))
    with pytest.raises(ConfigError, match="every layer is a mamba2 block"):
        hf.save(tmp_path, hybrid, params, model_type="mamba2")
    with pytest.raises(ConfigError, match="final_soft_cap"):
        hf.config_to_hf(dataclasses.replace(config, final_soft_cap=30.0), "mamba2")


@pytest.mark.parametrize("limit", [[0.0, None], [0.5], [0.0, 1.0, 2.0], "inf"])
def test_a_malformed_step_size_limit_is_a_config_error(pair, limit):
    """Before, ``[0.0, null]`` crashed with TypeError, ``[0.5]`` with IndexError, and a third
    bound or a string was dropped or read character by character."""
    _, path, _, _ = pair
    hf_config = {**json.loads((path / "config.json").read_text()), "time_step_limit": limit}
    with pytest.raises(ConfigError, match=r"time_step_limit must be \[low, high\]") as error:
        hf.config_from_hf(hf_config)
    assert error.value.key == "time_step_limit"


def test_weights_of_another_config_are_a_data_error_naming_the_tensor(pair):
    """Before, np.split cut in_proj at the wrong rows and a numpy reshape failed ("cannot reshape
    array of size 640 into shape (32,4)")."""
    _, path, config, _ = pair
    state = hf.read_state(path)
    other = dataclasses.replace(config, ssm=dataclasses.replace(config.ssm, n_groups=1))
    with pytest.raises(
        DataError, match=r"'backbone\.layers\.0\.mixer\.in_proj\.weight' has shape \(164, 32\).*\(148, 32\)"
    ):
        hf.params_from_hf(other, state)

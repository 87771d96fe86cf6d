"""Several adapters served at once (S-LoRA): one engine whose steps mix the base model and
three adapters (different ranks and targets, one DoRA) gives every request the tokens it
gets alone from its merged model; an unknown adapter is one request's error; adapters that
cannot be stacked are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.core.errors import ConfigError
from ember.core.sharding import unbox
from ember.core.tree import param_paths
from ember.models.adapters import LoraConfig, adapter_leaves, add_lora, merged_weights
from ember.models.adapters.lowrank import LowRank, low_rank_product
from ember.models.adapters.stacking import stack_adapters
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.hf.peft import with_adapter
from ember.models.quantization import QuantizeConfig, quantize_params
from ember.serving.engine import Engine
from ember.serving.model_program import build_program
from ember.serving.requests import FINISH_ERROR, SamplingParams
from tests.moved_adapters import moved
from tests.tolerances import assert_allclose

CONFIG = ModelConfig(
    vocab_size=97,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_dim=48,
    page_size=4,
    max_seq_len=32,
    init_std=0.2,
)
ADAPTERS = {
    "qv": LoraConfig(rank=2, alpha=4, targets=("q", "v")),
    "mlp": LoraConfig(rank=6, alpha=3, targets=("o", "up", "down"), rslora=True),
    "dora": LoraConfig(rank=3, alpha=6, targets=("k", "o", "gate"), dora=True),
}
OPTIONS = dict(num_slots=4, token_buckets=(4, 16), max_context=32)


def trained_adapter(base, config, seed):
    """An adapter whose factors and magnitudes are moved well away from their init."""
    return adapter_leaves(moved(add_lora(base, config, jax.random.key(seed)), seed, 0.3))


@pytest.fixture(scope="module")
def base():
    # Jitted: op by op, initialising and moving the weights compiled ~90 programs.
    return unbox(jax.jit(DecoderLM(CONFIG).init)(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))["params"])


@pytest.fixture(scope="module")
def setup(base):
    adapters = {
        name: jax.jit(lambda base, config=config, seed=seed: trained_adapter(base, config, seed))(base)
        for seed, (name, config) in enumerate(ADAPTERS.items())
    }
    return base, adapters, build_program(CONFIG, base, **OPTIONS)


def alone(program, params, prompt):
    """Greedy tokens of ``prompt`` from an engine holding only ``params`` (no adapters)."""
    engine = Engine(program.fresh_copy(params=params))
    return engine.generate([prompt], SamplingParams(max_tokens=8))[0].tokens


def test_a_mixed_batch_equals_each_request_alone_with_its_merged_model(setup):
    """Every prompt begins with the same nine tokens: the requests of one adapter share their
    cached pages (prefix caching), those of different adapters do not (their keys and values differ)."""
    base, adapters, base_program = setup
    engine = Engine.from_model(CONFIG, base, adapters=adapters, **OPTIONS)
    rng = np.random.default_rng(0)
    beginning = rng.integers(0, 97, 9).tolist()
    prompts = [beginning + rng.integers(0, 97, n).tolist() for n in (1, 4, 0, 3, 2, 5)]
    names = [None, "qv", "mlp", "dora", "mlp", "qv"]
    results = engine.generate(prompts, [SamplingParams(max_tokens=8, adapter=name) for name in names])
    assert engine.scheduler.pages.hit_tokens == 2 * 8  # the second "mlp" and "qv" requests: two pages each
    merge = jax.jit(lambda adapter: merged_weights(with_adapter(base, adapter)))
    for prompt, name, result in zip(prompts, names, results):
        merged = base if name is None else merge(adapters[name])
        assert result.tokens == alone(base_program, merged, prompt), name
        if name is not None:
            assert result.tokens != alone(base_program, base, prompt), f"adapter {name} changed nothing"


def test_an_unknown_adapter_is_one_error_and_the_batch_completes(setup):
    base, adapters, _ = setup
    engine = Engine.from_model(CONFIG, base, adapters={"qv": adapters["qv"]}, **OPTIONS)
    results = engine.generate(
        [[1, 2, 3], [4, 5, 6]],
        [SamplingParams(max_tokens=4, adapter="nope"), SamplingParams(max_tokens=4, adapter="qv")],
    )
    assert results[0].finish_reason == FINISH_ERROR and "unknown adapter 'nope'" in results[0].error
    assert "qv" in results[0].error
    assert len(results[1].tokens) == 4 and results[1].error is None


def test_adapters_that_cannot_be_stacked_are_refused(setup):
    base, adapters, _ = setup
    with pytest.raises(ConfigError, match="at least one adapter"):
        stack_adapters(base, {})
    wrong = jax.tree.map(lambda x: x[..., :1] if x.ndim > 1 else x, adapters["qv"])
    with pytest.raises(ConfigError, match="do not fit the weight"):
        stack_adapters(base, {"bad": wrong})
    with pytest.raises(
        ConfigError, match=r"carries adapters of its own \(2 weights, e\.g\. layers/block_0/attn/q/kernel"
    ):
        stack_adapters(with_adapter(base, adapters["qv"]), {"mlp": adapters["mlp"]})
    quantized = quantize_params(base, QuantizeConfig(targets=("k",)))
    with pytest.raises(ConfigError, match=r"a DoRA adapter targets layers/block_0/attn/k/kernel, which this base"):
        stack_adapters(quantized, {"dora": adapters["dora"]})


def test_adapters_are_served_together_on_a_quantized_base(setup):
    """DESIGN section 7: many adapters at once, the base weights staying quantized on the device.
    Stacking on a quantized weight was refused; now each request gets the tokens it gets from
    an engine serving the quantized base with its one adapter (as a QLoRA run is served)."""
    base, adapters, _ = setup
    quantized = quantize_params(base, QuantizeConfig(format="int8"))
    chosen = {name: adapters[name] for name in ("qv", "mlp")}
    options = dict(OPTIONS, token_buckets=(16,))
    engine = Engine.from_model(CONFIG, quantized, adapters=chosen, **options)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 97, n).tolist() for n in (5, 9, 3, 7)]
    names = [None, "qv", "mlp", "qv"]
    results = engine.generate(prompts, [SamplingParams(max_tokens=8, adapter=name) for name in names])
    alone = {
        name: Engine.from_model(CONFIG, quantized if name is None else with_adapter(quantized, chosen[name]), **options)
        for name in (None, *chosen)
    }
    for prompt, name, result in zip(prompts, names, results):
        expected = alone[name].generate([prompt], SamplingParams(max_tokens=8))[0].tokens
        assert result.tokens == expected, name
        if name is not None:
            assert expected != alone[None].generate([prompt], SamplingParams(max_tokens=8))[0].tokens, name


def test_a_pissa_adapter_is_stacked_against_the_original_base(base):
    """PiSSA trains its factors on the residual ``W - scale A0 B0``: stacked on the original
    ``W`` beside a plain LoRA adapter, each slot's weight is the one its own run trained."""
    configs = {"pissa": LoraConfig(rank=2, alpha=4, targets=("q", "up"), init="pissa"), "lora": ADAPTERS["qv"]}
    runs = {name: moved(add_lora(base, config, jax.random.key(7)), 7, 0.3) for name, config in configs.items()}
    stacked, names = stack_adapters(base, {name: adapter_leaves(params) for name, params in runs.items()})
    flat = param_paths(stacked)
    for slot, name in enumerate(names):
        trained = param_paths(merged_weights(runs[name]))
        for path in ("layers/block_0/attn/q/kernel", "layers/block_0/mlp/up"):
            a, b = flat[path + "_lora_a"][:, slot], flat[path + "_lora_b"][:, slot]  # [layers, adapters, ...]
            served = flat[path] + low_rank_product(LowRank(a, b, jnp.ones(())), lead_dims=1)
            assert_allclose(served, trained[path], err_msg=f"{name} {path}")

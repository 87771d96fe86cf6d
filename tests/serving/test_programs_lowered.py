"""Building, exporting and loading a serving program compiles its steps and little else: the
weights' conversion to the dtypes the steps read them in and the empty cache are one program
each, and an artifact's weights are placed, not converted leaf by leaf. Each eager op of a new
shape compiles a program of its own (tests/programs.py): op by op, a quantized hybrid model's
build compiled a program per float weight shape and per cache entry shape, and loading its
artifact one per stored leaf shape.

The model's sizes are its own (no other test compiles its shapes): a program another test had
built would not be counted."""

from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.quantization import QuantizeConfig, quantize_params
from ember.serving.engine import Engine
from ember.serving.export import export_program, load_artifact
from ember.serving.model_program import build_program
from ember.serving.requests import SamplingParams
from tests.programs import programs_lowered

CONFIG = ModelConfig(
    vocab_size=151, d_model=40, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=88, page_size=4, max_seq_len=16,
    block_pattern=("global", "linear"), attention_impl="xla", precision="bf16",
)  # fmt: skip
QUANTIZE = QuantizeConfig(format="int8", targets=("q", "k", "v", "o"))
"""The attention projections stored int8; the MLPs and embeddings stay float (read in bf16)."""
OPTIONS = dict(num_slots=2, token_buckets=(4,), max_context=16)


@jax.jit
def quantized_weights(key):
    """Random weights, the attention projections stored int8 (one program)."""
    params = DecoderLM(CONFIG).init(key, jnp.zeros((1, 4), jnp.int32))["params"]
    return quantize_params(nn.meta.unbox(params), QUANTIZE)


def steps_and_others(lowered):
    """``(steps, the other programs)`` of a list of lowered programs' names."""
    steps = [name for name in lowered if name in ("jit(model_step)", "jit(call)")]
    return steps, Counter(name for name in lowered if name not in steps)


def test_a_quantized_program_compiles_its_steps_one_cache_and_one_weight_conversion(rng, tmp_path):
    params = quantized_weights(rng)
    with programs_lowered() as lowered:
        program = build_program(CONFIG, params, **OPTIONS)
    steps, others = steps_and_others(lowered)
    # Old code: 7 others (a conversion per float weight shape, zeros per cache entry shape and dtype).
    assert len(steps) == 1 and sum(others.values()) <= 2, lowered
    with programs_lowered() as lowered:
        copy = program.fresh_copy(params)
    assert not lowered
    with programs_lowered() as lowered:
        export_program(CONFIG, params, tmp_path, **OPTIONS)
        loaded, _, _ = load_artifact(tmp_path)
    steps, others = steps_and_others(lowered)
    # The step exported, then compiled. Old code: 11 others (one per stored leaf shape and dtype).
    assert len(steps) == 2 and not others, lowered
    settings = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=True, temperature=0.8, seed=7)
    built, served = (Engine(p).generate([[3, 141, 7, 29, 5]], settings)[0] for p in (copy, loaded))
    assert built.tokens == served.tokens and len(built.tokens) == 5
    np.testing.assert_array_equal(built.logprobs, served.logprobs)
